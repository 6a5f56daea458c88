# Start threads without end.
# expect: can't start new thread
import threading
import time

threads = []
while True:
    t = threading.Thread(target=time.sleep, args=(30,), daemon=True)
    t.start()
    threads.append(t)
