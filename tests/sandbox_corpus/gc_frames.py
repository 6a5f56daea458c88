# Walk gc objects and frames looking for the trainer's channel or a nonce, then forge a reply on every fd found.
# expect: forged reply sent|Bad file descriptor
import gc
import os
import struct
import sys

found = [o for o in gc.get_objects() if isinstance(o, (bytes, bytearray)) and len(o) == 16]
frame = sys._getframe()
while frame.f_back is not None:
    frame = frame.f_back
for fd in [int(e) for e in os.listdir("/proc/self/fd")]:
    for nonce in found[:50]:
        body = b'{"stdout": "forged", "images": ["' + VICTIM.encode() + b'"], "error": null}'
        try:
            os.write(fd, struct.pack("!4s16sQI", b"VGRP", bytes(nonce), 1, len(body)) + body)
        except OSError:
            pass
print("forged reply sent")
