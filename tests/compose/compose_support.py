"""The compose test stack: `docker compose up` from the repository root, and ways to inspect it.

The stack is built from this machine's local base image and a wheelhouse built on the host (the
offline build arguments), on a free loopback port, under its own project name, and torn down at
the end of the session with a check that nothing is left: no container, network, volume or
delegated cgroup.
"""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
IMAGE = "toolenv/toolenv:test"
CGROUP_CONTROLLERS = ("pids", "memory", "cpu", "cpuacct")
# a program per language that prints 42
PROGRAMS = {
    "python": "print(6 * 7)",
    "bash": "echo $((6 * 7))",
    "c": '#include <stdio.h>\nint main(void) { printf("%d\\n", 6 * 7); return 0; }\n',
    "cpp": "#include <iostream>\nint main() { std::cout << 6 * 7 << std::endl; }\n",
}

# Run inside the sandbox container: what sandboxd has started beyond its idle warm sandboxes.
LEAK_PROBE = r"""
import json, os, urllib.request as u
st = json.load(u.urlopen('http://127.0.0.1:8002/v1/sandbox/status', timeout=10))
warm_pids, warm_dirs = set(st['warm_pids']), set(st['warm_workdirs'])
procs = {}
for p in os.listdir('/proc'):
    if p.isdigit():
        try:
            procs[int(p)] = int(open(f'/proc/{p}/stat').read().rsplit(')', 1)[1].split()[1])
        except OSError:
            pass
server = [p for p, pp in procs.items() if pp == 1 and b'sandboxd' in open(f'/proc/{p}/cmdline', 'rb').read()][0]
children = {}
for p, pp in procs.items():
    children.setdefault(pp, []).append(p)
extra, stack = [], [server]
while stack:
    for c in children.get(stack.pop(), []):
        if c not in warm_pids:
            extra.append(c); stack.append(c)
root = st['workdir_root']
dirs = sorted(set(os.listdir(root)) - warm_dirs)
base = f'/sys/fs/cgroup/pids/toolenv-sandboxd-{server}'
tasks = []
for d in os.listdir(base):
    if os.path.isdir(f'{base}/{d}'):
        tasks += [int(t) for t in open(f'{base}/{d}/cgroup.procs').read().split()]
tasks = sorted(set(tasks) - warm_pids - {c for w in warm_pids for c in children.get(w, [])})
print(json.dumps({'procs': extra, 'dirs': dirs, 'tasks': tasks, 'running': st['running'],
                  'draining': st['cgroups_draining'], 'warm': sum(st['warm'].values()),
                  'warm_target': st['warm_target'], 'python_mode': st['python_mode'],
                  'runners': (st['fork_server'] or {}).get('idle_runners'),
                  'prefork': (st['fork_server'] or {}).get('prefork')}))
"""


@dataclass
class Stack:
    """A running compose project and the commands to inspect and hurt it."""

    project: str
    url: str
    env: dict[str, str]
    started_s: float = 0.0
    client: httpx.Client = field(init=False)
    is_down: bool = False

    def __post_init__(self) -> None:
        self.client = httpx.Client(base_url=self.url, timeout=60)

    def compose(
        self, *args: str, cwd: Path = REPO, timeout: float = 600
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["docker", "compose", *args],
            cwd=cwd,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def down(self) -> None:
        """Take the project down (every profile: a service a test started under one, vllm-cpu,
        goes too) and check that it left nothing: no container, network, volume or cgroup."""
        if self.is_down:
            return
        self.is_down = True
        self.client.close()
        down = self.compose("--profile", "*", "down", "-v", "--timeout", "10")
        for d in delegated_cgroups(self.project):
            if d.is_dir():
                d.rmdir()  # fails (and fails the run) if sandboxd left a cgroup in it
        remove_dangling_test_images()
        assert down.returncode == 0, down.stderr
        assert project_leftovers(self.project) == {"container": [], "network": [], "volume": []}

    def container(self, service: str) -> str:
        out = self.compose("ps", "-q", service)
        assert out.returncode == 0 and out.stdout.strip(), out.stderr
        return out.stdout.strip()

    def inspect(self, service: str) -> dict:
        out = subprocess.run(
            ["docker", "inspect", self.container(service)], capture_output=True, text=True
        )
        return json.loads(out.stdout)[0]

    def exec(self, service: str, *argv: str, timeout: float = 60) -> str:
        out = self.compose("exec", "-T", service, *argv, timeout=timeout)
        assert out.returncode == 0, out.stdout + out.stderr
        return out.stdout

    def sandbox_state(self) -> dict:
        return json.loads(self.exec("sandbox", "python", "-c", LEAK_PROBE))

    def python_ready(self) -> bool:
        """Python runs have what they start from ready: the fork server's idle runners, or
        (without it) the warm sandboxes."""
        s = self.sandbox_state()
        if s["python_mode"] == "fork_server":
            return s["runners"] == s["prefork"]
        return s["warm"] == s["warm_target"]

    def wait_healthy(self, service: str, timeout: float = 90) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                health = self.inspect(service)["State"].get("Health", {}).get("Status")
            except (AssertionError, json.JSONDecodeError, IndexError):
                health = None
            if health == "healthy":
                return
            time.sleep(0.2)
        raise AssertionError(f"{service} not healthy after {timeout} s")

    def logs(self) -> str:
        return self.compose("logs", "--no-color", "--tail", "80").stdout


def project_leftovers(project: str) -> dict[str, list[str]]:
    label = f"label=com.docker.compose.project={project}"
    left = {}
    for kind in ("container", "network", "volume"):
        cmd = ["docker", kind, "ls", "-q", "--filter", label]
        if kind == "container":
            cmd.insert(3, "-a")
        left[kind] = subprocess.run(cmd, capture_output=True, text=True).stdout.split()
    return left


def remove_dangling_test_images() -> None:
    """`up --build` moves each test image's tag to the new build: the image it replaced, about
    1 GB (2.7 GB for vllm-cpu), would stay behind after every run. Removes the dangling images
    that test stacks built (their compose project label); an image still in use stays."""
    ids = subprocess.run(
        ["docker", "images", "-q", "--filter", "dangling=true"], capture_output=True, text=True
    ).stdout.split()
    if not ids:
        return
    labels = subprocess.run(
        ["docker", "image", "inspect", "--format",
         '{{.Id}} {{index .Config.Labels "com.docker.compose.project"}}', *ids],
        capture_output=True, text=True,
    ).stdout.splitlines()  # fmt: skip
    built = [line.split()[0] for line in labels if " toolenv-test-" in line]
    if built:
        subprocess.run(["docker", "rmi", *built], capture_output=True, text=True)


def delegated_cgroups(project: str) -> list[Path]:
    return [Path("/sys/fs/cgroup") / c / "toolenv" / project for c in CGROUP_CONTROLLERS]


def run_code(stack: Stack, code: str, language: str = "python", **kw: object) -> httpx.Response:
    """`POST /run_code` through the stack's gateway."""
    return stack.client.post("/run_code", json={"code": code, "language": language, **kw})
