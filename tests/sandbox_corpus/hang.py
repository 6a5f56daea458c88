# Hang forever with signals ignored.
# expect: timed out after
import signal

for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGALRM):
    signal.signal(sig, signal.SIG_IGN)
while True:
    pass
