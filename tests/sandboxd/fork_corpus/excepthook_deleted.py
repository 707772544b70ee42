import sys

del sys.excepthook
raise ValueError("uncaught")
