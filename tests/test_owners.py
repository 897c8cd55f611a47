"""The client's owners alone, without sockets: the hand-off, the task ledger, affinity, the
plan book and the message handlers (each changes its own state only, through its methods)."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import pytest
import torch

from dataserver.counting import Counts
from dataserver.protocol import BatchSizes
from dataserver_client.buffers.assembly import DeviceMover, HostBuffers
from dataserver_client.buffers.handoff import Handoff, Stuck
from dataserver_client.config import ClientConfig
from dataserver_client.counts import Count, Reject
from dataserver_client.engine.book import PlanBook
from dataserver_client.engine.dispatch import Sender
from dataserver_client.engine.handlers import Handlers
from dataserver_client.engine.parts import LoopHooks, Parts
from dataserver_client.errors import DataServerError
from dataserver_client.net.links import Links
from dataserver_client.net.serverlink import LinkState, ServerLink
from dataserver_client.plan.affinity import Affinity, rendezvous
from dataserver_client.plan.epoch import REGULAR, STITCH, BatchPlan, ImagePlan
from dataserver_client.plan.hedging import Hedging
from dataserver_client.plan.pacing import Pacing
from dataserver_client.session.inflight import InflightBatch
from dataserver_client.session.ledger import TaskLedger

pytestmark = pytest.mark.timeout(60)


# ------------------------------------------------------------ hand-off


def test_handoff_takes_in_step_order_and_refuses_other_plans() -> None:
    h: Handoff[str] = Handoff()
    h.begin(0, version=1)
    assert h.put(1, 1, "b1") and h.put(0, 1, "b0")
    assert not h.put(2, 0, "stale")  # another plan's batch is never held
    assert h.take(1.0, lambda: True) == "b0"
    assert h.take(1.0, lambda: True) == "b1"
    assert not h.put(0, 1, "taken already")
    assert h.taken() == 2


def test_handoff_drop_from_keeps_earlier_and_returns_the_first() -> None:
    h: Handoff[str] = Handoff()
    h.begin(3, version=1)
    for step in (3, 4, 5):
        h.put(step, 1, f"b{step}")
    h.end_at(6)
    assert h.drop_from(3, version=2) == "b3"
    assert not h.ended()
    assert not h.put(4, 1, "old plan")
    assert h.put(3, 2, "new")
    assert h.take(1.0, lambda: True) == "new"


def test_handoff_end_fail_and_stuck() -> None:
    h: Handoff[str] = Handoff()
    h.begin(0, version=1)
    h.end_at(0)
    with pytest.raises(StopIteration):
        h.take(1.0, lambda: True)
    h.begin(0, version=1)
    with pytest.raises(Stuck):
        h.take(0.05, lambda: True)
    with pytest.raises(DataServerError, match="closed"):
        h.take(1.0, lambda: False)  # the I/O thread is gone, with no error of its own
    h.fail(DataServerError("first"))
    h.fail(DataServerError("second"))
    with pytest.raises(DataServerError, match="first"):
        h.take(1.0, lambda: True)


def test_handoff_wakes_a_waiting_trainer() -> None:
    h: Handoff[str] = Handoff()
    h.begin(0, version=1)
    threading.Timer(0.05, lambda: h.put(0, 1, "late")).start()
    assert h.take(5.0, lambda: True) == "late"


# ------------------------------------------------------------ ledger and affinity


@dataclass(eq=False)
class FakeServer:
    salt: int
    workers: int = 2


SIZES = BatchSizes.of((8, 8))


def _batch(n: int = 4, step: int = 0) -> InflightBatch:
    images = tuple(ImagePlan((i,), 1) for i in range(n))
    plan = BatchPlan(step, 1, REGULAR, 0, n, images, SIZES)
    return InflightBatch(plan, torch.zeros((n, 3, 8, 8), dtype=torch.uint8))


def test_ledger_queue_send_and_ask_again_in_plan_order() -> None:
    ledger, aff = TaskLedger(), cast(Any, Affinity())
    batch = _batch()
    a = ledger.add(batch, (0, 1), ((0,), (1,)), 1, SIZES, 1)
    b = ledger.add(batch, (2, 3), ((2,), (3,)), 1, SIZES, 1)
    assert ledger.pending == 2 and len(ledger) == 2
    link: Any = FakeServer(1)
    assert ledger.pop_pending(link, aff) is a
    ledger.sent(a, link, None)
    assert a.link is link
    assert ledger.pop_pending(link, aff) is b
    assert ledger.ask_again([b, a]) == 2
    assert a.link is None
    assert ledger.pop_pending(None, aff) is a  # plan order: slot 0 first
    assert ledger.wanted(a.task_id, 1) is a and ledger.wanted(a.task_id, 2) is None
    ledger.done(a)
    assert a.task_id not in ledger and ledger.ask_again([a]) == 0


def test_ledger_forget_with_cancel_names_what_was_sent() -> None:
    ledger, aff = TaskLedger(), cast(Any, Affinity())
    batch = _batch()
    a = ledger.add(batch, (0,), ((0,),), 1, SIZES, 1)
    ledger.add(batch, (1,), ((1,),), 1, SIZES, 1)
    link: Any = FakeServer(1)
    first = ledger.pop_pending(link, aff)
    assert first is a
    ledger.sent(first, link, None)
    ledger.forget(lambda r: r.batch is batch, cancel=True)
    assert ledger.cancels and ledger.take_cancels() == [(link, a.task_id)]
    assert not ledger.cancels and len(ledger) == 0
    assert ledger.pop_pending(link, aff) is None


def test_ledger_split_and_probe_find_the_poison() -> None:
    ledger = TaskLedger()
    batch = _batch()
    rec = ledger.add(batch, (0, 1, 2), ((0,), (1,), (2,)), 1, SIZES, 1)
    bad = ledger.split(rec, 1)
    assert bad is not None and bad.slots == (1,) and rec.task_id not in ledger
    stitched = ledger.add(batch, (3,), ((10, 11),), 2, SIZES, 1)
    ledger.probe(stitched)
    probes = [r for r in ledger if r.probe_of is stitched]
    assert sorted(p.indices for p in probes) == [(10,), (11,)]
    assert ledger.probe_done(probes[0], bad=probes[0].indices == (11,)) is None
    assert ledger.probe_done(probes[1], bad=probes[1].indices == (11,)) is None
    # composed again without it, as a new task: a late answer to the old id is not its
    again = [r for r in ledger if r.images == ((10, 11),) and r.probe_of is None]
    assert stitched.task_id not in ledger and len(again) == 1 and again[0].exclude == (11,)
    assert again[0].slots == (3,) and again[0].task_id != stitched.task_id
    # A second poison answer while its probes run (a copy asked again): probed once only.
    twice = ledger.add(batch, (4,), ((20, 21),), 2, SIZES, 1)
    ledger.probe(twice)
    ledger.probe(twice)
    probes = [r for r in ledger if r.probe_of is twice]
    assert sorted(p.indices for p in probes) == [(20,), (21,)]
    for probe in probes:
        ledger.probe_done(probe, bad=probe.indices == (21,))
    assert [r.exclude for r in ledger if r.images == ((20, 21),)] == [(21,)]
    alone = ledger.add(batch, (3,), ((12, 13),), 2, SIZES, 1)
    ledger.probe(alone)
    last = None
    for probe in [r for r in ledger if r.probe_of is alone]:
        last = ledger.probe_done(probe, bad=False)
    assert last is alone and ledger.skipped_poison == 1  # the composition itself kills


def test_affinity_routes_by_weight_and_forgets_servers_gone() -> None:
    a, b = FakeServer(11, workers=1), FakeServer(22, workers=3)
    wins = [rendezvous([a, b], key) for key in range(4000)]
    assert 0.65 < wins.count(b) / len(wins) < 0.85  # about 3/4
    aff = Affinity[FakeServer]()
    assert aff.route(5) is None  # fewer than two servers: route nothing
    aff.set_ready([a, b])
    key = next(k for k in range(100) if aff.route(k) is b)
    aff.claim([key], a)
    assert aff.server_for(key) is a and not aff.movable([key], b) and aff.movable([key], a)
    aff.set_ready([b, FakeServer(33)])
    assert aff.owner(key) is None  # a is gone
    aff.clear()
    assert aff.server_for(key) in aff.live()


# ------------------------------------------------------------ plan book


def _book(**kw: Any) -> tuple[PlanBook, Handoff, TaskLedger]:
    cfg = ClientConfig(
        **{
            "addresses": ("tcp://127.0.0.1:1",),
            "batch_size": 4,
            "image_size": (16, 16),
            "stitch_k": 4,
            "device": torch.device("cpu"),
            **kw,
        }
    )
    cpu = torch.device("cpu")
    handoff: Handoff = Handoff()
    ledger = TaskLedger()
    buffers = HostBuffers(cpu, keep=4)
    book = PlanBook(cfg, handoff, DeviceMover(cpu), buffers, ledger, Affinity())
    return book, handoff, ledger


def _answer_all(book: PlanBook, ledger: TaskLedger) -> None:
    from dataserver.protocol import Result

    for rec in list(ledger):
        n = len(rec.slots)
        result = Result(
            session=b"s" * 16,
            task_id=rec.task_id,
            plan_version=rec.plan_version,
            images=rec.images,
            box_counts=(0,) * n,
            boxes=np.zeros((0, 4), np.float32),
            labels=np.zeros((0,), np.int64),
        )
        book.on_result(rec, result)


def test_book_plans_prefetch_batches_and_delivers_in_order() -> None:
    """The first batch is cut for every worker slot, the batches behind it one task each,
    up to ``prefetch`` ahead of the trainer."""
    book, handoff, ledger = _book(prefetch=4, shuffle=False)
    assert book.start_epoch(0, 40) == 40
    book.fill()  # (2 slots, the share before any WELCOME)
    assert Counter(r.step for r in ledger) == {0: 2, 1: 1, 2: 1, 3: 1}
    _answer_all(book, ledger)
    first = handoff.take(1.0, lambda: True)
    assert not isinstance(first, DataServerError)
    assert first.batch.step == 0 and first.batch.indices == [[0], [1], [2], [3]]
    book.fill()  # one taken, three more ready: planned up to 4 beyond the trainer
    assert Counter(r.step for r in ledger) == {4: 2}
    assert book.fill(deeper=0) is False  # (nothing left to plan: 4 ahead)


def test_book_steer_replans_from_the_first_batch_not_taken() -> None:
    book, _, ledger = _book(prefetch=4, shuffle=False)
    book.start_epoch(0, 40)
    book.fill()
    version = book.steer(STITCH, None)
    assert book.mode == STITCH and version == book.plan_version and len(ledger) == 0
    book.fill()
    steps = sorted({r.step for r in ledger})
    assert steps == [0, 1, 2] and all(len(r.images[0]) == 4 for r in ledger)
    assert book.position().step == 0 and book.position().mode == STITCH


def test_book_fails_a_batch_through_the_handoff() -> None:
    book, handoff, ledger = _book(prefetch=1, shuffle=False)
    book.start_epoch(0, 4)
    book.fill()
    rec = next(iter(ledger))
    book.on_failure(rec, "request", DataServerError("refused"))
    assert isinstance(handoff.take(1.0, lambda: True), DataServerError)
    assert len(ledger) == 0


def test_pacing_cuts_for_the_whole_share_only_with_nothing_in_flight() -> None:
    """An idle rank's batch goes to every slot of its share; behind batches in flight, a
    batch gets its part of the share over the depth; a segment of one server is never
    cut across another's."""
    pacing = Pacing(world_size=2)
    pacing.servers(slots=16, task_bytes=None)  # a share of 8 slots for this rank
    assert pacing.share() == 8
    assert pacing.tasks_per_batch(64, depth=4, busy=False) == 8
    assert pacing.tasks_per_batch(64, depth=4, busy=True) == 2
    a, b = object(), object()
    runs = pacing.cut([a] * 4 + [b] * 4, (16, 16), depth=4, busy=True)
    assert [tuple(run) for run in runs] == [(0, 1, 2, 3), (4, 5, 6, 7)]


# ------------------------------------------------------------ handlers


@dataclass(eq=False)
class FakeLink:
    """What ``Handlers`` reads of a ``ServerLink`` when the ready servers change."""

    salt: int
    workers: int
    credit: int
    state: LinkState = LinkState.READY
    welcome_msg: Any = None

    def drain(self) -> None:
        self.state = LinkState.DRAINING


class FakeLinks:
    def __init__(self, *links: FakeLink) -> None:
        self.links = list(links)

    def __iter__(self) -> Iterator[FakeLink]:
        return iter(self.links)

    def ready(self) -> list[FakeLink]:
        return [lk for lk in self.links if lk.state is LinkState.READY]

    def stores(self) -> bool:
        return True


def _handlers(
    book: PlanBook,
    ledger: TaskLedger,
    links: FakeLinks,
    counters: Counts[Count],
    rejected: Counts[Reject],
) -> Handlers:
    """``Handlers`` of ``book`` and ``ledger`` over fake links, with no sockets."""
    return Handlers(
        ClientConfig(addresses=("tcp://127.0.0.1:1",), device=torch.device("cpu")),
        Parts(
            book,
            ledger,
            Affinity(),
            Hedging(),
            HostBuffers(torch.device("cpu"), keep=4),
            None,
            counters,
            rejected,
        ),
        cast(Links, links),
        cast(Sender, None),
        LoopHooks(Future(), lambda exc: None, lambda link: None, lambda link: None),
    )


def test_handlers_take_parallelism_from_the_welcome_credit() -> None:
    """Each ready server runs half its credit at once (the rest waits queued there): the
    book cuts batches into that many tasks, and a server that drains counts no more."""
    book, _, ledger = _book(prefetch=1, shuffle=False, batch_size=64)
    a, b = FakeLink(1, workers=2, credit=8), FakeLink(2, workers=3, credit=20)
    counters = Counts(Count)
    handlers = _handlers(book, ledger, FakeLinks(a, b), counters, Counts(Reject))
    handlers.on_bye(cast(ServerLink, b))  # b drains: only a's 8 // 2 run at once
    assert counters.get(Count.SERVERS_DRAINED) == 1
    book.start_epoch(0, 64)
    book.fill()  # (nothing in flight: the batch is cut for the whole share)
    assert len(ledger) == 4
    handlers.on_bye(cast(ServerLink, a))  # none ready: one task at a time
    book.start_epoch(0, 64)
    book.fill()
    assert len(ledger) == 1


@dataclass(eq=False)
class AnsweringLink(FakeLink):
    """A ``FakeLink`` that is also told of its answers (``Handlers.on_result``)."""

    session: bytes = b"s" * 16
    address: str = "tcp://127.0.0.1:1"

    def release(self, task_id: int) -> float | None:
        return None

    def answered(self) -> None:
        pass


def test_a_late_answer_after_the_task_expired_there_is_late_not_wrong() -> None:
    """A task that expired at server A is asked again at B; A's answer then comes after
    all, its pixels not received (the task is no longer A's): it is counted late, and A is
    not banned for answering "with no pixels" (it did nothing wrong)."""
    from dataserver.protocol import Result

    book, _, ledger = _book(prefetch=1, shuffle=False)
    a = AnsweringLink(1, workers=2, credit=8)
    b = AnsweringLink(2, workers=2, credit=8)
    counters, rejected = Counts(Count), Counts(Reject)
    handlers = _handlers(book, ledger, FakeLinks(a, b), counters, rejected)
    book.start_epoch(0, 16)
    book.fill()
    affinity: Affinity[ServerLink] = Affinity()
    rec = ledger.pop_pending(cast(ServerLink, a), affinity)
    assert rec is not None
    assert ledger.ask_again([rec], away_from=cast(ServerLink, a)) == 1  # A let it expire
    assert ledger.pop_pending(cast(ServerLink, b), affinity) is rec  # now B's
    late = Result(
        session=a.session,
        task_id=rec.task_id,
        plan_version=rec.plan_version,
        images=rec.images,
        box_counts=(0,) * len(rec.images),
        pixels=None,  # (not received: the task is B's)
        boxes=np.zeros((0, 4), np.float32),
        labels=np.zeros((0,), np.int64),
    )
    handlers.on_result(cast(ServerLink, a), late)
    assert counters.get(Count.LATE) == 1
    assert rejected.get(Reject.WRONG_ANSWER) == 0
    assert a.state is LinkState.READY
    assert ledger.wanted(rec.task_id, rec.plan_version) is rec  # still B's to answer
