import threading


def fails():
    raise RuntimeError("shutdown failed")


threading._shutdown = fails
print("out")
