"""The start-up heap out of the cyclic collector's sight, for every long-running service."""

from __future__ import annotations

import gc


def freeze_startup_objects() -> None:
    """Move everything built so far (the framework, settings, pools, profiles) into the
    collector's permanent generation: it lives as long as the process, and a full collection
    under load then scans only per-request garbage. Without it each full pass walks hundreds
    of thousands of framework objects and stalls the event loop for tens of ms (80 ms in
    sandboxd, once every few `/v1/run_tests` requests; timer error in the emulators)."""
    gc.collect()
    gc.freeze()
