import sys, atexit
atexit.register(lambda: print("bye"))
sys.exit("a message")
