import atexit
atexit.register(print, "atexit ran")
class A:
    def __del__(self):
        print("del ran")
a = A()
def g():
    raise ValueError("boom")
g()
