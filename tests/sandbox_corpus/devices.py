# Host devices: memory, disks, the kernel log, the tty.
# expect: No such file|No such device|Permission denied|Operation not permitted
import os

print(sorted(os.listdir("/dev")))
for dev in ("/dev/kmsg", "/dev/mem", "/dev/sda", "/dev/vda", "/dev/nvme0n1", "/dev/tty"):
    try:
        open(dev, "rb").read(16)
        open(MARKER, "w").write(dev)
    except OSError as exc:
        last = exc
raise last
