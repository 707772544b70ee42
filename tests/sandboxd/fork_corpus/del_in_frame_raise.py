import atexit


class Noisy:
    def __del__(self):
        print("freed")


def main():
    kept = Noisy()
    raise ValueError("uncaught")


atexit.register(print, "atexit")
main()
