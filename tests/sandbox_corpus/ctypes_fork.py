# ctypes: the raw fork syscall (57) and clone without CLONE_THREAD, child writes the marker.
# expect: fork refused
import ctypes
import os

libc = ctypes.CDLL(None, use_errno=True)
for pid in (libc.syscall(57), libc.syscall(56, 17, 0, 0, 0, 0)):  # fork; clone(SIGCHLD)
    if pid == 0:
        open(MARKER, "w").write("child")
        os._exit(0)
    if pid > 0:
        raise SystemExit("a process was created")
raise PermissionError(f"fork refused: errno {ctypes.get_errno()}")
