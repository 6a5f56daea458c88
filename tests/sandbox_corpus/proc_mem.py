# /proc/<pid>/mem: read the supervisor's memory (its nonces) and bwrap's; write into them.
# expect: Permission denied|Input/output error|No such process
import os

for pid in (os.getppid(), 1):
    with open(f"/proc/{pid}/mem", "r+b", buffering=0) as mem:
        mem.seek(0x400000)
        mem.write(b"\xcc")
open(MARKER, "w").write("wrote memory")
