# Read the environment of pid 1, the parent, every visible pid, and our own: the trainer's secrets?
# expect: SCANNED
import os

leaked = []
for entry in os.listdir("/proc"):
    if entry.isdigit():
        try:
            leaked.append(open(f"/proc/{entry}/environ", "rb").read().decode(errors="replace"))
        except OSError:
            pass
print("SCANNED", leaked, dict(os.environ))
