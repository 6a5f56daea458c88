# ctypes: unshare a new user + mount namespace, then mount a tmpfs over / or bind the host root.
# expect: refused
import ctypes

libc = ctypes.CDLL(None, use_errno=True)
results = [
    libc.unshare(0x10000000 | 0x00020000),
    libc.mount(b"none", b"/tmp", b"tmpfs", 0, None),
    libc.mount(b"/", b"/tmp", None, 4096, None),  # MS_BIND
    libc.syscall(308, 3, 0),  # setns
]
if any(r == 0 for r in results):
    open(MARKER, "w").write("mounted")
raise PermissionError(f"all refused: {results}")
