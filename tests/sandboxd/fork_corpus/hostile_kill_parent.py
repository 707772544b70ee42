import os, signal
for target in (os.getppid(), 1, -1):
    try:
        os.kill(target, signal.SIGKILL)
    except OSError as e:
        print("kill", target, type(e).__name__)
if os.fork() == 0:
    os.kill(os.getppid(), signal.SIGKILL)
    os._exit(0)
os.wait()
print("done")
