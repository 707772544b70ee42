import os, atexit
atexit.register(print, "never")
print("x", flush=True)
os._exit(7)
