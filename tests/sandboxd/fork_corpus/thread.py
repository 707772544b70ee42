import threading, time
def w():
    time.sleep(0.2)
    print("thread done")
threading.Thread(target=w).start()
print("main done")
