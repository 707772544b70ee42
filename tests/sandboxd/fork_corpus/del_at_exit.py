class Noisy:
    def __del__(self):
        print("finalizer ran")
keep = Noisy()
print("main done")
