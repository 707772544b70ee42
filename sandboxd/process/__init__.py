"""The `process` sandbox backend: bubblewrap sandboxes, pooled cgroups, warm sandboxes, and the
python fork server.

Modules: `backend` (life cycle, one program's steps), `warm` (sandboxes made ahead of time),
`execution` (one sandboxed process, given an explicit `ExecContext`), `bwrap` (the argv and the
blocked-start handshake), `limits` (rlimits and cgroup confinement), `cgroups` (the slot pool),
`paths` (working dirs and the files that go in and out), `ending` (how a step ended),
`forkserver` + `zygote_main` (python runs forked from a zygote; the latter is the stdlib-only
program that runs inside the zygote's sandbox, with `zygote_program`, how the program is run and
exits, and `zygote_cases`, a run_tests request's runner forking one process per case), `batch`
(the service's side of that runner).
"""

from .backend import ProcessBackend
from .bwrap import BWRAP_INSTALL_HINT
from .paths import InvalidPath, safe_relative_path

__all__ = ["BWRAP_INSTALL_HINT", "InvalidPath", "ProcessBackend", "safe_relative_path"]
