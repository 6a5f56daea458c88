# Kill the supervisor that holds the trainer's channel (our parent) and the sandbox's init.
# expect: killed
import os
import signal

os.kill(os.getppid(), signal.SIGKILL)
os.kill(1, signal.SIGKILL)
import time

time.sleep(5)
