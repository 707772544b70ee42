"""The python fork server (zygote): stdlib only; runs inside its own bwrap as `python3 main.py`.

Started exactly as a program is (same argv, same environment), it does the interpreter's
start-up once and never runs user code. It clones runners ahead of time: one clone() creates each
runner in fresh mount, PID (as its PID 1), network, IPC, UTS and cgroup namespaces; the runner
pivots into a fresh root laid out like a bwrap sandbox, joins its cgroup and waits for a request:
then it binds the run dir at /sandbox, detaches the zygote's root, sets rlimits, drops every
capability, becomes 65534 with no_new_privs, forgets the zygote's modules and runs
/sandbox/main.py as `__main__`. The zygote reaps it and reports its status (128 + signal for a
signal death, as bwrap reports it). One process per run: a second fork (to become PID 1 of a
namespace made by unshare) cost a copy of the page tables and its own copy-on-write faults.

Protocol on fd 0 (SOCK_SEQPACKET; fd 0 is then /dev/null), one JSON message each: {"spawn": key}
with the join fds of the run's slot (each controller's `tasks`) forks a runner whose program
joins that cgroup ahead of time (answer {"spawned": key, "pid"}); {"id", "runner": key,
"workdir", "rlimits"} with three fds (stdin, stdout, stderr) runs on that runner (answers {"id",
"pid"}, then {"id", "status", "cpu"} or {"id", "error"}); {"anomaly", "runner"} says an idle
runner died. EOF: the service is gone: every runner is killed and the zygote exits.
"""

import sys

BASELINE_MODULES = frozenset(sys.modules)  # what a fresh `python3 main.py` has loaded

import ctypes  # noqa: E402
import fcntl  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import select  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import struct  # noqa: E402

import zygote_cases  # noqa: E402  (bound next to this script in the zygote's sandbox)
import zygote_program  # noqa: E402

CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
RUNNER_NAMESPACES = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
RUNNER_NAMESPACES |= CLONE_NEWCGROUP  # rooted at the service's cgroup, as bwrap's
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 2, 4, 8, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 4, 24, 38
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, LINUX_CAPABILITY_VERSION_3 = 47, 4, 0x20080522
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
SANDBOX_UID = 65534
RUNS = "/runs"  # the service's run dirs, bound here for the zygote only
NEWROOT = "/newroot"  # where a runner builds its root before pivot_root
ZYGOTE_ONLY = frozenset({"runs", "sys", "newroot"})  # never in a program's root
PLAIN_DIRS = frozenset({"/proc", "/sandbox", "/dev/shm", "/dev/pts"})  # made empty, filled later
OWNER = f"uid={SANDBOX_UID},gid={SANDBOX_UID}"
DEVPTS = "newinstance,ptmxmode=0666,mode=620"
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41}
SYS_CLONE = {"x86_64": 56, "aarch64": 220, "riscv64": 220}
SETUP_FAILED = 125

libc = ctypes.CDLL(None, use_errno=True)
# made once here, not in every run (each object a run touches costs it a page copy)
CAPSET_HEADER = struct.pack("Ii", LINUX_CAPABILITY_VERSION_3, 0)
CAPSET_EMPTY = ctypes.create_string_buffer(24)  # two {effective, permitted, inheritable}: zeros


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


def _clone_runner(namespaces=RUNNER_NAMESPACES):
    """fork() into fresh namespaces in one system call (the child returns 0, as from fork).

    The raw clone skips CPython's after-fork bookkeeping, which a single-threaded zygote that
    never holds the import lock here does not need (no threads, no at-fork hooks registered)."""
    flags = ctypes.c_ulong(namespaces | signal.SIGCHLD)
    zero = ctypes.c_ulong(0)
    pid = libc.syscall(SYS_CLONE[os.uname().machine], flags, zero, zero, zero, zero)
    if pid < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"clone: {os.strerror(err)}")
    return pid


def _prepare_runner():
    """In a new runner (root in fresh namespaces, PID 1 of its own), ahead of any request: a
    fresh root laid out, owned and permissioned as a bwrap sandbox shows it to its program; the
    zygote's root stays at /.oldroot (for the run dir and the cgroup) until the request is in."""
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _tmpfs(NEWROOT, "0755")
    for op, source, target in ROOT_PLAN:
        if op == "symlink":
            os.symlink(source, target)
            os.lchown(target, SANDBOX_UID, SANDBOX_UID)
        elif op == "tmpfs":
            os.mkdir(target)
            _tmpfs(target, "0755")
        elif op == "dir":
            os.mkdir(target, 0o700 if source == "/etc" else 0o755)
            os.chown(target, SANDBOX_UID, SANDBOX_UID)
        else:  # a bind mount of the host's (a tree, a file or a device node)
            if op == "bind_dir":
                os.mkdir(target)
            else:
                os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o444))
            _mount(source, target, None, MS_BIND | MS_REC)
    _mount("devpts", f"{NEWROOT}/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, DEVPTS)
    os.mkdir(f"{NEWROOT}/.oldroot")
    os.chdir(NEWROOT)
    _check(libc.syscall(SYS_PIVOT_ROOT[os.uname().machine], b".", b".oldroot"), "pivot_root")
    os.chdir("/")
    _loopback_up()


def _tmpfs(target, mode):
    _mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, f"mode={mode},{OWNER}")


def _plan(source, target, ops):
    """How to make `target` as bwrap made `source` (computed once, replayed by every runner):
    its own dirs (owned by the program's uid), the host's read-only trees and device nodes bound
    in, fresh tmpfs for /tmp and /dev."""
    if os.path.islink(source):
        ops.append(("symlink", os.readlink(source), target))
    elif source in ("/tmp", "/dev"):
        ops.append(("tmpfs", source, target))
        if source == "/dev":
            for name in sorted(os.listdir(source)):
                _plan(f"{source}/{name}", f"{target}/{name}", ops)
    elif source in PLAIN_DIRS or (os.path.isdir(source) and not os.path.ismount(source)):
        ops.append(("dir", source, target))
        if source not in PLAIN_DIRS:
            for name in sorted(os.listdir(source)):
                _plan(f"{source}/{name}", f"{target}/{name}", ops)
    else:
        ops.append(("bind_dir" if os.path.isdir(source) else "bind_file", source, target))
    return ops


def _root_plan():
    ops = []
    for name in sorted(os.listdir("/")):
        if name not in ZYGOTE_ONLY:
            _plan(f"/{name}", f"{NEWROOT}/{name}", ops)
    return ops


def _prepare_program(cgroup_fds):
    """Still ahead of any request: its own session, a fresh /proc, and the run's cgroup joined
    (this thread, the only one: see `cgroups.JOIN_FILE`)."""
    os.setsid()
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    exec(compile("_ = [str(i) for i in range(64)]\n", "<warm-up>", "exec"), {})  # noqa: S102
    # (the compiler's and the allocator's pages are copied from the zygote here, not on the
    # request's path)
    for fd in cgroup_fds:
        os.write(fd, b"0")
        os.close(fd)


def _become_program(req, fds):
    """The request is in: the run's dir, limits, identity and stdio; then nothing of the
    zygote's is left visible."""
    _mount(f"/.oldroot{RUNS}/{req['workdir']}", "/sandbox", None, MS_BIND | MS_REC)
    _detach("/.oldroot")
    os.rmdir("/.oldroot")
    os.chdir("/sandbox")
    _drop_to_program(req, fds)


def _cut_bounding_set(keep):
    """A case forker's bounding set cut once to what it needs, so that each case drops only
    those (every call a case makes costs it page copies)."""
    global BOUNDING
    for cap in range(LAST_CAP + 1):
        if cap not in keep:
            _check(libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), "drop capability")
    BOUNDING = sorted(keep)


def _drop_to_program(req, fds):
    """Limits, identity (uid 65534, no capabilities, no_new_privs) and stdio of the program."""
    for res, soft, hard in req["rlimits"]:
        resource.setrlimit(res, (soft, hard))
    for cap in BOUNDING if BOUNDING is not None else range(LAST_CAP + 1):
        _check(libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), "drop capability")
    if not SETGROUPS_DENIED:  # (in a user namespace made without privileges: nothing to drop)
        os.setgroups([])
    os.setresgid(SANDBOX_UID, SANDBOX_UID, SANDBOX_UID)
    os.setresuid(SANDBOX_UID, SANDBOX_UID, SANDBOX_UID)
    _clear_capabilities()
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # cleared by the uid change
    libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)  # as any process (its /proc files are its own)
    for target, fd in zip((0, 1, 2), fds, strict=True):
        os.dup2(fd, target)
    os.closerange(3, 65536)


def _clear_capabilities():
    """Ambient, effective, permitted and inheritable sets emptied. The uid change clears them
    when the zygote is root; in a user namespace the zygote already is uid 65534 (with every
    capability of that namespace), and a change to the same uid clears nothing."""
    _check(libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "clear ambient caps")
    _check(libc.capset(CAPSET_HEADER, CAPSET_EMPTY), "capset")


def _runner(link, cgroup_fds):
    """A cloned runner: prepare, wait for the request, become the program. Returns only with
    its request; any failure is an anomaly (the zygote is replaced)."""
    try:
        _prepare_runner()
        _prepare_program(cgroup_fds)
        data, fds, _, _ = socket.recv_fds(link, 65536, 3)
    except Exception as exc:
        _send(link, {"error": f"sandbox set-up failed: {exc!r}"})
        os._exit(SETUP_FAILED)
    if not data:
        os._exit(0)  # the zygote is gone before this runner was used
    req = json.loads(data)
    if "cases" in req:  # a run_tests request: this runner forks one process per case
        tools = zygote_cases.Tools(
            _mount,
            _detach,
            _clone_runner,
            _drop_to_program,
            _send,
            _forget_zygote_modules,
            _cut_bounding_set,
        )
        return zygote_cases.CaseForker(req, fds, link, tools).serve()
    try:
        _become_program(req, fds)
    except Exception as exc:
        _send(link, {"error": f"sandbox set-up failed: {exc!r}"})
        os._exit(SETUP_FAILED)
    link.detach()
    return req


def _send(sock, message):
    try:
        sock.send(json.dumps(message).encode())
    except OSError:
        pass


class Zygote:
    """The loop: fork the runners the service asks for; hand each request to the runner it
    names; report every runner's end."""

    def __init__(self):
        self.ctl = socket.socket(fileno=os.dup(0))
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        self.idle = {}  # runner key -> (pid, pidfd, link): prepared, waiting for a request
        self.busy = {}  # pidfd -> (run id, pid, link)
        self.poller = select.poll()
        self.poller.register(self.ctl.fileno(), select.POLLIN)

    def spawn_runner(self, spawn, cgroup_fds):
        """Clone one runner; in the runner this returns its request (else None)."""
        mine, link = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pid = _clone_runner()
        if pid == 0:
            for sock in [self.ctl, mine, *(r[2] for r in self.idle.values())]:
                sock.close()
            for _, _, sock in self.busy.values():
                sock.close()
            for pidfd in [r[1] for r in self.idle.values()] + list(self.busy):
                os.close(pidfd)
            return _runner(link, cgroup_fds)
        link.close()
        for fd in cgroup_fds:
            os.close(fd)
        pidfd = os.pidfd_open(pid)
        self.poller.register(pidfd, select.POLLIN)
        self.idle[spawn["spawn"]] = (pid, pidfd, mine)
        _send(self.ctl, {"spawned": spawn["spawn"], "pid": pid})
        return None

    def serve(self):
        """Returns only in a forked program, with its request."""
        while True:
            for fd, _ in self.poller.poll():
                job = self.on_exit(fd) if fd != self.ctl.fileno() else self.on_message()
                if job is not None:
                    return job

    def on_message(self):
        data, fds, _, _ = socket.recv_fds(self.ctl, 65536, 8)
        if not data:  # the service is gone: so is everything this zygote started
            pids = [r[0] for r in self.idle.values()] + [r[1] for r in self.busy.values()]
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            # Reaped here, not orphaned: an orphan waits for the host's init to reap it, and
            # until then it holds its cgroup slot (about 1.8 s with this machine's init).
            for pid in pids:
                os.waitpid(pid, 0)
            os._exit(0)
        req = json.loads(data)
        if "spawn" in req:
            return self.spawn_runner(req, fds)
        runner = self.idle.pop(req.get("runner"), None)
        if runner is None:
            _send(self.ctl, {"id": req["id"], "error": "no such idle runner"})
            for received in fds:
                os.close(received)
            return None
        pid, pidfd, link = runner
        try:
            socket.send_fds(link, [data], fds)
        except OSError as exc:
            _send(self.ctl, {"id": req["id"], "error": f"the runner is gone: {exc}"})
        for received in fds:
            os.close(received)
        self.busy[pidfd] = (req["id"], pid, link)
        _send(self.ctl, {"id": req["id"], "pid": pid})
        return None

    def on_exit(self, pidfd):
        self.poller.unregister(pidfd)
        pid = self._pid_of(pidfd)
        _, status, usage = os.wait4(pid, 0)
        os.close(pidfd)
        code = os.waitstatus_to_exitcode(status)
        code = 128 - code if code < 0 else code  # a signal death, as bwrap reports it
        if pidfd in self.busy:
            run_id, _, link = self.busy.pop(pidfd)
            error = self._pending_error(link)
            link.close()
            if error is not None:
                _send(self.ctl, {"id": run_id, "error": error})
            else:
                cpu = usage.ru_utime + usage.ru_stime
                _send(self.ctl, {"id": run_id, "status": code, "cpu": cpu})
            return None
        for key, (idle_pid, _, link) in list(self.idle.items()):
            if idle_pid == pid:  # a runner died before its request: an anomaly
                del self.idle[key]
                error = self._pending_error(link) or f"an idle runner exited ({code})"
                link.close()
                _send(self.ctl, {"anomaly": error, "runner": key})
        return None

    def _pid_of(self, pidfd):
        for pid, fd, _ in self.idle.values():
            if fd == pidfd:
                return pid
        return self.busy[pidfd][1]

    @staticmethod
    def _pending_error(link):
        try:
            link.setblocking(False)
            return json.loads(link.recv(65536)).get("error")
        except (OSError, ValueError):
            return None


def _forget_zygote_modules():
    for name in [m for m in sys.modules if m not in BASELINE_MODULES]:
        del sys.modules[name]
    sys.path_importer_cache.pop("/sandbox", None)


if __name__ == "__main__":  # run as the zygote (never on import)
    with open("/proc/self/setgroups") as _f:
        SETGROUPS_DENIED = _f.read().strip() == "deny"
    with open("/proc/sys/kernel/cap_last_cap") as _f:
        LAST_CAP = int(_f.read())
    BOUNDING = None  # what is left of the bounding set (None: all of it)
    RECURSION = zygote_program.RecursionCompensation()
    ROOT_PLAN = _root_plan()
    gc.freeze()  # the zygote's objects: never scanned (nor their pages copied) by a program's GC
    JOB = Zygote().serve()
    if isinstance(JOB, zygote_cases.Template):  # a case forker's template, now at the top
        TEMPLATE = JOB  # kept: a case freeing the forker's objects would copy their pages
        JOB = TEMPLATE.serve()
    # From here on: the program's process. Make it look like `python3 main.py` in /sandbox.
    _forget_zygote_modules()
    sys.argv[:] = ["main.py", *JOB.get("argv", [])]
    sys.path[0] = "/sandbox"
    _main = type(sys)("__main__")
    _main.__file__ = "/sandbox/main.py"
    _main.__cached__ = None
    _main.__annotations__ = {}
    _main.__loader__ = type(__loader__)("__main__", "/sandbox/main.py")
    _main.__builtins__ = __builtins__
    sys.modules["__main__"] = _main
    del JOB
    zygote_program.run(_main, "/sandbox/main.py", RECURSION)
