import os
for d in ["/usr", "/etc", "/", "/tmp", "/dev", "/proc", "/sandbox/..", "/dev/shm", "/sys"]:
    p = os.path.join(d, "escape-marker")
    try:
        open(p, "w").write("x")
        print("wrote", p)
    except OSError as e:
        print("denied", p, type(e).__name__)
