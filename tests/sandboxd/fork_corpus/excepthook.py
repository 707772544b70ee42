import sys
def hook(t, v, tb):
    print("custom hook:", t.__name__, v, file=sys.stderr)
sys.excepthook = hook
raise ValueError("x")
