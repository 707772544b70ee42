"""The one admission queue (toolenv_core.admission) with a queue timeout and caller deadlines,
as sandboxd uses it (the gateway's use is tested in tests/gateway/test_units.py)."""

from __future__ import annotations

import asyncio

import pytest

from toolenv_core.admission import Admission, ExpiredInQueue, Rejected
from toolenv_core.deadline import Deadline


async def test_admission_bounds_running_and_queue_fifo() -> None:
    adm = Admission("sandbox", 2, 2, queue_timeout_s=5, retry_after_s=3)
    forever = Deadline.never()
    await adm.acquire(forever)
    await adm.acquire(forever)
    order: list[int] = []

    async def waiter(i: int) -> None:
        await adm.acquire(forever)
        order.append(i)

    w1 = asyncio.create_task(waiter(1))
    await asyncio.sleep(0)
    w2 = asyncio.create_task(waiter(2))
    await asyncio.sleep(0)
    assert adm.waiting == 2 and adm.in_flight == 2
    with pytest.raises(Rejected) as err:
        await adm.acquire(forever)
    assert err.value.retry_after_s == 3
    adm.release()
    adm.release()
    await asyncio.gather(w1, w2)
    assert order == [1, 2] and adm.in_flight == 2 and adm.waiting == 0
    with pytest.raises(ExpiredInQueue, match=r"deadline ran out after 0\.0[45]\d* s waiting"):
        await adm.acquire(Deadline.after(0.05))  # the deadline ended the wait: a timeout
    assert adm.waiting == 0 and (adm.rejected_total, adm.expired_total) == (1, 1)
    adm.queue_timeout_s = 0.05
    with pytest.raises(Rejected, match="no slot within 0.05 s"):
        await adm.acquire(Deadline.after(10))  # the queue timeout ended it: backpressure
    assert adm.waiting == 0 and (adm.rejected_total, adm.expired_total) == (2, 1)
    adm.release()
    adm.release()
    assert adm.in_flight == 0


async def test_admission_cancelled_waiter_passes_its_slot_on() -> None:
    adm = Admission("sandbox", 1, 4, queue_timeout_s=5, retry_after_s=1)
    await adm.acquire(Deadline.never())
    cancelled = asyncio.create_task(adm.acquire(Deadline.never()))
    other = asyncio.create_task(adm.acquire(Deadline.never()))
    await asyncio.sleep(0)
    cancelled.cancel()
    await asyncio.sleep(0)
    adm.release()
    await asyncio.wait_for(other, 1)
    assert adm.in_flight == 1 and adm.waiting == 0


async def test_a_waiter_cancelled_as_its_slot_is_handed_over_stays_cancelled() -> None:
    # A run_tests case waiting for a slot, cancelled (client gone, shutdown cut) in the same
    # loop turn another run released its slot to it: Python 3.11's wait_for returned the slot
    # and dropped the cancellation, so the case ran its program on (a docker pool being closed
    # then waited for it, and `toolenv serve` took 10 s more to stop).
    adm = Admission("sandbox", 1, 4, queue_timeout_s=5, retry_after_s=1)
    await adm.acquire(Deadline.never())
    waiter = asyncio.create_task(adm.acquire(Deadline.after(5)))
    await asyncio.sleep(0)
    adm.release()  # handed to the waiter...
    waiter.cancel()  # ...as it is cancelled
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert adm.in_flight == 0 and adm.waiting == 0  # the slot was passed on, not kept


async def test_a_committed_caller_is_never_refused_only_its_deadline_ends_its_wait() -> None:
    """A caller holding finished work a refusal would throw away (a run_tests request past its
    first verdict) waits past the queue bound and the queue timeout, in FIFO order."""
    adm = Admission("sandbox", 1, 1, queue_timeout_s=0.05, retry_after_s=1)
    await adm.acquire()
    queued = asyncio.create_task(adm.acquire())
    await asyncio.sleep(0)
    with pytest.raises(Rejected):  # the queue is full
        await adm.acquire()
    committed = asyncio.create_task(adm.acquire(committed=True))
    await asyncio.sleep(0.15)  # three queue timeouts
    assert not committed.done() and adm.waiting == 1  # the uncommitted one timed out
    with pytest.raises(Rejected):
        await queued
    adm.release()
    await committed
    with pytest.raises(ExpiredInQueue):
        await adm.acquire(Deadline.after(0.05), committed=True)
    assert (adm.rejected_total, adm.expired_total, adm.in_flight) == (2, 1, 1)
