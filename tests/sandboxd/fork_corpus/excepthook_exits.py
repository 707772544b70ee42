import atexit
import sys


def hook(kind, value, traceback):
    print("hook", kind.__name__)
    sys.exit(7)


atexit.register(print, "atexit")
sys.excepthook = hook
raise ValueError("uncaught")
