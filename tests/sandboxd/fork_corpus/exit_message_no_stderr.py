import sys

print("out")
sys.stderr = None
sys.exit("the message goes to fd 2")
