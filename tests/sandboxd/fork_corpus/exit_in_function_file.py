import atexit
import sys


def main():
    out = open("out.txt", "w")
    out.write("written before sys.exit")
    sys.exit(0)


atexit.register(lambda: print("at exit:", repr(open("out.txt").read())))
main()
