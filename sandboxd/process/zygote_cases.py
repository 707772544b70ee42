"""The case forker (stdlib only, in the zygote's sandbox): one runner serves every case of one
`/v1/run_tests` request, one fresh process per case.

The runner already is the request's isolation boundary: fresh network, UTS and cgroup namespaces
and a root built once. It reads the request's files once, detaches the zygote's root, makes the
shared layers of that root read-only (its tmpfs "/" and /dev), makes one copy of itself (the
template, whose loop between clones is short and runs at the top of the zygote script's stack:
each page a process writes after a fork is copied) and for each case has the template clone a
child, the forker's own, into fresh mount, IPC and PID namespaces (the case is PID 1 of its own:
whatever it starts dies with it). The child joins the case's cgroup, mounts a fresh /proc, /tmp,
/dev/shm, /dev/pts and a fresh tmpfs /sandbox holding the request's files, then drops to the
program's identity and limits exactly as a single run does. Cases share only the network
namespace (empty but for a loopback) and the read-only root: they run the same submitted code.

Protocol on the batch socket (SOCK_SEQPACKET, one JSON message each): the forker says
{"ready": n} once the files are read; {"case": id, "cgroups": k, "rlimits", "argv"} with fds
(k cgroup join files, each controller's `tasks`; stdin, stdout, stderr) starts a case (answers
{"case", "status", "cpu"} or {"case", "error"} at its end); {"kill": id} SIGKILLs a case; EOF
kills every case and ends the forker.
"""

import gc
import json
import os
import select
import signal
import socket

CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
CLONE_NEWPID = 0x20000000
CASE_NAMESPACES = CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWPID
CLONE_PARENT = 0x00008000  # the case is the forker's child, not the template's
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND = 32, 4096
SANDBOX_UID = 65534
OWNER = f"uid={SANDBOX_UID},gid={SANDBOX_UID}"
DEVPTS = "newinstance,ptmxmode=0666,mode=620"
SETUP_FAILED = 125
MAX_FDS = 16
# what the forker and a case before it drops to the program need: chown, dac_override, fowner,
# kill, setgid, setuid, setpcap, sys_admin (mounts), sys_resource
FORKER_CAPS = frozenset({0, 1, 3, 5, 6, 7, 8, 21, 24})


class Tools:
    """What the forker borrows from the zygote's script (which it cannot import)."""

    def __init__(self, mount, detach, clone, drop_to_program, send, forget_modules, cut_caps):
        self.mount = mount
        self.detach = detach
        self.clone = clone
        self.drop_to_program = drop_to_program
        self.send = send
        self.forget_modules = forget_modules
        self.cut_caps = cut_caps


def read_tree(root):
    """The request's files as (path under /sandbox, mode, bytes or None for a dir), parents first;
    symlinks and special files are skipped (the service writes neither)."""
    entries = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        if rel != ".":
            entries.append((f"/sandbox/{rel}", os.lstat(dirpath).st_mode & 0o7777, None))
        dirnames.sort()
        for name in sorted(filenames):
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            if (st.st_mode & 0o170000) == 0o100000:
                with open(path, "rb") as f:
                    target = os.path.normpath(f"/sandbox/{rel}/{name}")
                    entries.append((target, st.st_mode & 0o7777, f.read()))
    return entries


class CaseForker:
    """The runner's loop in run_tests mode; `serve()` returns only in a case, with its request."""

    def __init__(self, req, fds, link, tools):
        self.req = req
        self.sock = socket.socket(fileno=fds[0])
        for extra in fds[1:]:
            os.close(extra)
        self.link = link
        self.t = tools
        self.tree = []
        self.cases = {}  # pidfd -> (case id, pid)
        self.pids = {}  # case id -> pid
        self.poller = select.poll()
        self.template = None  # the socket to the process that clones the cases

    def serve(self):
        try:
            self._prepare()
        except Exception as exc:
            self.t.send(self.link, {"error": f"case forker set-up failed: {exc!r}"})
            os._exit(SETUP_FAILED)
        try:
            job = self._start_template()
        except OSError as exc:
            self.t.send(self.link, {"error": f"case forker set-up failed: {exc!r}"})
            os._exit(SETUP_FAILED)
        if job is not None:
            return job  # in a case
        self.t.send(self.sock, {"ready": len(self.tree)})
        self.poller.register(self.sock.fileno(), select.POLLIN)
        while True:
            for fd, _ in self.poller.poll():
                job = self._on_message() if fd == self.sock.fileno() else self._on_exit(fd)
                if job is not None:
                    return job

    def _prepare(self):
        """The request's files in memory, the zygote's root gone, the shared layers read-only."""
        self.tree = read_tree(f"/.oldroot/runs/{self.req['workdir']}")
        self.t.detach("/.oldroot")
        os.rmdir("/.oldroot")
        for target in ("/", "/dev"):
            flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV
            self.t.mount(None, target, None, flags)
        # Once here rather than in every case: dropping the zygote's modules frees objects,
        # and each page a case writes costs it a copy (each case forgets what is left again).
        self.t.cut_caps(FORKER_CAPS)
        self.t.forget_modules()
        gc.freeze()

    def _start_template(self):
        """The process that clones the cases: a copy of this one made once, whose loop between
        two clones is a few lines (after a fork every page a process writes is copied, and
        this loop writes many). Its cases are this process's children (CLONE_PARENT). In the
        template this returns a `Template`, which the zygote script runs once it is back at the
        top of its stack: a case then starts there, and unwinds no frames of ours (each frame
        left writes to the objects it held: a page copy each)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pid = self.t.clone(0)
        if pid == 0:
            ours.close()
            return Template(self, theirs)
        theirs.close()
        self.template = ours
        return None

    def _clone_case(self, data, fds):
        """A case cloned by the template (a child of this process); its pid, or raises."""
        socket.send_fds(self.template, [data], fds)
        pid = int(self.template.recv(64) or b"0")
        if pid <= 0:
            raise OSError(-pid, f"the template could not clone: {os.strerror(-pid)}")
        return pid

    def _on_message(self):
        data, fds, _, _ = socket.recv_fds(self.sock, 65536, MAX_FDS)
        if not data:  # the request is over: no case outlives it
            for pid in self.pids.values():
                _kill(pid)
            for pid in self.pids.values():
                try:
                    os.waitpid(pid, 0)
                except ChildProcessError:
                    pass
            os._exit(0)
        msg = json.loads(data)
        if "kill" in msg:
            pid = self.pids.get(msg["kill"])
            if pid is not None:
                _kill(pid)
            return None
        case_id = msg["case"]
        try:
            pid = self._clone_case(data, fds)
        except (OSError, ValueError) as exc:  # the template is gone: so is this batch
            self.t.send(self.sock, {"case": case_id, "error": f"clone: {exc}"})
            os._exit(SETUP_FAILED)
        finally:
            _close_all(fds)
        pidfd = os.pidfd_open(pid)
        self.poller.register(pidfd, select.POLLIN)
        self.cases[pidfd] = (case_id, pid)
        self.pids[case_id] = pid
        return None

    def _on_exit(self, pidfd):
        self.poller.unregister(pidfd)
        case_id, pid = self.cases.pop(pidfd)
        self.pids.pop(case_id, None)
        _, status, usage = os.wait4(pid, 0)
        os.close(pidfd)
        code = os.waitstatus_to_exitcode(status)
        code = 128 - code if code < 0 else code  # a signal death, as bwrap reports it
        cpu = usage.ru_utime + usage.ru_stime
        self.t.send(self.sock, {"case": case_id, "status": code, "cpu": cpu})

    def become_case(self, msg, fds):
        """In the case's process: its cgroup, fresh mounts and files, then the program's
        identity. Any failure ends the case with an error (reported before its exit)."""
        try:
            k = int(msg["cgroups"])
            for fd in fds[:k]:
                os.write(fd, b"0")
                os.close(fd)
            os.setsid()
            m = self.t.mount
            m("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
            for target, mode in (("/tmp", "0755"), ("/dev/shm", "0755"), ("/sandbox", "0700")):
                m("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, f"mode={mode},{OWNER}")
            m("devpts", "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, DEVPTS)
            _write_tree(self.tree)
            os.chdir("/sandbox")
            self.t.drop_to_program(msg, fds[k:])
        except Exception as exc:
            self.t.send(self.sock, {"case": msg["case"], "error": f"case set-up failed: {exc!r}"})
            os._exit(SETUP_FAILED)
        return msg


class Template:
    """The case forker's copy that clones every case, run from the top of the zygote script's
    stack (see `CaseForker._start_template`)."""

    def __init__(self, forker, link):
        self.forker = forker
        self.link = link

    def serve(self):
        """Clone a case per message; returns only in a case, with its request."""
        link = self.link
        while True:
            data, fds, _, _ = socket.recv_fds(link, 65536, MAX_FDS)
            if not data:
                os._exit(0)
            # parsed here, not in the case: a parse there costs each case ~25 page copies
            msg = json.loads(data)
            try:
                pid = self.forker.t.clone(CASE_NAMESPACES | CLONE_PARENT)
            except OSError as exc:
                pid = -exc.errno
            if pid == 0:
                link.close()
                return self.forker.become_case(msg, fds)
            _close_all(fds)
            link.send(str(pid).encode())


def _write_tree(tree):
    for path, mode, content in tree:
        if content is None:
            os.mkdir(path, mode)
            os.chown(path, SANDBOX_UID, SANDBOX_UID)
            continue
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        try:
            view = memoryview(content)
            while view:
                view = view[os.write(fd, view) :]
            os.fchown(fd, SANDBOX_UID, SANDBOX_UID)
            os.fchmod(fd, mode)
        finally:
            os.close(fd)


def _kill(pid):
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _close_all(fds):
    for fd in fds:
        os.close(fd)
