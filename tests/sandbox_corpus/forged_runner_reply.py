# Write a forged answer on this process's own reply pipe: image "paths" outside (absolute, .., symlink), huge counts.
# expect: refused|malformed|killed
import json
import os
import struct

os.symlink(SECRET_FILE, "link.png")
fake = {
    "stdout": "FORGED",
    "error": None,
    "note": None,
    "images": [VICTIM, "../../" + VICTIM, "/etc/shadow", os.path.abspath("link.png")],
}
data = json.dumps(fake).encode()
for entry in os.listdir("/proc/self/fd"):
    try:
        os.write(int(entry), struct.pack("!I", len(data)) + data)
    except OSError:
        pass
