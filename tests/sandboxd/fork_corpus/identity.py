import sys, os
print(__name__, sys.argv, __file__, sys.path[0], os.getcwd(), sorted(globals()))
print(sorted(sys.modules))
print(sys.getrecursionlimit(), sys.flags, os.environ == {k: v for k, v in os.environ.items()}, sorted(os.environ))
print(input(), sys.stdin.read())
