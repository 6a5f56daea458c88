# os.execv a shell that touches the marker.
# expect: Operation not permitted
import os

os.execv("/bin/sh", ["sh", "-c", f"touch {MARKER}"])
