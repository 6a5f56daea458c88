# os.posix_spawn a shell that touches the marker.
# expect: Operation not permitted
import os

os.posix_spawn("/bin/sh", ["sh", "-c", f"touch {MARKER}"], {})
