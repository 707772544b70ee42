import os
n = 0
try:
    while n < 10000:
        if os.fork() == 0:
            import time
            time.sleep(5)
            os._exit(0)
        n += 1
except OSError as e:
    print("fork refused", type(e).__name__, n < 200)
