def f():
    f()
f()
