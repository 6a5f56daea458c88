# Change the read-only view: the Python stdlib (os.py), numpy, the sandbox worker, /usr.
# expect: Read-only file system|Permission denied
import os

import numpy

for path in (os.__file__, numpy.__file__, "/opt/vlm_grpo_sandbox/worker.py", "/usr/bin/marker"):
    try:
        open(path, "a").write("# tampered")
    except OSError as exc:
        last = exc
raise last
