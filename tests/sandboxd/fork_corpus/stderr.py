import sys
print("out"); print("err", file=sys.stderr); sys.stdout.write("partial")
