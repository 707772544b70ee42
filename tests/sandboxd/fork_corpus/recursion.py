import sys
def f(n):
    try:
        return f(n + 1)
    except RecursionError:
        return n
print(f(0), sys.getrecursionlimit())
sys.setrecursionlimit(200)
print(f(0))
