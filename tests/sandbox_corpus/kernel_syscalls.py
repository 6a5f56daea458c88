# ctypes: bpf, perf_event_open, keyctl, add_key, io_uring_setup, userfaultfd, clone3 with CLONE_NEWUSER.
# expect: all refused
import ctypes

libc = ctypes.CDLL(None, use_errno=True)
calls = {
    "bpf": (321, 0, 0, 0),
    "perf_event_open": (298, 0, 0, -1, -1, 0),
    "keyctl": (250, 0, 0),
    "add_key": (248, b"user", b"k", b"v", 1, -4),
    "io_uring_setup": (425, 8, 0),
    "userfaultfd": (323, 0),
    "clone3": (435, 0, 0),
}
results = {name: (libc.syscall(*args), ctypes.get_errno()) for name, args in calls.items()}
if any(r == 0 or r > 0 for r, _ in results.values()):
    open(MARKER, "w").write(str(results))
raise PermissionError(f"all refused: {results}")
