"""The python fork server (zygote): stdlib only; runs inside its own bwrap as `python3 main.py`.

It is started exactly as a program is (`/usr/bin/python3 main.py`, the same environment), so the
interpreter's start-up is done once and is the same start-up a run would have had. It never runs
user code itself: per request it forks a runner that

- joins the run's cgroup, enters fresh mount, PID, network, IPC and UTS namespaces, binds the
  run's working dir at /sandbox, mounts a fresh tmpfs on /tmp and /dev/shm, detaches everything
  of the zygote's own (the run dirs, the cgroup tree, this script), brings up a fresh loopback;
- forks the program (PID 1 of the new PID namespace, its own session), which mounts a fresh
  /proc, sets the rlimits, drops the capability bounding set, becomes uid/gid 65534 with
  `no_new_privs`, forgets every module the zygote imported, and runs /sandbox/main.py as
  `__main__` (the zygote's frames are compensated in the recursion limit);
- waits for the program and exits with its status (128 + signal for a signal death, as bwrap).

Protocol on fd 0 (a SOCK_SEQPACKET socket; fd 0 is then /dev/null): a request is one JSON
message with three fds (stdin, stdout, stderr); the zygote answers {"id", "pid"} after the fork
and {"id", "status", "cpu"} when the runner is reaped; a runner that fails its set-up sends
{"id", "error"} itself. EOF: the service is gone: every runner is killed and the zygote exits.
"""

import sys

BASELINE_MODULES = frozenset(sys.modules)  # what a fresh `python3 main.py` has loaded

import ctypes  # noqa: E402
import fcntl  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import select  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import struct  # noqa: E402

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 2, 4, 8, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 24, 38
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
SANDBOX_UID = 65534
RUNS = "/runs"  # the service's run dirs, bound here for the zygote only
SETUP_FAILED = 125

libc = ctypes.CDLL(None, use_errno=True)


def _check(result, what):
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source, target, fstype, flags, data=None):
    _check(
        libc.mount(
            source and source.encode(),
            target.encode(),
            fstype and fstype.encode(),
            flags,
            data and data.encode(),
        ),
        f"mount {target}",
    )


def _detach(target):
    _check(libc.umount2(target.encode(), MNT_DETACH), f"umount {target}")


def _loopback_up():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, req))[1]
        fcntl.ioctl(s.fileno(), SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))


class RecursionCompensation:
    """Hide the zygote's own frames from the recursion limit.

    The program's module frame sits below this script's frames, so with the same limit it would
    hit RecursionError a few frames early. `sys.setrecursionlimit(limit + k)` gives the frames
    back; writing `limit` into the interpreter's stored limit keeps `sys.getrecursionlimit()`
    as a fresh interpreter reports it. The field is located by value (and verified) at start-up;
    when it cannot be found, nothing is changed.
    """

    def __init__(self):
        self.offset = None
        try:
            interp = ctypes.pythonapi.PyInterpreterState_Get
            interp.restype = ctypes.c_void_p
            self.interp = interp()
            original = sys.getrecursionlimit()
            sys.setrecursionlimit(48611)
            first = self._find(48611)
            sys.setrecursionlimit(48613)
            if first is not None and self._read(first) == 48613:
                self.offset = first
            sys.setrecursionlimit(original)
        except (AttributeError, OSError, ValueError):
            self.offset = None

    def _read(self, offset):
        return ctypes.c_int.from_address(self.interp + offset).value

    def _find(self, value):
        for offset in range(0, 4096, 4):
            if self._read(offset) == value:
                return offset
        return None

    def apply(self, extra_frames):
        if self.offset is None:
            return
        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(limit + extra_frames)
        ctypes.c_int.from_address(self.interp + self.offset).value = limit


def _enter_sandbox(req):
    """In the runner (root, zygote namespaces): everything up to the program's fork."""
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    for procs in req["cgroup_procs"]:
        with open(procs, "w") as f:
            f.write("0")
    flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
    _check(libc.unshare(flags), "unshare")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount(f"{RUNS}/{req['workdir']}", "/sandbox", None, MS_BIND | MS_REC)
    for target in (RUNS, "/sys/fs/cgroup", "/zygote"):
        _detach(target)
    _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777")
    _mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777")
    _loopback_up()
    os.chdir("/sandbox")


def _become_program(req, fds):
    """In the program (PID 1 of its namespace): /proc, limits, identity, stdio."""
    os.setsid()
    _detach("/proc")
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for res, value in req["rlimits"]:
        os.setrlimit(res, (value, value))
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last_cap = int(f.read())
    for cap in range(last_cap + 1):
        _check(libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), "drop capability")
    os.setgroups([])
    os.setresgid(SANDBOX_UID, SANDBOX_UID, SANDBOX_UID)
    os.setresuid(SANDBOX_UID, SANDBOX_UID, SANDBOX_UID)
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # cleared by the uid change
    for target, fd in zip((0, 1, 2), fds, strict=True):
        os.dup2(fd, target)
    os.closerange(3, 65536)


def _runner(ctl, req, fds):
    """The forked runner: set up, fork the program, wait, exit with its status. Never returns
    in the runner; returns in the program (to run it from the top of the zygote's stack)."""
    try:
        _enter_sandbox(req)
        pid = os.fork()
    except OSError as exc:
        _report(ctl, {"id": req["id"], "error": f"sandbox set-up failed: {exc}"})
        os._exit(SETUP_FAILED)
    if pid == 0:
        try:
            _become_program(req, fds)
        except OSError as exc:
            os.write(fds[2], f"sandbox set-up failed: {exc}\n".encode())
            os._exit(SETUP_FAILED)
        return
    for fd in fds:
        os.close(fd)
    ctl.close()
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except ChildProcessError:
            os._exit(SETUP_FAILED)
        except InterruptedError:
            continue
    code = os.waitstatus_to_exitcode(status)
    os._exit(128 - code if code < 0 else code)


def _report(ctl, message):
    try:
        ctl.send(json.dumps(message).encode())
    except OSError:
        pass


def serve():
    """The zygote's loop; returns only in a forked program, with what it must run."""
    ctl = socket.socket(fileno=os.dup(0))
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    poller = select.poll()
    poller.register(ctl.fileno(), select.POLLIN)
    runners = {}  # pidfd -> (run id, pid)
    while True:
        for fd, _ in poller.poll():
            if fd != ctl.fileno():
                run_id, pid = runners.pop(fd)
                poller.unregister(fd)
                os.close(fd)
                _, status, usage = os.wait4(pid, 0)
                code = os.waitstatus_to_exitcode(status)
                cpu = usage.ru_utime + usage.ru_stime
                _report(ctl, {"id": run_id, "status": code, "cpu": cpu})
                continue
            data, fds, _, _ = socket.recv_fds(ctl, 65536, 3)
            if not data:
                for _, pid in runners.values():
                    os.kill(pid, signal.SIGKILL)
                os._exit(0)
            req = json.loads(data)
            pid = os.fork()
            if pid == 0:
                for pidfd in runners:
                    os.close(pidfd)
                _runner(ctl, req, fds)
                ctl.detach()
                return req
            for received in fds:
                os.close(received)
            pidfd = os.pidfd_open(pid)
            runners[pidfd] = (req["id"], pid)
            poller.register(pidfd, select.POLLIN)
            _report(ctl, {"id": req["id"], "pid": pid})


def _forget_zygote_modules():
    for name in [m for m in sys.modules if m not in BASELINE_MODULES]:
        del sys.modules[name]
    sys.path_importer_cache.pop("/zygote", None)


RECURSION = RecursionCompensation()
JOB = serve()
# From here on: the program's process. Make it look like `python3 main.py` in /sandbox.
_forget_zygote_modules()
sys.argv[:] = ["main.py", *JOB.get("argv", [])]
sys.path[0] = "/sandbox"
with open("/sandbox/main.py", "rb") as _source:
    _code = compile(_source.read(), "/sandbox/main.py", "exec", dont_inherit=True)
_main = type(sys)("__main__")
_main.__file__ = "/sandbox/main.py"
_main.__cached__ = None
_main.__loader__ = type(__loader__)("__main__", "/sandbox/main.py")
_main.__builtins__ = __builtins__
sys.modules["__main__"] = _main
del JOB, _source
RECURSION.apply(1)  # this module's frame sits below the program's
try:
    exec(_code, _main.__dict__)
except SystemExit:
    raise
except BaseException as _exc:  # an uncaught exception: printed as the interpreter would
    _tb = _exc.__traceback__.tb_next if _exc.__traceback__ else None
    sys.excepthook(type(_exc), _exc, _tb)
    if isinstance(_exc, KeyboardInterrupt):
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    raise SystemExit(1) from None
