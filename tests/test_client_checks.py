"""Issue 15, point 5: the client checks what it is told. A lying server (a fake one here, a
ZeroMQ ROUTER speaking the protocol with ``dataserver.protocol``'s encoders) next to a real
``dataserver serve``: its wrong answers are a protocol error against it (dropped for good,
its tasks asked again of the real one, the epoch delivered exactly once); alone, the
client fails within its timeout naming it and what was wrong. A tampered ``state_dict`` is
refused at load time, naming the field."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import zmq
from clients import make_client
from conftest import Server
from fuzz_targets import welcome_of

from dataserver.protocol import Bye, Cancelled, Heartbeat, Hello, Result, Task, Welcome, decode
from dataserver_client import DataServerClient, DataServerError
from dataserver_client.plan.epoch import epoch_order
from dataserver_client.plan.resume import (
    CONFIG_KEYS,
    MAX_STATE_RANKS,
    RANK_KEYS,
    check_state,
    config_value,
)

pytestmark = pytest.mark.timeout(180)

N = 48
KW: dict[str, Any] = dict(batch_size=4, image_size=(32, 32), shared_memory=False)

# What a fake server answers to one TASK: (images, box_counts, failed, boxes, labels).
Answer = tuple[tuple[tuple[int, ...], ...], tuple[int, ...], tuple[tuple[int, str], ...], Any, Any]


def honest(task: Task) -> Answer:
    """What a real server would say (pixels aside): every source kept, one box each."""
    n = len(task.images)
    h, w = task.out_hw
    boxes = np.tile(np.array([[1, 1, w / 2, h / 2]], np.float32), (n, 1))
    return task.images, (1,) * n, (), boxes, np.ones(n, np.int64)


def claims_failed(task: Task) -> Answer:
    """Says the first source of the task failed, though the task said on_error="raise"."""
    first = task.images[0][0]
    images = tuple(tuple(i for i in img if i != first) for img in task.images)
    _, counts, _, boxes, labels = honest(task)
    return images, counts, ((first, f"sample {first} (img{first}.jpg): corrupt"),), boxes, labels


def nan_boxes(task: Task) -> Answer:
    images, counts, failed, boxes, labels = honest(task)
    boxes[0, 2] = np.nan
    return images, counts, failed, boxes, labels


def negative_label(task: Task) -> Answer:
    images, counts, failed, boxes, labels = honest(task)
    labels[-1] = -5
    return images, counts, failed, boxes, labels


def box_outside(task: Task) -> Answer:
    images, counts, failed, boxes, labels = honest(task)
    boxes[0] = (0, 0, task.out_hw[1] + 40, 3)
    return images, counts, failed, boxes, labels


def content_outside(task: Task, frames: list[Any]) -> list[Any]:
    """An honest RESULT but for its content boxes: each reaching past its canvas."""
    images, counts, failed, boxes, labels = honest(task)
    out_h, out_w = task.out_hw
    return Result(
        session=task.session,
        task_id=task.task_id,
        plan_version=task.plan_version,
        images=images,
        box_counts=counts,
        failed=failed,
        pixels=np.zeros((len(task.images), 3, *task.out_hw), np.uint8),
        boxes=np.asarray(boxes, np.float32).reshape(-1, 4),
        labels=np.asarray(labels, np.int64),
        content=((4, 0, out_h, out_w),) * len(images),
    ).encode()


def wrong_indices(task: Task) -> Answer:
    """Answers with other samples than those asked (each index + 1)."""
    _, counts, failed, boxes, labels = honest(task)
    images = tuple(tuple((i + 1) % N for i in img) for img in task.images)
    return images, counts, failed, boxes, labels


# What a fake server sends for one TASK instead of its RESULT: given the task and the frames
# of the RESULT ``answer`` makes, the frames to send.
Reply = Callable[[Task, list[Any]], list[Any]]


class FakeServer:
    """A server that answers HELLO with a WELCOME (``dataset_len``/``fingerprint`` as told),
    heartbeats with heartbeats, and every TASK with ``answer(task)`` (zero pixels), its
    frames passed through ``reply`` when given."""

    def __init__(
        self,
        answer: Callable[[Task], Answer],
        dataset_len: int = N,
        fingerprint: str = "fake",
        categories: Any = (),
        reply: Reply | None = None,
    ) -> None:
        self.answer = answer
        self.reply = reply
        self.dataset_len = dataset_len
        self.fingerprint = fingerprint
        self.categories = tuple(categories)
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.data = self.ctx.socket(zmq.ROUTER)
        self.data.setsockopt(zmq.LINGER, 0)
        self.address = f"tcp://127.0.0.1:{self.data.bind_to_random_port('tcp://127.0.0.1')}"
        self.tasks = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if self.data.poll(50):
                    frames = self.data.recv_multipart()
                    self._on(frames[0], decode(frames[1:]))
        except BaseException as exc:  # reported by close()
            self.error = exc
        finally:
            self.data.close(linger=0)
            self.ctx.term()

    def _on(self, peer: bytes, msg: Any) -> None:
        reply: list[Any] | None = None
        if isinstance(msg, Hello):
            reply = Welcome(
                session=msg.session,
                server_id="fake-server",
                dataset_len=self.dataset_len,
                fingerprint=self.fingerprint,
                categories=self.categories,
                workers=2,
                credit=4,
            ).encode()
        elif isinstance(msg, Heartbeat):
            reply = Heartbeat(server_id="fake-server").encode()
        elif isinstance(msg, Task):
            self.tasks += 1
            images, counts, failed, boxes, labels = self.answer(msg)
            reply = Result(
                session=msg.session,
                task_id=msg.task_id,
                plan_version=msg.plan_version,
                images=images,
                box_counts=counts,
                failed=failed,
                pixels=np.zeros((len(msg.images), 3, *msg.out_hw), np.uint8),
                boxes=np.asarray(boxes, np.float32).reshape(-1, 4),
                labels=np.asarray(labels, np.int64),
            ).encode()
            if self.reply is not None:
                reply = self.reply(msg, reply)
        elif isinstance(msg, Bye):
            return
        if reply is not None:
            self.data.send_multipart([peer, *reply], copy=False)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        assert self.error is None, f"the fake server failed: {self.error!r}"


@pytest.fixture(scope="module")
def real() -> Iterator[Server]:
    server = Server("--dataset", f"synthetic:images={N},seed=5", workers=2)
    yield server
    server.stop()


def fake_beside(
    real: Server, answer: Callable[[Task], Answer], reply: Reply | None = None
) -> FakeServer:
    w = welcome_of(real.address)
    return FakeServer(answer, w.dataset_len, w.fingerprint, w.categories, reply)


def epoch(client: DataServerClient, number: int = 0) -> list[Any]:
    client.set_epoch(number)
    return list(client)


def check_exactly_once_from_real(client: DataServerClient, fake: FakeServer) -> None:
    """One whole epoch, each sample once, every box finite inside its image, every label a
    class id; the fake was used, then dropped, and nothing of it reached the trainer."""
    batches = epoch(client)
    assert sorted(i for b in batches for idx in b.indices for i in idx) == list(range(N))
    for b in batches:
        h, w = b.images.shape[-2:]
        for t in b.targets:
            boxes, labels = t["boxes"].numpy(), t["labels"].numpy()
            assert np.isfinite(boxes).all()
            assert (boxes[:, :2] >= 0).all() and (boxes[:, 2] <= w).all()
            assert (boxes[:, 3] <= h).all() and (labels >= 0).all()
        assert all(img.any() for img in b.images)  # real pixels, never the fake's zeros
    stats = client.stats()
    assert fake.tasks > 0
    assert stats["rejected"]["bad_server"] == 1
    states = {s["address"]: s["state"] for s in stats["servers"]}
    assert states[fake.address] == "banned"
    assert all(s == "ready" for a, s in states.items() if a != fake.address)


# ---------------------------------------------------------------- 1. "failed" under raise


def test_failed_claims_under_raise_raise_naming_the_sample() -> None:
    fake = FakeServer(claims_failed)
    try:
        with make_client(fake.address, timeout=10, **KW) as c:
            c.set_epoch(0)
            it = iter(c)
            with pytest.raises(DataServerError) as err:
                for _ in range(N):
                    next(it)
            assert err.value.index is not None and 0 <= err.value.index < N
            assert err.value.file == f"img{err.value.index}.jpg"
            assert fake.address in str(err.value) and "corrupt" in str(err.value)
    finally:
        fake.close()


def test_failed_claims_under_skip_are_skipped_and_counted() -> None:
    fake = FakeServer(claims_failed)
    try:
        with make_client(fake.address, timeout=10, on_error="skip", **KW) as c:
            batches = epoch(c)
            delivered = [i for b in batches for idx in b.indices for i in idx]
            skipped = [i for b in batches for i in b.skipped_indices]
            assert sorted(delivered + skipped) == list(range(N)) and skipped
    finally:
        fake.close()


# ---------------------------------------------------------------- 2. boxes and labels


@pytest.mark.parametrize("answer", [nan_boxes, negative_label, box_outside])
def test_bad_boxes_or_labels_drop_the_server_and_the_real_one_finishes(
    real: Server, answer: Callable[[Task], Answer]
) -> None:
    fake = fake_beside(real, answer)
    try:
        with make_client([fake.address, real.address], timeout=20, **KW) as c:
            check_exactly_once_from_real(c, fake)
            assert c.stats()["rejected"]["bad_boxes"] == 1
    finally:
        fake.close()


def test_content_boxes_outside_the_canvas_drop_the_server(real: Server) -> None:
    """``batch.content`` is only ever what a server said within its canvas."""
    fake = fake_beside(real, honest, content_outside)
    try:
        with make_client([fake.address, real.address], timeout=20, **KW) as c:
            check_exactly_once_from_real(c, fake)
            assert c.stats()["rejected"]["bad_boxes"] == 1
    finally:
        fake.close()


def error_from_the_only_server(answer: Callable[[Task], Answer]) -> tuple[str, str]:
    """(error text, fake's address) when a lying fake is the client's only server: the
    epoch fails within its timeout (3 s), not at the backstop."""
    fake = FakeServer(answer)
    try:
        with make_client(fake.address, timeout=3, **KW) as c:
            c.set_epoch(0)
            started = time.monotonic()
            with pytest.raises(DataServerError) as err:
                list(c)
            assert time.monotonic() - started < 3 + 5  # the timeout, not the backstop
            return str(err.value), fake.address
    finally:
        fake.close()


def test_bad_boxes_from_the_only_server_fail_naming_it() -> None:
    error, address = error_from_the_only_server(nan_boxes)
    assert address in error and "box" in error
    assert "nan" in error.lower()


# ---------------------------------------------------------------- 3. indices not asked


def test_results_for_indices_not_asked_drop_the_server(real: Server) -> None:
    fake = fake_beside(real, wrong_indices)
    try:
        with make_client([fake.address, real.address], timeout=20, **KW) as c:
            check_exactly_once_from_real(c, fake)
            assert c.stats()["rejected"]["wrong_answer"] == 1
            assert fake.tasks <= 8  # dropped at its first answer, not asked 20k times
    finally:
        fake.close()


def test_results_for_indices_not_asked_from_the_only_server_fail_in_time() -> None:
    error, address = error_from_the_only_server(wrong_indices)
    assert "no progress" in error
    assert address in error and "not those asked" in error


# ---------------------------------------------------------------- 4. WELCOME's size


@pytest.mark.parametrize("size", [(1 << 40) + 1, 1 << 47])
def test_a_welcome_announcing_too_many_samples_is_refused(size: int) -> None:
    fake = FakeServer(honest, dataset_len=size)
    try:
        started = time.monotonic()
        with pytest.raises(DataServerError) as err:
            make_client(fake.address, timeout=10, **KW)
        assert time.monotonic() - started < 10
        assert fake.address in str(err.value) and str(size) in str(err.value)
        assert "max_dataset_len" in str(err.value)
    finally:
        fake.close()


def test_an_epoch_of_2_31_samples_starts_at_once() -> None:
    """Issue 28: a server announcing 2**31 samples (the default ``max_dataset_len`` is 2**40)
    costs the trainer nothing before its first batch: the order is computed per position
    (before, a table of it: 8 GiB and minutes). From the epoch's first ``next()`` to its
    batch, end to end through a (fake) server's answers."""
    n = 1 << 31
    fake = FakeServer(honest, dataset_len=n)
    try:
        with make_client(fake.address, timeout=10, seed=3, **KW) as c:
            assert c.dataset_len == n
            c.set_epoch(2)
            it = iter(c)
            started = time.perf_counter()
            first = next(it)
            took = time.perf_counter() - started
            second = next(it)
        want = epoch_order(n, 3, 2, True)[:8].tolist()
        assert [i for idx in first.indices + second.indices for i in idx] == want
        assert max(want) > 1 << 20  # spread over the whole dataset
        assert took < 2.0, took  # (measured: ~10 ms; the bound is for a loaded test host)
    finally:
        fake.close()


def test_servers_disagreeing_at_the_handshake_fail_it_without_killing_the_io_thread(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Two servers announce different datasets: the handshake fails naming both, and the
    I/O thread ends cleanly (it completed the failed handshake once more with the other
    server's WELCOME and died of InvalidStateError: issue 25 item 12)."""
    a, b = FakeServer(honest, fingerprint="one"), FakeServer(honest, fingerprint="another")
    try:
        with caplog.at_level(logging.ERROR), pytest.raises(DataServerError) as err:
            make_client([a.address, b.address], timeout=10, **KW)
        assert "disagree on the dataset" in str(err.value)
        assert not [r for r in caplog.records if "I/O thread failed" in r.getMessage()]
    finally:
        a.close()
        b.close()


def test_max_dataset_len_is_the_clients_to_set() -> None:
    fake = FakeServer(honest, dataset_len=N)
    try:
        with pytest.raises(DataServerError, match=f"{N} samples"):
            make_client(fake.address, timeout=10, max_dataset_len=N - 1, **KW)
        with make_client(fake.address, timeout=10, max_dataset_len=N, **KW) as c:
            assert c.dataset_len == N
        with pytest.raises(ValueError, match="max_dataset_len"):
            make_client(fake.address, max_dataset_len=0, **KW)
    finally:
        fake.close()


# ---------------------------------------------------------------- 5. tampered states


def test_every_field_of_a_loaded_state_is_checked(real: Server) -> None:
    with make_client(real.address, **KW) as c:
        c.set_epoch(2)
        it = iter(c)
        next(it)
        next(it)
        state = c.state_dict()
        assert state["position"] == 8 and state["step"] == 2
        shard = c.num_samples
        tampered: dict[str, list[Any]] = {
            "position": [-8, shard + 1, 2**64, True, "8", 1.5],
            "step": [-1, 10**6, 9, None],
            "epoch": [-1, 2**64, "2"],
            "control_seq": [2**64, -1, 2.0],
            "feedback_seq": [-3, 2**63],
            "mode": ["sideways", None],
            "control": ["flag", {1: 2}],
        }
        for key, values in tampered.items():
            for value in values:
                with pytest.raises(ValueError, match=key) as err:
                    c.load_state_dict({**state, key: value})
                assert "must" in str(err.value) or "not" in str(err.value), err.value
        missing = {k: v for k, v in state.items() if k != "feedback_seq"}
        with pytest.raises(ValueError, match="feedback_seq"):
            c.load_state_dict(missing)
        # The same checks for each rank's entry of a job-wide state.
        job = {**state, "ranks": [{k: state[k] for k in RANK_KEYS}]}
        with pytest.raises(ValueError, match=r"ranks'\[0\] 'control_seq'"):
            c.load_state_dict({**job, "ranks": [{**job["ranks"][0], "control_seq": 2**64}]})
        # A state larger than any job's is refused by its size before its entries are read
        # (issue 25 item 9); a 10,000-rank job's state passes that bound.
        many = MAX_STATE_RANKS + 1
        with pytest.raises(ValueError, match=f"more than {MAX_STATE_RANKS} ranks"):
            c.load_state_dict({**job, "world_size": many, "ranks": [job["ranks"][0]] * many})
        with pytest.raises(ValueError, match=f"has {many} entries, more than"):
            c.load_state_dict({**job, "ranks": [job["ranks"][0]] * many})
        big = {**job["ranks"][0], "control": {"blob": "x" * 60_000}}
        with pytest.raises(ValueError, match="bytes of control values"):
            check_state({**job, "world_size": 2000, "ranks": [big] * 2000}, expected(job))
        # (Its ranks at position 0: a 10,000-rank job's shares of this dataset are a sample
        # or none, and a state with a rank past its share is refused, issue 39.)
        start = {**job["ranks"][0], "position": 0, "step": 0}
        wide = {**job, "position": 0, "step": 0, "world_size": 10_000, "ranks": [start] * 10_000}
        check_state(wide, expected(job))
        # The real state still loads, and goes on where it was.
        c.load_state_dict(state)
        c.load_state_dict(job)
        rest = list(c)
        assert sum(b.num_samples for b in rest) == shard - 8
        assert rest[0].step == 2


def expected(state: dict[str, Any]) -> dict[str, Any]:
    """What a client that saved ``state`` expects of a state it loads (``check_state``)."""
    keys = {k: config_value(state, k) for k in CONFIG_KEYS}
    return {**keys, "fingerprint": state["fingerprint"], "dataset_len": state["dataset_len"]}


# ---------------------------------------------------------------- 6. bad servers (issue 25, 10)


def counts_not_summing(task: Task, frames: list[Any]) -> list[Any]:
    """A RESULT whose box counts say twice the boxes it carries."""
    images, counts, failed, boxes, labels = honest(task)
    return Result(
        session=task.session,
        task_id=task.task_id,
        plan_version=task.plan_version,
        images=images,
        box_counts=tuple(2 * c for c in counts),
        failed=failed,
        pixels=np.zeros((len(task.images), 3, *task.out_hw), np.uint8),
        boxes=boxes,
        labels=labels,
    ).encode()


def extra_frames(task: Task, frames: list[Any]) -> list[Any]:
    return [*frames, *([b"x"] * 40)]


def labels_of_another_type(task: Task, frames: list[Any]) -> list[Any]:
    """The labels frame sent as int32 (half the bytes its header announces)."""
    labels = np.frombuffer(bytes(frames[-1]), np.int64).astype(np.int32)
    return [*frames[:-1], labels.tobytes()]


@pytest.mark.parametrize("reply", [counts_not_summing, extra_frames, labels_of_another_type])
def test_a_server_breaking_the_protocol_is_dropped_and_the_epoch_completes(
    real: Server, reply: Reply
) -> None:
    """A server whose RESULTs are malformed after its handshake is dropped at the first one
    (was: counted as malformed, kept, its tasks waiting on it: the job died "no progress"
    beside a healthy server); the epoch completes, exactly once, from the real one."""
    fake = fake_beside(real, honest, reply)
    try:
        with make_client([fake.address, real.address], timeout=20, **KW) as c:
            check_exactly_once_from_real(c, fake)
            # More than the protocol's 16 frames is refused before the message is read.
            why = "too_many_frames" if reply is extra_frames else "malformed"
            assert c.stats()["rejected"][why] >= 1
            assert fake.tasks <= 8
    finally:
        fake.close()


def cancels_everything(task: Task, frames: list[Any]) -> list[Any]:
    return Cancelled(
        session=task.session, task_ids=(task.task_id,), plan_version=task.plan_version
    ).encode()


def test_a_server_cancelling_every_task_does_not_get_it_back_at_once(real: Server) -> None:
    """Every task the fake gets it answers CANCELLED: the task moves to the real server
    (its affinity to the fake is gone) instead of going back to the fake at once (was:
    the same tasks 35,050 times in 5 s). The epoch completes, exactly once."""
    fake = fake_beside(real, honest, cancels_everything)
    try:
        with make_client([fake.address, real.address], timeout=20, **KW) as c:
            started = time.monotonic()
            batches = epoch(c)
            took = time.monotonic() - started
            got = sorted(i for b in batches for idx in b.indices for i in idx)
            assert got == list(range(N))
            assert all(img.any() for b in batches for img in b.images)  # the real one's
            # At most each of the epoch's tasks once a second (AVOID_S), not thousands.
            assert 0 < fake.tasks <= 4 * N * (1 + took)
            assert 1 <= c.stats()["cancelled"] <= fake.tasks
    finally:
        fake.close()


def test_a_server_announcing_another_dataset_mid_epoch_is_dropped(real: Server) -> None:
    """After a few answers the fake sends a WELCOME for another dataset: that server alone
    is dropped (was: the whole job failed); the epoch completes from the real one."""
    sent = [0]

    def reannounce(task: Task, frames: list[Any]) -> list[Any]:
        sent[0] += 1
        if sent[0] < 3:
            return frames
        return Welcome(
            session=task.session,
            server_id="fake-server",
            dataset_len=N + 1,
            fingerprint="another",
            workers=2,
            credit=4,
        ).encode()

    fake = fake_beside(real, honest, reannounce)
    try:
        with make_client([fake.address, real.address], timeout=20, **KW) as c:
            c.set_epoch(0)
            batches = list(c)
            got = sorted(i for b in batches for idx in b.indices for i in idx)
            assert got == list(range(N))
            states = {s["address"]: s["state"] for s in c.stats()["servers"]}
            assert states[fake.address] == "banned" and states[real.address] == "ready"
    finally:
        fake.close()
