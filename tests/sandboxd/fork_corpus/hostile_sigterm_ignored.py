import signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("partial", flush=True)
time.sleep(60)
