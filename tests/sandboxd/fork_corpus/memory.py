x = bytearray(2 << 30)
print(len(x))
