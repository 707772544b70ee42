"""PolyTrace: typed records of RLVR workloads and streaming readers/writers, one per format.

One model, read and written in one place: the rollout client and the gateway's trace capture
write the same records the readers read, so every run's output is itself a replayable trace.
Every reader streams (one line in memory at a time) and raises `TraceFormatError` naming the
file, the line and the field of a malformed record.
"""

from .calllog import CallLogRecord, parse_call_log_line, read_call_log, write_call_log
from .dapo import DapoFilterRecord, read_dapo_filter
from .errors import TraceFormatError
from .fitted import FittedDistribution, FittedParameters, read_fitted_parameters
from .latencies import LatencyObservation, detect_format, iter_latencies, tool_latencies
from .multiturn import read_multiturn, read_multiturn_many, write_multiturn
from .packed import PackedLengthsRecord, read_packed_lengths
from .records import ToolCallRecord, TrajectoryRecord, TurnRecord
from .rewards import RewardTimingRecord, read_reward_timings

__all__ = [
    "CallLogRecord",
    "DapoFilterRecord",
    "FittedDistribution",
    "FittedParameters",
    "LatencyObservation",
    "PackedLengthsRecord",
    "RewardTimingRecord",
    "ToolCallRecord",
    "TraceFormatError",
    "TrajectoryRecord",
    "TurnRecord",
    "detect_format",
    "iter_latencies",
    "parse_call_log_line",
    "read_call_log",
    "read_dapo_filter",
    "read_fitted_parameters",
    "read_multiturn",
    "read_multiturn_many",
    "read_packed_lengths",
    "read_reward_timings",
    "tool_latencies",
    "write_call_log",
    "write_multiturn",
]
