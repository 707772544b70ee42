import os
for path in ["/etc/shadow", "/etc/passwd", "/proc/1/environ", "/root/.bashrc"]:
    try:
        print(path, open(path, "rb").read()[:200])
    except OSError as e:
        print(path, "denied", type(e).__name__)
print(sorted(os.environ.items()))
for pid in sorted(os.listdir("/proc")):
    if pid.isdigit():
        print(pid, open(f"/proc/{pid}/cmdline", "rb").read())
