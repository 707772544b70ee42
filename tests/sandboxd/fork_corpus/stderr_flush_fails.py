import sys


class NoFlush:
    def write(self, text):
        return len(text)


print("out")
sys.stderr = NoFlush()
