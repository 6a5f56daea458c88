# os.fork: the child writes the marker.
# expect: Operation not permitted
import os

if os.fork() == 0:
    open(MARKER, "w").write("child")
    os._exit(0)
