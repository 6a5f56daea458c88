# ctypes ptrace: attach to the supervisor (pid of our parent) and to pid 1.
# expect: ptrace refused
import ctypes
import os

libc = ctypes.CDLL(None, use_errno=True)
results = [libc.ptrace(16, pid, None, None) for pid in (os.getppid(), 1, HOST_PID)]  # PTRACE_ATTACH
if 0 in results:
    open(MARKER, "w").write("attached")
raise PermissionError(f"ptrace refused: {results} errno {ctypes.get_errno()}")
