# ctypes: execve and execveat of a shell that touches the marker.
# expect: execve refused
import ctypes

libc = ctypes.CDLL(None, use_errno=True)
argv = (ctypes.c_char_p * 4)(b"/bin/sh", b"-c", b"touch " + MARKER.encode(), None)
libc.execve(b"/bin/sh", argv, None)
libc.syscall(322, -100, b"/bin/sh", argv, None, 0)
raise PermissionError(f"execve refused: errno {ctypes.get_errno()}")
