# Replace the posixpath helpers a Python-level check relies on, then read the secret and write outside.
# expect: No such file|Permission denied
import os.path
import posixpath

posixpath.realpath = os.path.realpath = lambda p, *a, **k: "/tmp/ok"
posixpath.abspath = lambda p: "/tmp/ok"
secret = open(SECRET_FILE).read()
open(MARKER, "w").write(secret)
print(secret)
