import sys


def hook(kind, value, traceback):
    raise RuntimeError("the hook failed")


sys.excepthook = hook
raise ValueError("uncaught")
