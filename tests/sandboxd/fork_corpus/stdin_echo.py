import sys
first = input()
rest = sys.stdin.read()
print(repr(first), repr(rest), sys.stdin.isatty(), sys.stdout.isatty())
