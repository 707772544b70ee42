import signal
print(signal.getsignal(signal.SIGPIPE), signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))
