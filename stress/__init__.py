"""`toolenv stress`: a coordinated-omission-free load generator for tool endpoints.

Python API (stable; other benchmarks build on it)::

    from stress import LoadSpec, run_load
    result = run_load(LoadSpec(url="http://127.0.0.1:8081/retrieve", body={...}, rate=200, duration_s=10))

See `stress.loadgen` for the full description.
"""

from .http import BODY_KEY, ERROR_KINDS
from .loadgen import (
    LoadResult,
    LoadSpec,
    LoadSpecError,
    Progress,
    RequestRecord,
    arun_load,
    make_histogram,
    run_load,
)
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
