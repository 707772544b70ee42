import atexit
import sys

atexit.register(lambda: print("handled at exit:", sys.exc_info()[0]))
sys.exit(3)
