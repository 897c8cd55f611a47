"""A worker's control states (dataserver/server/worker/controls.py), without sockets: each session's
samples come from a dataset object in the state "as built, then told its own values"."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import pytest
from ds_plugins import Merge

from dataserver.server.front.sessions import STATE_CHANGES, Scheduler, TaskEntry
from dataserver.server.worker.controls import ControlMissing, ControlStates

pytestmark = pytest.mark.timeout(30)


def tint(states: ControlStates, session: bytes, seq: int) -> int:
    dataset, _, _ = states.for_task(session, seq)
    return int(dataset[0]["image"][0, 0, 0])


def test_each_session_sees_its_own_values_from_a_known_start() -> None:
    states = ControlStates(Merge(4))
    states.learn(b"a", 1, {"tint": 100})
    states.learn(b"b", 3, {"label_shift": 5})  # merge-style: tint is not b's to inherit
    assert tint(states, b"a", 1) == 100
    assert tint(states, b"b", 3) == 0
    dataset_b, _, _ = states.for_task(b"b", 3)
    assert int(dataset_b[0]["labels"][0]) == 6
    assert tint(states, b"c", 0) == 0  # never set values: the pristine dataset
    assert states.pristine.state == {"tint": 0, "label_shift": 0}  # never told anything


def test_equal_values_share_one_object_and_keys_name_the_values() -> None:
    states = ControlStates(Merge(4), keep=2)
    states.learn(b"a", 1, {"tint": 3})
    states.learn(b"b", 9, {"tint": 3})
    da, ka, _ = states.for_task(b"a", 1)
    db, kb, _ = states.for_task(b"b", 9)
    assert da is db and ka == kb
    states.learn(b"c", 1, {"tint": 4})
    assert states.for_task(b"c", 1)[1] != ka
    assert states.made == 2


def test_unknown_or_forgotten_values_are_asked_for() -> None:
    states = ControlStates(Merge(4), sessions=2)
    with pytest.raises(ControlMissing):
        states.for_task(b"a", 1)
    states.learn(b"a", 1, {"tint": 1})
    with pytest.raises(ControlMissing):
        states.for_task(b"a", 2)  # newer values than the worker has
    states.learn(b"b", 1, {"tint": 2})
    states.learn(b"c", 1, {"tint": 3})  # a is forgotten now
    with pytest.raises(ControlMissing):
        states.for_task(b"a", 1)


class Uncopyable(Merge):
    def __init__(self, n: int = 4) -> None:
        super().__init__(n)
        self.lock = threading.Lock()  # deepcopy fails on a lock


def test_a_dataset_that_cannot_be_copied_is_built_again() -> None:
    built: list[Any] = []

    def fresh() -> Uncopyable:
        built.append(1)
        return Uncopyable()

    states = ControlStates(Uncopyable(), fresh)
    states.learn(b"a", 1, {"tint": 50})
    assert tint(states, b"a", 1) == 50
    assert built == [1]
    assert tint(states, b"z", 0) == 0


def test_a_dataset_without_set_control_is_shared_as_built() -> None:
    class Plain:
        def __len__(self) -> int:
            return 1

    plain = Plain()
    states = ControlStates(plain)
    assert states.for_task(b"a", 0) == (plain, "", {})
    assert states.for_task(b"a", 7) == (plain, "", {})  # values cannot matter to it


def test_a_session_changing_its_values_every_task_evicts_only_its_own_states() -> None:
    """Issue 25 item 4: a job calling ``control(v=step % 5)`` before every batch evicted
    every other job's state, whose every task then copied the dataset again. Now a
    session's new values evict its own oldest state (it keeps two), never another's."""
    states = ControlStates(Merge(4))
    states.learn(b"honest", 1, {"tint": 7})
    mine, _, _ = states.for_task(b"honest", 1)
    for step in range(40):
        states.learn(b"churn", step + 1, {"tint": step % 5})
        assert tint(states, b"churn", step + 1) == step % 5
        again, _, _ = states.for_task(b"honest", 1)
        assert again is mine  # never made again
    assert tint(states, b"honest", 1) == 7
    assert states.made == 1 + 40  # the churning session pays for its own copies
    # Many sessions with one state each: at most ``keep`` objects in all.
    for n in range(20):
        states.learn(b"s%d" % n, 1, {"tint": 100 + n})
        assert tint(states, b"s%d" % n, 1) == 100 + n
    assert len(states._states) <= states.keep


def test_the_fair_queue_shares_worker_time_not_tasks() -> None:
    """Issue 25 item 4: the copies a session's values cost are charged to it. Two sessions
    with tasks always queued; one's tasks take ten times the worker time (each copies the
    dataset): the two get equal worker time, so that one gets about a tenth of the tasks
    (by task, round robin, the other got half the tasks and a tenth of the time)."""
    sched = Scheduler(8, 1024, 1 << 30, 1 << 30)
    cost = {b"c" * 16: 1000, b"h" * 16: 100}
    for sid in cost:
        session = sched.open(sid, sid, sid)
        assert session is not None
        for tid in range(500):
            sched.push(session, TaskEntry(sid, tid, 1, ((tid,),), []))
    served = Counter[bytes]()
    for _ in range(220):
        entry = sched.pop()
        assert entry is not None
        served[entry.session] += 1
        sched.charge(entry.session, cost[entry.session])
    assert served[b"h" * 16] >= 8 * served[b"c" * 16]
    time_h = served[b"h" * 16] * cost[b"h" * 16]
    time_c = served[b"c" * 16] * cost[b"c" * 16]
    assert 0.8 <= time_h / time_c <= 1.25


def test_a_session_changing_control_state_every_task_is_paced() -> None:
    """Issue 25 item 4: each new control state costs a copy of the dataset in the worker
    that runs it (128 ms for a dataset holding a 30,000-entry index), and those copies,
    not preemptible, held every worker. For a dataset with ``set_control``, a session
    moves its tasks to another state at most ``STATE_CHANGES`` a second (bursts as many);
    its tasks wait meanwhile, and the others' are served. Without ``set_control`` nothing
    is copied, and nothing waits."""
    for steerable in (True, False):
        sched = Scheduler(8, 1024, 1 << 30, 1 << 30)
        sched.pace(steerable)
        churn, honest = b"c" * 16, b"h" * 16
        for sid in (churn, honest):
            session = sched.open(sid, sid, sid)
            assert session is not None
            for tid in range(20):
                state = b"v%d" % (tid % 5) if sid == churn else b"same"
                sched.push(session, TaskEntry(sid, tid, 1, ((tid,),), [], state=state))
        served = Counter[bytes]()
        while (entry := sched.pop()) is not None:
            served[entry.session] += 1
        assert served[honest] == 20
        assert served[churn] == (STATE_CHANGES if steerable else 20)
        assert (sched.paced > 0) == steerable
