"""The study's cells as Ray tasks: `toolenv rollout study --ray [ADDRESS]`.

The inputs (trajectory plans, recorded latencies, the cost model) are loaded once by the driver
and put in the object store once, so the nodes need no trace or profile files. Each cell is one
task of one CPU; the rows come back in job order, so the report is the local run's for the same
seed (only each cell's `wall_s`, how long it took, differs). Only the CLI imports this module: the rest of
rollout_client runs without Ray.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import ray
from ray.exceptions import RayTaskError

from toolenv_core.ray_connect import LOCAL, RayUnreachable, check_reachable, init_local

from .study import CellJob, StudyInputs, run_job

__all__ = ["RayRunner", "RayUnreachable"]


CELL_CPUS = 1


@ray.remote(num_cpus=CELL_CPUS)
def _cell(inputs: StudyInputs, job: CellJob) -> dict[str, Any]:
    return run_job(inputs, job)


def no_room_for_a_cell() -> str | None:
    """What the cluster offers when no live node has the CPU a cell needs, else None. Ray
    holds such tasks until a node that can take one joins (an autoscaler may add one), and
    with the driver's logs off it says nothing: the study sat at 0 cells for ever."""
    cpus = [node["Resources"].get("CPU", 0.0) for node in ray.nodes() if node["Alive"]]
    if max(cpus, default=0.0) >= CELL_CPUS:
        return None
    return (
        f"no node of the cluster has the CPU a cell needs (each cell is a Ray task of "
        f"{CELL_CPUS} CPU; its nodes have {cpus}): the study waits until a node with one joins"
    )


def cell_row(ref: ray.ObjectRef) -> dict[str, Any]:
    """A finished cell's row; a cell that raised raises its own error, as in a local run (the
    CLI's one line read `ray::_cell() (pid=..., ip=...)`, the first line of Ray's wrapper)."""
    try:
        return ray.get(ref)
    except RayTaskError as exc:
        if isinstance(exc.cause, Exception):
            raise exc.cause from None
        raise


@contextlib.contextmanager
def sigterm_kept() -> Iterator[None]:
    """Around `ray.init`: the command's SIGTERM handler (`sigterm_unwinds`) is put back after it.
    Ray installs its own, a Python one that exits 1 and a native one that prints a stack dump:
    SIGTERM ended a study on Ray with exit 1 (134, aborted, with `local`) and six lines of
    native noise, where the local study unwinds and ends by SIGTERM (143)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        if previous is not None:  # None: set outside Python, nothing to put back
            signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def stop_signals_unwrapped() -> Iterator[None]:
    """A stop signal's exception (Ctrl-C's KeyboardInterrupt, SIGTERM's `Terminated`) raised by
    its handler while Ray's C code waits can come out as `SystemError: <cyfunction
    CoreWorker.wait> returned a result with an exception set`, the signal's own as its cause: the
    study then exited 1 with a traceback. It is raised as itself."""
    try:
        yield
    except SystemError as exc:
        cause = exc.__cause__
        if cause is not None and not isinstance(cause, Exception):
            raise cause from None
        raise


class RayRunner:
    """A `JobRunner` that runs every cell as a Ray task on the cluster at `address`."""

    def __init__(self, address: str) -> None:
        """`address`: `local` starts a new local cluster, else a running one (auto, HOST:PORT),
        which must answer now (`RayUnreachable`), before the inputs are loaded."""
        self.address = address
        if address != LOCAL:
            check_reachable(address)

    def __call__(
        self,
        inputs: StudyInputs,
        jobs: list[CellJob],
        on_done: Callable[[int, dict[str, Any]], None],
    ) -> list[dict[str, Any]]:
        # Ray's driver prints what the cluster reports to the job (a node's death, a task
        # retried) on stdout, from a thread of its own until `ray.shutdown`: it came before the
        # report, and `--json` was no JSON.
        with contextlib.redirect_stdout(sys.stderr), stop_signals_unwrapped():
            return self._run(inputs, jobs, on_done)

    def _run(
        self,
        inputs: StudyInputs,
        jobs: list[CellJob],
        on_done: Callable[[int, dict[str, Any]], None],
    ) -> list[dict[str, Any]]:
        started_here = not ray.is_initialized()
        if started_here:
            # reachable: checked when this runner was made, before the inputs were loaded
            with sigterm_kept():
                if self.address == LOCAL:  # as `toolenv serve --ray local` starts one
                    init_local(log_to_driver=False, logging_level="ERROR")
                else:
                    ray.init(address=self.address, log_to_driver=False, logging_level="ERROR")
        try:
            if (note := no_room_for_a_cell()) is not None:
                print(f"warning: {note}", file=sys.stderr)  # above the progress bar
            shared = ray.put(inputs)
            refs = [_cell.remote(shared, job) for job in jobs]
            index = {ref: i for i, ref in enumerate(refs)}
            rows: list[dict[str, Any] | None] = [None] * len(jobs)
            pending = list(refs)
            while pending:
                done, pending = ray.wait(pending, num_returns=1)
                for ref in done:
                    i = index[ref]
                    rows[i] = cell_row(ref)
                    on_done(i, rows[i])
            return [row for row in rows if row is not None]
        finally:
            if started_here:
                ray.shutdown()
