# Read /etc/shadow and /etc/passwd and copy them outside.
# expect: No such file
data = open("/etc/shadow").read() + open("/etc/passwd").read()
open(MARKER, "w").write(data)
