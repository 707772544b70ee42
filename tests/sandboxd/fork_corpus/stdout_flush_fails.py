import sys


class FailsToFlush:
    def write(self, text):
        return len(text)

    def flush(self):
        raise RuntimeError("cannot flush")

    def __repr__(self):
        return "<FailsToFlush>"


sys.stdout = FailsToFlush()
print("lost")
