# _posixsubprocess.fork_exec: start a shell that creates the marker outside (raised no audit event).
# expect: Operation not permitted
import _posixsubprocess
import os

r, w = os.pipe()
_posixsubprocess.fork_exec(
    [b"/bin/sh", b"-c", b"touch " + MARKER.encode()],
    [b"/bin/sh"],
    True,
    (w,),
    None,
    None,
    -1,
    -1,
    -1,
    -1,
    -1,
    -1,
    r,
    w,
    True,
    False,
    -1,
    None,
    None,
    None,
    -1,
    None,
    False,
)  # the signature of Python 3.11 and 3.12: args ... gid, groups, uid, umask, preexec_fn, allow_vfork
