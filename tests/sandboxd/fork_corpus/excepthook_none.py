import sys

sys.excepthook = None
raise ValueError("uncaught")
