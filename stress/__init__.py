"""`toolenv stress`: a coordinated-omission-free load generator for tool endpoints.

Python API (stable; other benchmarks build on it)::

    from stress import LoadSpec, run_load
    result = run_load(LoadSpec(url="http://127.0.0.1:8081/retrieve", body={...}, rate=200, duration_s=10))

See `stress.loop` for the full description; `stress.spec` for what a run takes and
`stress.result` for what it returns.
"""

from toolenv_core.http1 import ERROR_KINDS

from .http import BODY_KEY
from .loop import arun_load, run_load
from .result import LoadResult, RequestRecord
from .spec import LoadSpec, LoadSpecError, Progress
from .stats import make_histogram
from .targets import RemoteTargetError, check_loopback

__all__ = [
    "BODY_KEY",
    "ERROR_KINDS",
    "LoadResult",
    "LoadSpec",
    "LoadSpecError",
    "Progress",
    "RemoteTargetError",
    "RequestRecord",
    "arun_load",
    "check_loopback",
    "make_histogram",
    "run_load",
]
