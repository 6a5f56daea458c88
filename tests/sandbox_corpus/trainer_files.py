# Read the trainer's files: the secret, the test file, the victim, and list /root, /home, the current dir's parents.
# expect: No such file
import os

for path in ("/root", "/home", "/work", os.path.dirname(SECRET_FILE)):
    try:
        print(path, os.listdir(path))
    except OSError as exc:
        print(path, exc)
print(open(VICTIM).read())
print(open(SECRET_FILE).read())
