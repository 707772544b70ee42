import sys


class Unprintable:
    def __str__(self):
        raise RuntimeError("no str")


sys.exit(Unprintable())
