# ctypes / os: become root (setuid 0, setresuid, setgroups) and write outside.
# expect: Operation not permitted|Invalid argument
import os

os.setuid(0)
open(MARKER, "w").write("root")
