try:
    open("big", "wb").write(b"\0" * (100 << 20))
except OSError as e:
    print("refused", e.strerror)
