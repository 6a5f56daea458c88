# Read the trainer's next request from stdin or from fd 0, and input().
# expect: EOFError
import os

data = os.read(0, 4096)
print(data)
input()
