# Flood the output: 20 million characters through print, sys.stderr and fd 1/2 directly.
# expect: more characters of output were cut
import os
import sys

for _ in range(20):
    print("A" * 10**6)
    sys.stderr.write("B" * 10**5)
    os.write(1, b"C" * 10**5)
    os.write(2, b"D" * 10**5)
