import atexit
import sys


def at_exit():
    print("handled at exit:", sys.exc_info()[0])


def hook(kind, value, traceback):
    print("handled in the hook:", sys.exc_info()[0])
    sys.__excepthook__(kind, value, traceback)


atexit.register(at_exit)
sys.excepthook = hook
raise ValueError("uncaught")
