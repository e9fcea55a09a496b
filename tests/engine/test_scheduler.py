"""The scheduler owns the waiting queues, the running sequences and the slots: finals first, a newer partial
supersedes the stream's queued one, the lowest free slot first, slots come back when sequences stop."""

import numpy as np

from qasr.engine.request import DecodeRequest, Priority, Superseded
from qasr.engine.scheduler import Scheduler
from qasr.engine.sequence import Sequence, Status


def sequence(priority=Priority.FINAL, stream_id=None, results=None) -> Sequence:
    request = DecodeRequest(audio=np.zeros(1600, np.float32), priority=priority, stream_id=stream_id)
    return Sequence(request, (results if results is not None else []).append)


def test_finals_first_a_newer_partial_supersedes_and_the_token_budget_bounds_an_admission():
    scheduler, got = Scheduler(num_slots=4), []
    old = sequence(Priority.PARTIAL, "s/0", got)
    scheduler.add(old)
    new, final, other = sequence(Priority.PARTIAL, "s/0"), sequence(), sequence(Priority.PARTIAL, "t/0")
    for seq in (new, final, other):
        scheduler.add(seq)
    assert len(got) == 1 and isinstance(got[0], Superseded) and old.status is Status.FINISHED
    assert scheduler.depths() == {"final": 1, "partial": 2}
    assert scheduler.schedule(max_tokens=2, cost=lambda s: 1) == [final, new]  # within the budget
    assert scheduler.schedule(max_tokens=0, cost=lambda s: 1) == [other]  # the first one always goes
    assert len(scheduler) == 0 and not scheduler.can_admit()


def test_slots_lowest_first_returned_on_release_and_cancelled_ones_dropped():
    scheduler = Scheduler(num_slots=3)
    a, b, c = sequence(), sequence(), sequence()
    assert [scheduler.place(s) for s in (a, b, c)] == [0, 1, 2] and scheduler.num_free_slots == 0
    scheduler.add(sequence())
    assert not scheduler.can_admit()  # waiting work, but no free slot
    scheduler.release(b)
    assert scheduler.free_slots == [1] and scheduler.can_admit()
    assert scheduler.place(sequence(stream_id="x/0")) == 1 and scheduler.running_streams() == {"x/0"}
    c.cancelled = True
    assert scheduler.drop_cancelled() == [c] and scheduler.free_slots == [2]
    scheduler.release(c)  # already released: the slot is not freed twice
    assert scheduler.free_slots == [2]
    left = scheduler.drain()
    assert len(left) == 3 and not scheduler.running and scheduler.free_slots == [0, 1, 2] and len(scheduler) == 0
