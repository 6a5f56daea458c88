# A fork bomb.
# expect: Operation not permitted
import os

while True:
    os.fork()
