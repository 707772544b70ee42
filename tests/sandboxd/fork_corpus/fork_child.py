import os
pid = os.fork()
if pid == 0:
    print("child", os.getpid() != 1, flush=True)
    os._exit(5)
_, status = os.waitpid(pid, 0)
print("parent", os.getpid(), os.waitstatus_to_exitcode(status))
