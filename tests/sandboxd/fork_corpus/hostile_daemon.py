import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        time.sleep(30)
        open("/sandbox/daemon-was-here", "w").write("x")
    os._exit(0)
print("parent done", flush=True)
