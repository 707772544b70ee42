"""PolyTrace: typed records of RLVR workloads and streaming readers/writers, one per format.

One model, read and written in one place: the rollout client and the gateway's trace capture
write the same records the readers read, so every run's output is itself a replayable trace.
"""

from .errors import TraceFormatError
from .multiturn import read_multiturn, write_multiturn
from .records import ToolCallRecord, TrajectoryRecord, TurnRecord

__all__ = [
    "ToolCallRecord",
    "TraceFormatError",
    "TrajectoryRecord",
    "TurnRecord",
    "read_multiturn",
    "write_multiturn",
]
