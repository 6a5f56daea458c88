# subprocess and os.system: a shell that touches the marker.
# expect: Operation not permitted
import os
import subprocess

status = os.system(f"touch {MARKER}")
subprocess.run(["/bin/sh", "-c", f"touch {MARKER}"], check=True)
