"""In-container agent of the Docker sandbox pool: runs one job at a time, then resets the container.

Runs as PID 1 (root, with only SETUID, SETGID, KILL, CHOWN, DAC_OVERRIDE and FOWNER) and listens
on a unix socket in a directory the program cannot enter (a host directory, mode 0700, bind-mounted).
Each step of a job (compile, run) is forked, put in its own session, given rlimits and
oom_score_adj 1000, and exec'd as the unprivileged program uid, which holds no capability.

After every job the agent resets the container and checks the clean state before it says so:
every process but itself is killed (PID 1 sending SIGKILL to -1 reaches every other process of the
namespace) and reaped, the writable places (workdir, /tmp, /dev/shm, /dev/mqueue) are emptied,
System V IPC objects are removed, and the state is verified. The host recycles the container when
the reset reports anything but clean.

Standard library only: this file and agent_reset.py are copied into the sandbox image and run
with `python3 -I -S`.
Wire format: 4-byte big-endian length, then a JSON object.
"""

from __future__ import annotations

import base64
import json
import os
import resource
import selectors
import signal
import socket
import stat
import struct
import sys
import time

# `python3 -I` leaves the script's own directory off sys.path: agent_reset.py sits beside this file
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from agent_reset import (  # noqa: E402
    empty_dir,
    kill_everything,
    oom_kills,
    other_pids,
    reap,
    remove_sysv,
    sysv_ids,
)

WORKDIR = "/sandbox"
SCRUB_DIRS = (WORKDIR, "/tmp", "/dev/shm", "/dev/mqueue")
MAX_FRAME = 256 * 1024 * 1024


# ---------------------------------------------------------------- framing


def recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            raise EOFError("host closed the connection")
        buf += chunk
    return bytes(buf)


def recv_msg(conn: socket.socket) -> dict:
    (size,) = struct.unpack(">I", recv_exact(conn, 4))
    if size > MAX_FRAME:
        raise ValueError(f"frame of {size} bytes is over the limit")
    return json.loads(recv_exact(conn, size))


def send_msg(conn: socket.socket, msg: dict) -> None:
    data = json.dumps(msg).encode()
    conn.sendall(struct.pack(">I", len(data)) + data)


class Agent:
    def __init__(self, socket_path: str, uid: int, gid: int) -> None:
        self.socket_path = socket_path
        self.uid = uid
        self.gid = gid
        self.runs = 0

    # ------------------------------------------------------------ reset

    def reset(self) -> dict:
        """Bring the container back to the state it started in, and verify it; report problems."""
        problems: list[str] = []
        if not kill_everything():
            problems.append(f"processes survived SIGKILL: {other_pids()}")
        ids = sysv_ids()
        if ids:
            remove_sysv(self.uid, self.gid, ids)
            reap()
        for d in SCRUB_DIRS:
            try:
                empty_dir(d)
            except OSError as exc:
                problems.append(f"cannot empty {d}: {exc}")
        try:
            os.chown(WORKDIR, self.uid, self.gid)
            os.chmod(WORKDIR, 0o700)
        except OSError as exc:
            problems.append(f"cannot restore {WORKDIR}: {exc}")
        problems += self.verify()
        return {"op": "reset", "clean": not problems, "problems": problems, "runs": self.runs}

    def verify(self) -> list[str]:
        problems = []
        left = other_pids()
        if left:
            problems.append(f"processes left: {left}")
        for d in SCRUB_DIRS:
            try:
                entries = os.listdir(d)
            except OSError as exc:
                problems.append(f"cannot list {d}: {exc}")
                continue
            if entries:
                problems.append(f"{d} not empty: {entries[:5]}")
        st = os.statvfs(WORKDIR)
        if st.f_bfree != st.f_blocks:
            problems.append(
                f"{WORKDIR} still uses {(st.f_blocks - st.f_bfree) * st.f_frsize} bytes"
            )
        ws = os.stat(WORKDIR)
        if (ws.st_uid, ws.st_gid, stat.S_IMODE(ws.st_mode)) != (self.uid, self.gid, 0o700):
            problems.append(f"{WORKDIR} owner/mode not restored")
        left_ipc = sysv_ids()
        if left_ipc:
            problems.append(f"System V IPC objects left: {left_ipc}")
        return problems

    # ------------------------------------------------------------ one job

    def place_files(self, files: dict[str, str], executable: list[str]) -> None:
        """Write the job's files as the program's; `executable` ones (a program compiled once
        for many runs) mode 0755, the others 0644."""
        for rel, b64 in files.items():
            path = safe_path(rel)
            parent = os.path.dirname(path)
            if parent != WORKDIR:
                os.makedirs(parent, exist_ok=True)
                # directories the agent made belong to the program, like its files
                walk = parent
                while walk != WORKDIR:
                    os.chown(walk, self.uid, self.gid)
                    walk = os.path.dirname(walk)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
            try:
                data = base64.b64decode(b64)
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fchown(fd, self.uid, self.gid)
                os.fchmod(fd, 0o755 if rel in executable else 0o644)
            finally:
                os.close(fd)

    def fetch_files(self, paths: list[str], max_bytes: int) -> tuple[dict[str, str], list[str]]:
        """Read requested workdir files (regular files only, no symlinks), when nothing else runs."""
        got: dict[str, str] = {}
        missing: list[str] = []
        budget = max_bytes
        for rel in paths:
            try:
                path = safe_path(rel)
                if os.path.realpath(path) != path:
                    raise OSError("path goes through a symlink")
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            except (OSError, ValueError):
                missing.append(rel)
                continue
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    missing.append(rel)
                    continue
                data = os.read(fd, budget + 1)
                if len(data) > budget:
                    missing.append(rel)
                    continue
                budget -= len(data)
                got[rel] = base64.b64encode(data).decode()
            finally:
                os.close(fd)
        return got, missing

    def run_job(self, job: dict) -> dict:
        t_end = time.monotonic() + float(job.get("budget_s", 60.0))
        try:
            self.place_files(job.get("files", {}), job.get("executable", []))
        except (OSError, ValueError) as exc:
            return {"ok": False, "error": f"cannot place files: {exc}", "steps": []}
        results = []
        for step in job["steps"]:
            if step.get("needs_success") and results:
                prev = results[-1]
                if prev["status"] != "Finished" or prev["exit_code"] != 0:
                    break
            results.append(self.run_step(step, t_end))
            if not kill_everything():
                return {"ok": False, "error": "processes survived SIGKILL", "steps": results}
        files, missing = self.fetch_files(
            job.get("fetch", []), int(job.get("max_fetch_bytes", 1 << 24))
        )
        return {"ok": True, "steps": results, "files": files, "missing": missing}

    def run_step(self, step: dict, t_end: float) -> dict:
        argv = step["argv"]
        env = step.get("env") or {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": WORKDIR,
            "LANG": "C.UTF-8",
        }
        cap = int(step.get("max_output", 1 << 20))
        wall = min(float(step.get("wall_s", 10.0)), max(0.0, t_end - time.monotonic()))
        stdin_fd = os.memfd_create("stdin")  # close-on-exec: only fd 0 reaches the program
        data = base64.b64decode(step.get("stdin", ""))
        view = memoryview(data)
        while view:
            view = view[os.write(stdin_fd, view) :]
        os.lseek(stdin_fd, 0, os.SEEK_SET)
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        oom_before = oom_kills()
        started = time.monotonic()
        pid = os.fork()
        if pid == 0:  # the program: never returns
            self._exec_child(argv, env, step, stdin_fd, out_w, err_w)
        for fd in (stdin_fd, out_w, err_w):
            os.close(fd)
        status = "Finished"
        bufs = {out_r: bytearray(), err_r: bytearray()}
        truncated = {out_r: False, err_r: False}
        pidfd = os.pidfd_open(pid)
        sel = selectors.DefaultSelector()
        for fd in (out_r, err_r):
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        sel.register(pidfd, selectors.EVENT_READ)
        open_pipes = 2
        exited = False
        try:
            while not exited:
                left = started + wall - time.monotonic()
                if left <= 0:
                    status = "TimeLimitExceeded"
                    break
                for key, _ in sel.select(left):
                    fd = key.fd
                    if fd == pidfd:
                        exited = True
                        continue
                    if not self._drain(fd, bufs, truncated, cap):
                        sel.unregister(fd)
                        open_pipes -= 1
                if any(truncated.values()):
                    status = "OutputLimitExceeded"
                    break
            # kill the session first, then anything it left (daemons, setsid children); the
            # child itself too: a limit that ends before it has called setsid finds no group
            # (ESRCH), and the program then ran on to its own end
            for kill in (os.killpg, os.kill):
                try:
                    kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            if exited:  # collect what is still in the pipes (a daemon may hold them open)
                for fd in (out_r, err_r):
                    self._drain(fd, bufs, truncated, cap)
            _, wstatus, ru = os.wait4(pid, 0)
        finally:
            sel.close()
            for fd in (out_r, err_r, pidfd):
                os.close(fd)
        wall_used = time.monotonic() - started
        exit_code = signum = None
        if os.WIFEXITED(wstatus):
            exit_code = os.WEXITSTATUS(wstatus)
        elif os.WIFSIGNALED(wstatus):
            signum = os.WTERMSIG(wstatus)
            exit_code = 128 + signum
            if signum == signal.SIGXCPU and status == "Finished":
                status = "TimeLimitExceeded"
            if (
                signum == signal.SIGKILL
                and status == "Finished"
                and ru.ru_utime + ru.ru_stime >= float(step.get("cpu_s", 1e9))
            ):
                status = "TimeLimitExceeded"
        oom = oom_kills() > oom_before
        if oom and status == "Finished":
            status = "MemoryLimitExceeded"
        return {
            "status": status,
            "exit_code": exit_code,
            "signal": signum,
            "stdout": base64.b64encode(bytes(bufs[out_r])).decode(),
            "stderr": base64.b64encode(bytes(bufs[err_r])).decode(),
            "stdout_truncated": truncated[out_r],
            "stderr_truncated": truncated[err_r],
            "wall_s": wall_used,
            "cpu_s": ru.ru_utime + ru.ru_stime,
            "maxrss_kb": ru.ru_maxrss,
            "oom_killed": oom,
        }

    @staticmethod
    def _drain(fd: int, bufs: dict, truncated: dict, cap: int) -> bool:
        """Read what the pipe holds; False at EOF. Past the cap, mark truncated and stop keeping."""
        while True:
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                return True
            except OSError:
                return False
            if not chunk:
                return False
            buf = bufs[fd]
            room = cap - len(buf)
            if len(chunk) > room:
                buf += chunk[: max(room, 0)]
                truncated[fd] = True
                return True
            buf += chunk

    def _exec_child(self, argv, env, step, stdin_fd, out_w, err_w) -> None:
        try:
            os.setsid()
            os.dup2(stdin_fd, 0)
            os.dup2(out_w, 1)
            os.dup2(err_w, 2)
            with open("/proc/self/oom_score_adj", "w") as f:
                f.write("1000")
            mem = step.get("memory_mb")
            if mem:
                limit = int(mem) * 1024 * 1024
                resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
            cpu = step.get("cpu_s")
            if cpu:
                soft = max(1, int(-(-float(cpu) // 1)))
                resource.setrlimit(resource.RLIMIT_CPU, (soft, soft + 1))
            fsize = step.get("fsize_mb")
            if fsize:
                resource.setrlimit(resource.RLIMIT_FSIZE, (int(fsize) << 20, int(fsize) << 20))
            nofile = step.get("nofile")
            if nofile:
                resource.setrlimit(resource.RLIMIT_NOFILE, (int(nofile), int(nofile)))
            nproc = step.get("nproc")
            if nproc:
                resource.setrlimit(resource.RLIMIT_NPROC, (int(nproc), int(nproc)))
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            resource.setrlimit(resource.RLIMIT_MSGQUEUE, (0, 0))
            os.setgroups([])
            os.setgid(self.gid)
            os.setuid(self.uid)
            os.chdir(WORKDIR)
            os.umask(0o022)
            signal.signal(signal.SIGPIPE, signal.SIG_DFL)
            os.execvpe(argv[0], argv, env)
        except BaseException as exc:  # noqa: BLE001 - report anything, never return into the agent
            try:
                os.write(2, f"sandbox: cannot start {argv[0]!r}: {exc}\n".encode())
            finally:
                os._exit(127)

    # ------------------------------------------------------------ serving

    def serve(self) -> None:
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        try:
            os.unlink(self.socket_path)
        except FileNotFoundError:
            pass
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self.socket_path)
        # Only the host's user may connect: match the owner of the (mode 0700) directory.
        owner = os.stat(os.path.dirname(self.socket_path)).st_uid
        os.chown(self.socket_path, owner, -1)
        os.chmod(self.socket_path, 0o600)
        listener.listen(4)
        first = self.reset()  # start from the verified clean state as well
        while True:
            conn, _ = listener.accept()
            try:
                self.handle(conn, first)
            except (EOFError, OSError, ValueError):
                pass
            finally:
                conn.close()
                reap()

    def handle(self, conn: socket.socket, first: dict) -> None:
        while True:
            msg = recv_msg(conn)
            op = msg.get("op")
            if op == "hello":
                send_msg(conn, {"op": "hello", "ok": True, "uid": self.uid, "initial": first})
            elif op == "run":
                self.runs += 1
                try:
                    result = self.run_job(msg)
                except Exception as exc:  # noqa: BLE001 - a broken job must not take the agent down
                    result = {"ok": False, "error": f"agent error: {exc!r}", "steps": []}
                send_msg(conn, result)
                send_msg(conn, self.reset())
            elif op == "reset":
                send_msg(conn, self.reset())
            else:
                send_msg(conn, {"ok": False, "error": f"unknown op {op!r}"})


def safe_path(rel: str) -> str:
    """A workdir-relative path, normalised, that cannot leave the workdir."""
    if not rel or rel.startswith("/") or "\x00" in rel:
        raise ValueError(f"bad file path {rel!r}")
    path = os.path.normpath(os.path.join(WORKDIR, rel))
    if not path.startswith(WORKDIR + "/"):
        raise ValueError(f"file path {rel!r} leaves the workdir")
    return path


def main(argv: list[str]) -> None:
    socket_path = argv[1] if len(argv) > 1 else "/run/toolenv/agent.sock"
    uid = int(argv[2]) if len(argv) > 2 else 65534
    gid = int(argv[3]) if len(argv) > 3 else uid
    Agent(socket_path, uid, gid).serve()


if __name__ == "__main__":
    main(sys.argv)
