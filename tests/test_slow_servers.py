"""A slow but correct server must not stall a job (issue 39, item 2): its tasks are hedged
to a peer after a delay drawn from the peers' answer times, the first answer wins, and a
server that is an outlier gets probes only until it recovers.

The slow server is a real ``dataserver serve`` whose dataset holds some samples (the
``held`` dataset of ``dataserver/data/simulated.py``, the same data as its healthy peer's:
one fingerprint): that is what an overloaded node or a failing disk looks like from the
client, answers right and late, its workers busy meanwhile, so a copy sent to it waits too.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from clients import make_client

pytestmark = pytest.mark.timeout(240)

N = 96
HELD = "dataserver.data.simulated:held"


def _args(hold_ms: float = 0.0, share: float = 1.0) -> tuple[str, ...]:
    return (
        "--dataset",
        HELD,
        "--dataset-args",
        f'{{"n": {N}, "ms": 2, "size": 32, "hold_ms": {hold_ms}, "share": {share}}}',
    )


def _epoch(addresses: list[str], **options: Any) -> tuple[list[Any], dict[str, Any], float]:
    """One epoch's batches, the client's stats after it, and the longest ``next()`` wait."""
    with make_client(
        addresses, batch_size=8, image_size=(32, 32), stitch_k=1, timeout=60, **options
    ) as client:
        client.set_epoch(0)
        batches: list[Any] = []
        longest = 0.0
        it = iter(client)
        while True:
            started = time.monotonic()
            batch = next(it, None)
            longest = max(longest, time.monotonic() - started)
            if batch is None:
                return batches, client.stats(), longest
            batches.append(batch)


def _same(batches: list[Any], reference: list[Any]) -> None:
    delivered = sorted(i for b in batches for idx in b.indices for i in idx)
    assert delivered == list(range(N))  # every index once: no loss, no duplicate
    assert len(batches) == len(reference)
    for x, y in zip(batches, reference, strict=True):
        assert x.indices == y.indices and torch.equal(x.images, y.images)
        for a, b in zip(x.targets, y.targets, strict=True):
            assert torch.equal(a["boxes"], b["boxes"]) and torch.equal(a["labels"], b["labels"])


@pytest.mark.parametrize(("hold_ms", "share"), [(900.0, 1.0), (3000.0, 0.15)])
def test_a_slow_server_does_not_stall_the_epoch(
    start_server: Any, hold_ms: float, share: float
) -> None:
    healthy = start_server(*_args(), workers=1)
    reference, _, _ = _epoch([healthy.address])
    slow = start_server(*_args(hold_ms, share), workers=1)
    started = time.monotonic()
    batches, stats, longest = _epoch([healthy.address, slow.address])
    took = time.monotonic() - started
    _same(batches, reference)
    # Without hedging a batch with a task on the slow server waits for it (its held
    # samples, or the answer deadline, >= 1 s, then a second server): 22 s for the epoch
    # held 0.9 s a sample, 4 s with 15% held 3 s, on the main before hedging. With it the
    # healthy server has answered within a few of its own answer times. Both bounds are
    # generous (about 0.1 s and 0.4 s here): they catch a stall, not a slowdown.
    assert longest < 1.0, (longest, stats["hedging"])
    assert took < 15, (took, stats["hedging"])
    assert stats["hedged"] >= 1 and stats["hedge_won"] >= 1, stats
    if share == 1.0:  # (an outlier, seen from its answers: it got probes only)
        assert slow.address in stats["hedging"]["outliers"], stats["hedging"]


def test_healthy_servers_are_hedged_rarely(start_server: Any) -> None:
    a = start_server(*_args(), workers=1)
    b = start_server(*_args(), workers=1)
    reference, _, _ = _epoch([a.address])
    batches, stats, _ = _epoch([a.address, b.address])
    _same(batches, reference)
    print("hedged", stats["hedged"], "of", sum(s["sent"] for s in stats["servers"]))
    tasks = sum(s["sent"] for s in stats["servers"]) - stats["hedged"]
    # About 1 in 20 tasks outlasts its peers' p95 (x1.25); a shared, busy test machine
    # makes that noisier, hence the margin: the point is "a few", not "every".
    assert stats["hedged"] <= max(4, tasks // 5), (stats["hedged"], tasks, stats["hedging"])
    assert stats["hedging"]["outliers"] == []


def test_hedge_off_sends_no_second_copy(start_server: Any) -> None:
    a = start_server(*_args(), workers=1)
    slow = start_server(*_args(300.0, 0.1), workers=1)
    reference, _, _ = _epoch([a.address])
    batches, stats, _ = _epoch([a.address, slow.address], hedge=False)
    _same(batches, reference)
    assert stats["hedged"] == 0 and stats["hedging"]["enabled"] is False
    assert stats["hedging"]["outliers"] == []


class _Peer:
    """What the policy reads of a server link: its unanswered tasks, oldest first."""

    def __init__(self) -> None:
        self.outstanding: dict[int, float] = {}


def _answer(policy: Any, peer: _Peer, took: float, at: float) -> None:
    """``peer`` answers at ``at`` a task sent ``took`` before, with nothing ahead of it
    (its service time is its latency)."""
    policy.observe(peer, at - took, at)


def test_the_policy_sets_an_outlier_aside_and_takes_it_back() -> None:
    """``Hedging`` alone: a server 30x slower than its peers is an outlier (never every
    server), the hedge delay comes from the others' p95, and a server comes back only
    once its answers since are within half the bar."""
    from dataserver_client.plan.hedging import HEDGE_FACTOR, MIN_TYPICAL, Hedging

    fast, other, slow = _Peer(), _Peer(), _Peer()
    policy: Hedging[_Peer] = Hedging()
    for i in range(16):
        _answer(policy, fast, 0.2, 10.0 * i)
        _answer(policy, other, 0.3, 10.0 * i)
        _answer(policy, slow, 9.0, 10.0 * i)
    assert policy.judge([fast, other, slow], now=200.0)
    assert policy.outliers == {slow}
    assert policy.usable([fast, other, slow]) == [fast, other]
    delays = policy.delays([fast, other, slow])
    assert slow in delays and delays[slow] == pytest.approx(HEDGE_FACTOR * 0.3)
    # Alone with one peer, the slow one is still the outlier, never both.
    assert not policy.judge([fast, slow], now=200.0) and policy.outliers == {slow}
    # Its answers since: slow still, then in line: it is used again only then.
    for i in range(MIN_TYPICAL):
        _answer(policy, slow, 5.0, 210.0 + 10 * i)
    policy.judge([fast, other, slow], now=250.0)
    assert policy.outliers == {slow}
    for i in range(8):
        _answer(policy, slow, 0.3, 260.0 + i)
    assert policy.judge([fast, other, slow], now=270.0) and policy.outliers == frozenset()
    # Switched off: nothing hedged, nothing set aside.
    off: Hedging[_Peer] = Hedging(enabled=False)
    _answer(off, fast, 0.02, 1.0)
    _answer(off, slow, 5.0, 1.0)
    assert not off.judge([fast, slow], now=1.0) and off.delays([fast, slow]) == {}


def test_the_policy_judges_service_times_not_queues() -> None:
    """A server throttled to a tenth (stopped, then quick: its answers bimodal) is judged
    by its service times (from the later of a task's send and the answer before it), so
    its probes on an idle server look as slow as it is; it comes back only once as many
    answers in a row as it owes are all in line (twice as many when it was set aside
    again soon after coming back); a task stuck far past the hedge delay, overtaken by
    its peers' answers, sets a server aside before it answered anything; a server behind gets no new task, unless every
    usable one is."""
    from dataserver_client.plan.hedging import MIN_TYPICAL, OVERTAKEN, STUCK_FACTOR, Hedging

    fast, slow = _Peer(), _Peer()
    policy: Hedging[_Peer] = Hedging()
    # Four tasks queued on ``fast`` at once, answered 20 ms apart: latencies of 20-80 ms,
    # service times of 20 ms each.
    for burst in range(4):
        t0 = 10.0 * burst
        for k in range(4):
            policy.observe(fast, t0, t0 + 0.02 * (k + 1))
    for k in range(3):
        _answer(policy, slow, 0.2, 40.0 + k)  # (200 ms for a task alone: 10x)
    assert policy.judge([fast, slow], now=45.0) and policy.outliers == {slow}
    # Probes on the idle server: fast, slow, fast (a median in line, one in three 10x).
    for i, took in enumerate([0.02, 0.2, 0.02, 0.02, 0.2]):
        _answer(policy, slow, took, 50.0 + i)
        assert not policy.judge([fast, slow], now=50.5 + i) and policy.outliers == {slow}
    for i in range(MIN_TYPICAL):
        _answer(policy, slow, 0.02, 60.0 + i)
    assert policy.judge([fast, slow], now=63.0) and policy.outliers == frozenset()
    # Slow again soon after: set aside, and back only after twice the answers.
    for i in range(3):
        _answer(policy, slow, 0.3, 64.0 + i)
    assert policy.judge([fast, slow], now=67.0) and policy.outliers == {slow}
    for i in range(2 * MIN_TYPICAL - 1):
        _answer(policy, slow, 0.02, 70.0 + i)
        assert not policy.judge([fast, slow], now=70.5 + i)
    _answer(policy, slow, 0.02, 80.0)
    assert policy.judge([fast, slow], now=80.5) and policy.outliers == frozenset()

    # A server that answers nothing: an outlier once its task waited STUCK_FACTOR delays.
    a, b = _Peer(), _Peer()
    stuck: Hedging[_Peer] = Hedging()
    for i in range(8):
        _answer(stuck, a, 0.01, 1.0 + i)
    delay = stuck.delays([a, b])[b]
    b.outstanding[1] = 100.0
    # Waited long, but no peer answered a task sent after it (a start slow everywhere).
    assert not stuck.judge([a, b], now=100.0 + STUCK_FACTOR * delay * 1.1)
    for i in range(OVERTAKEN):
        _answer(stuck, a, 0.001, 100.002 + 0.001 * i)
    assert not stuck.judge([a, b], now=100.0 + STUCK_FACTOR * delay * 0.9)
    assert stuck.judge([a, b], now=100.0 + STUCK_FACTOR * delay * 1.1)
    assert stuck.outliers == {b}
    # Behind: no new task, unless every usable server is.
    stuck.lag([a], usable=2)
    assert stuck.aside == {a, b}
    stuck.lag([a], usable=1)
    assert stuck.aside == {b}


def test_a_hedge_is_queued_first_in_its_session() -> None:
    """A TASK with ``priority`` (the client's hedge of a task a slow server holds) is
    queued ahead of its session's other tasks; another session's turn is not taken."""
    from dataserver.server.front.sessions import Scheduler, TaskEntry

    sched = Scheduler(8, 64, 1 << 20, 1 << 20)
    mine, theirs = b"m" * 16, b"t" * 16
    for sid in (mine, theirs):
        session = sched.open(sid, sid, sid)
        assert session is not None
        for tid in (1, 2, 3):
            sched.admit(session, TaskEntry(sid, tid, 1, ((tid,),), []))
    hedge = TaskEntry(mine, 9, 1, ((9,),), [])
    sched.admit(sched.sessions[mine], hedge, first=True)
    order = []
    while (entry := sched.pop()) is not None:
        order.append((entry.session, entry.task_id))
        sched.charge(entry.session, 100)
    assert [t for s, t in order if s == mine] == [9, 1, 2, 3]
    assert [t for s, t in order if s == theirs] == [1, 2, 3]
    assert order[:2] in ([(mine, 9), (theirs, 1)], [(theirs, 1), (mine, 9)])
