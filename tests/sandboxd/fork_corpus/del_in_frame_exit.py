import atexit
import sys


class Noisy:
    def __del__(self):
        print("freed")


def main():
    kept = Noisy()
    sys.exit(0)


atexit.register(print, "atexit")
main()
