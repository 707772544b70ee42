import atexit
import sys

atexit.register(lambda: print(getattr(sys, "last_type", None)))
raise ValueError("uncaught")
