"""Per-batch image sizes (issue 17, point 4) through the public API on real servers:
``set_image_size`` honoured by the very next batch whatever the prefetch, ``MultiScale``
schedules (held for ``every`` steps, the same on every client and rank, bit-identical on
any number of workers, in every mode and layout), ``StepSizes`` (a size per step, planned
ahead), sizes carried by ``state_dict`` through resume and elastic resume, and sources
stored once at the schedule's largest size.

Images come from ``ds_plugins:flat`` (a flat colour naming each index), so every image is
checked against ``compose_one`` run here on the same dataset: what a worker must send."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
from batches import flat_servers, snap
from clients import make_client
from conftest import Server, wait_until
from ds_plugins import FlatDataset, colour_of

from dataserver.data.pipeline import compose_one
from dataserver.protocol import BatchSizes
from dataserver_client import Batch, DataServerError, MultiScale, StepSizes
from dataserver_client.plan.epoch import epoch_order
from dataserver_client.plan.sizes import MAX_STEPS, schedule_of

pytestmark = pytest.mark.timeout(180)

N = 48
DATASET = FlatDataset(N)
SIZES = [(32, 32), (48, 64), (64, 48)]
SEED = 2  # a seed whose schedule changes within epoch 0 and differs in epoch 1 (asserted)
KW: dict[str, Any] = {"timeout": 20.0}


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[int, Server]]:
    """The same dataset behind a 1-worker and a 2-worker server."""
    yield from flat_servers(N)


def check_batch(
    batch: Batch,
    size: tuple[int, int],
    stored: tuple[int, int] | None = None,
    layout: str = "spatial",
) -> None:
    """``batch`` is made at ``size`` from sources stored at ``stored`` (None: at the size
    its manifest names, at least ``size``): its shape, its boxes inside the image, and every
    image bit-identical to ``compose_one`` on the dataset."""
    h, w = size
    assert tuple(batch.image_size) == size
    source = tuple(batch.manifest["source_size"])
    if stored is None:
        assert source[0] >= h and source[1] >= w, (source, size)
        stored = (source[0], source[1])
    assert source == stored
    assert tuple(batch.images.shape[-2:]) == size
    stitched = batch.mode == "stitch"
    for image, target, idx in zip(batch.images, batch.targets, batch.indices, strict=True):
        assert 1 <= len(idx) <= (4 if stitched else 1)
        boxes = target["boxes"]
        assert boxes.dtype == torch.float32 and target["labels"].dtype == torch.int64
        if len(boxes):
            assert (boxes[:, 0] >= 0).all() and (boxes[:, 1] >= 0).all()
            assert (boxes[:, 2] <= w).all() and (boxes[:, 3] <= h).all()
            assert (boxes[:, 2] > boxes[:, 0]).all() and (boxes[:, 3] > boxes[:, 1]).all()
        assert set(target["labels"].tolist()) <= {i + 1 for i in idx}
        if not stitched:
            assert image[:, 0, 0].tolist() == list(colour_of(idx[0]))  # its source, top-left
            assert target["labels"].tolist() == [idx[0] + 1]
        mosaic = stitched and layout == "mosaic"
        canvas, composed = compose_one(
            DATASET,
            idx,
            2 if stitched else 1,
            BatchSizes.of(size, stored=stored),
            batch.manifest["seed"],
            batch.epoch,
            step=batch.step,
            mode=batch.mode,
            layout="mosaic" if mosaic else "grid",
        )
        assert np.array_equal(canvas, image.numpy()), (batch.step, idx)
        assert np.array_equal(composed.boxes, boxes.numpy())
        assert composed.labels.tolist() == target["labels"].tolist()


def delivered(batches: list[Batch] | list[dict[str, Any]]) -> list[int]:
    out: list[int] = []
    for b in batches:
        for idx in b["indices"] if isinstance(b, dict) else b.indices:
            out.extend(idx)
    return out


# ------------------------------------------------------------------ set_image_size


@pytest.mark.parametrize("prefetch", [1, 4])
def test_set_image_size_is_honoured_by_the_very_next_batch(
    servers: dict[int, Server], prefetch: int
) -> None:
    """Sizes changed before the epoch and on several steps of it (larger than the client
    was built with too): each next batch has the new size, its boxes in its pixels, its
    feedback_seq counting the calls; the epoch still delivers each index once, in the
    epoch's order, as if the size had never changed."""
    changes = {0: (40, 40), 2: (48, 64), 3: (96, 80), 7: (32, 48), 8: (64, 64)}
    with make_client(
        servers[2].address, batch_size=3, image_size=(32, 32), prefetch=prefetch, seed=1, **KW
    ) as c:
        assert c.image_size == (32, 32)
        c.set_epoch(0)
        c.set_image_size(changes[0])  # between epochs: the first batch has it
        assert c.image_size == changes[0]
        size, calls, got = changes[0], 1, []
        it = iter(c)
        for step in range(N // 3):
            if step in changes and step:
                c.set_image_size(changes[step])
                size, calls = changes[step], calls + 1
                assert c.image_size == size
            batch = next(it)
            assert batch.step == step and batch.feedback_seq == calls
            assert batch.manifest["image_size"] == list(size)
            check_batch(batch, size)
            got.append(batch)
        with pytest.raises(StopIteration):
            next(it)
    assert delivered(got) == epoch_order(N, 1, 0, True).tolist()


@pytest.mark.parametrize("layout", ["spatial", "mosaic"])
def test_sizes_and_mode_flips_together_are_each_honoured_at_once(
    servers: dict[int, Server], layout: str
) -> None:
    """Random steering (mode flips, through the lookahead, and size changes) on most
    steps: every next batch has the mode and size last asked for; exactly once holds."""
    rnd = random.Random(17 if layout == "spatial" else 18)
    with make_client(
        servers[2].address,
        batch_size=2,
        image_size=(48, 48),
        stitch_layout=layout,
        prefetch=3,
        seed=3,
        **KW,
    ) as c:
        c.set_epoch(1)
        mode, size, calls, got = "regular", (48, 48), 0, []
        for batch in c:
            assert batch.mode == mode and batch.feedback_seq == calls
            check_batch(batch, size, layout=layout)
            got.append(batch)
            roll = rnd.random()
            if roll < 0.4:
                mode = "stitch" if mode == "regular" else "regular"
                c.set_mode(mode)
                calls += 1
            if roll > 0.3:
                size = rnd.choice([(32, 32), (48, 64), (64, 40), (56, 56)])
                c.set_image_size(size)
                calls += 1
    assert {b.mode for b in got} == {"regular", "stitch"}
    assert sorted(delivered(got)) == list(range(N))
    assert delivered(got) == epoch_order(N, 3, 1, True).tolist()


# ------------------------------------------------------------------ MultiScale


def schedule(ms: MultiScale, seed: int, epoch: int, steps: int) -> list[tuple[int, int]]:
    return [ms.size_at(seed, epoch, s) for s in range(steps)]


def test_a_multiscale_schedule_is_a_pure_function_held_for_every_steps() -> None:
    ms = MultiScale(SIZES, every=3)
    assert ms.stored == (64, 64) and ms.sizes == tuple(SIZES)
    assert MultiScale([32, (48, 64)]).sizes == ((32, 32), (48, 64))  # ints are squares
    assert MultiScale(range(32, 65, 32)).sizes == ((32, 32), (64, 64))
    first = schedule(ms, SEED, 0, 24)
    assert first == schedule(MultiScale(SIZES, every=3), SEED, 0, 24)  # any client, any rank
    for block in range(8):
        assert len(set(first[3 * block : 3 * block + 3])) == 1  # held for `every` steps
    assert len(set(first)) > 1  # it does change within the epoch
    assert schedule(ms, SEED, 1, 24) != first  # another epoch draws again
    assert schedule(ms, SEED + 1, 0, 24) != first  # and another seed
    assert set(first) <= set(SIZES)
    one = MultiScale(SIZES, every=1)
    assert [one.size_at(SEED, 0, b) for b in range(8)] == first[::3]  # block step // every
    assert MultiScale([(40, 40)], every=5).size_at(SEED, 3, 11) == (40, 40)
    assert ms == MultiScale(SIZES, 3) and ms != MultiScale(SIZES, 2)
    assert ms.to_state() == {"sizes": [list(s) for s in SIZES], "every": 3}


def test_multiscale_batches_follow_the_schedule_the_same_on_every_client(
    servers: dict[int, Server],
) -> None:
    """Two clients of one seed, two epochs: each batch at ``size_at(seed, epoch, step)``
    (blocks of 3), both clients bit-identical, the epochs' sizes different."""
    ms = MultiScale(SIZES, every=3)
    runs = []
    for server in (servers[2], servers[2]):
        with make_client(
            server.address, batch_size=2, image_size=ms, seed=SEED, prefetch=4, **KW
        ) as c:
            assert c.image_size == ms
            run = []
            for epoch in (0, 1):
                c.set_epoch(epoch)
                batches = list(c)
                assert len(batches) == N // 2
                assert sorted(delivered(batches)) == list(range(N))
                for b in batches:
                    check_batch(b, ms.size_at(SEED, epoch, b.step), ms.stored)
                    assert b.manifest["source_size"] == [64, 64]
                run.append([snap(b) for b in batches])
            runs.append(run)
    assert runs[0] == runs[1]
    sizes = [[b["image_size"] for b in epoch] for epoch in runs[0]]
    assert sizes[0] == schedule(ms, SEED, 0, N // 2) != sizes[1] == schedule(ms, SEED, 1, N // 2)


def test_ranks_take_the_same_size_at_the_same_step(servers: dict[int, Server]) -> None:
    ms = MultiScale(SIZES, every=3)
    per_rank = []
    for rank in (0, 1):
        with make_client(
            servers[2].address,
            batch_size=2,
            image_size=ms,
            seed=SEED,
            rank=rank,
            world_size=2,
            **KW,
        ) as c:
            c.set_epoch(1)
            batches = list(c)
            per_rank.append(([b.image_size for b in batches], delivered(batches)))
    assert per_rank[0][0] == per_rank[1][0] == schedule(ms, SEED, 1, N // 4)
    assert sorted(per_rank[0][1] + per_rank[1][1]) == list(range(N))  # disjoint, covering


@pytest.mark.parametrize("layout", ["regular", "spatial", "mosaic"])
def test_multiscale_is_bit_identical_on_one_and_two_workers(
    servers: dict[int, Server], layout: str
) -> None:
    """In every mode and layout (stitched images at every size of the schedule, with a
    flip back to regular mid-epoch): the same bytes from 1 and 2 workers, each image what
    ``compose_one`` makes from sources stored at the largest size."""
    ms = MultiScale(SIZES, every=3)
    runs = []
    for workers in (1, 2):
        stitch = "spatial" if layout == "regular" else layout
        with make_client(
            servers[workers].address,
            batch_size=2,
            image_size=ms,
            seed=SEED,
            stitch_layout=stitch,
            prefetch=3,
            **KW,
        ) as c:
            if layout != "regular":
                c.set_mode("stitch")
            c.set_epoch(0)
            got = []
            for b in c:
                check_batch(b, ms.size_at(SEED, 0, b.step), ms.stored, stitch)
                got.append(snap(b))
                if layout != "regular" and b.step == 3:
                    c.set_mode("regular")
                if layout != "regular" and b.step == 6:
                    c.set_mode("stitch")
            runs.append(got)
    assert runs[0] == runs[1]
    assert sorted(delivered(runs[0])) == list(range(N))
    if layout != "regular":
        assert {b["mode"] for b in runs[0]} == {"regular", "stitch"}


def test_bad_sizes_are_refused_naming_what_is_wrong(servers: dict[int, Server]) -> None:
    with pytest.raises(ValueError, match="at least one size"):
        MultiScale([])
    with pytest.raises(ValueError, match=r"size 0 must be positive"):
        MultiScale([0])
    with pytest.raises(ValueError, match=r"size 1 must be positive"):
        MultiScale([32, (48, -1)])
    with pytest.raises(ValueError, match="every must be an int >= 1"):
        MultiScale([32], every=0)
    with pytest.raises(ValueError, match="every must be"):
        MultiScale([32], every=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="sequence of sizes"):
        MultiScale("32")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="image_size"):
        make_client(servers[2].address, image_size=(0, 32), **KW)
    with pytest.raises(ValueError, match="exceeds 16384"):
        make_client(servers[2].address, image_size=MultiScale([32, 20000]), **KW)
    # Beyond what these servers compose (--max-image-side 4096): known once they answered.
    with pytest.raises(DataServerError, match=r"at most 4096 pixels a side.*--max-image-side"):
        make_client(servers[2].address, image_size=MultiScale([32, (64, 5000)]), **KW)
    with make_client(servers[2].address, batch_size=2, image_size=(32, 32), **KW) as c:
        with pytest.raises(ValueError, match=r"set_image_size must be positive"):
            c.set_image_size((0, 5))
        with pytest.raises(ValueError, match=r"set_image_size must be an int or \(h, w\)"):
            c.set_image_size((32, 32, 3))  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"set_image_size must be positive integers"):
            c.set_image_size((32.0, 32))  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"\(5000, 5000\).*--max-image-side 4096"):
            c.set_image_size((5000, 5000))  # what these servers would refuse
        with pytest.raises(ValueError, match=r"--max-image-side 4096"):
            c.set_image_size(MultiScale([32, (64, 4097)]))
        with pytest.raises(ValueError, match="too small for a 2x2 stitch"):
            c.set_image_size((1, 64))
        assert c.image_size == (32, 32)  # nothing refused took effect
        c.set_epoch(0)
        b = next(iter(c))
        assert b.image_size == (32, 32) and b.feedback_seq == 0


# ------------------------------------------------------------------ state


def test_a_state_carries_the_size_set_and_a_resume_keeps_it(servers: dict[int, Server]) -> None:
    """``set_image_size((48, 64))`` mid-epoch, then ``state_dict()``: a client built at
    another size that loads it goes on at (48, 64) with exactly the remaining samples,
    bit-identical to the unbroken run, and keeps the size in the next epoch."""
    kw = {"batch_size": 3, "seed": 5, **KW}
    with make_client(servers[2].address, image_size=(32, 32), **kw) as c:
        c.set_epoch(0)
        it = iter(c)
        first = [snap(next(it)) for _ in range(3)]
        c.set_image_size((48, 64))
        first += [snap(next(it)) for _ in range(2)]
        state = c.state_dict()
        rest = [snap(b) for b in it]
    assert schedule_of(state["image_size"]).sizes == ((48, 64),) and state["position"] == 15
    state = msgpack.unpackb(msgpack.packb(state))
    with make_client(servers[1].address, image_size=(40, 40), **kw) as c:
        c.load_state_dict(state)
        assert c.image_size == (48, 64)
        resumed = [snap(b) for b in c]
        assert resumed == rest
        assert {b["image_size"] for b in resumed} == {(48, 64)}
        assert sorted(delivered(first) + delivered(resumed)) == list(range(N))
        assert resumed[0]["step"] == 5
        c.set_epoch(1)
        assert {b.image_size for b in c} == {(48, 64)}  # the loaded size is the client's now


def test_an_elastic_resume_keeps_the_size(servers: dict[int, Server]) -> None:
    """A world_size 1 state at (48, 64) loaded by 2 ranks: together they deliver exactly
    the undelivered samples, every batch at (48, 64)."""
    kw = {"batch_size": 3, "seed": 6, **KW}
    with make_client(servers[2].address, image_size=(32, 32), **kw) as c:
        c.set_epoch(2)
        it = iter(c)
        taken = delivered([next(it) for _ in range(2)])
        c.set_image_size((48, 64))
        taken += delivered([next(it)])
        state = c.state_dict()
    assert state["world_size"] == 1 and schedule_of(state["image_size"]).sizes == ((48, 64),)
    parts, steps = [], []
    for rank in (0, 1):
        with make_client(
            servers[2].address, image_size=(64, 64), rank=rank, world_size=2, **kw
        ) as c:
            c.load_state_dict(state)
            assert c.image_size == (48, 64)
            batches = list(c)
        assert {b.image_size for b in batches} == {(48, 64)}
        assert all(b.epoch == 2 for b in batches)
        parts.append(delivered(batches))
        steps.append([b.step for b in batches])
    assert steps[0] == steps[1]  # the ranks end the epoch on the same step
    assert sorted(taken + parts[0] + parts[1]) == list(range(N))


def test_a_multiscale_state_round_trips(servers: dict[int, Server]) -> None:
    """A MultiScale set mid-epoch is what the state holds; a client built with a fixed size
    that loads it follows the schedule from the saved step on, bit-identical to the
    unbroken run."""
    ms = MultiScale(SIZES, every=2)
    kw = {"batch_size": 2, "seed": SEED, **KW}
    with make_client(servers[2].address, image_size=(40, 40), **kw) as c:
        c.set_epoch(1)
        it = iter(c)
        head = [snap(next(it)) for _ in range(2)]
        c.set_image_size(ms)
        head += [snap(next(it)) for _ in range(5)]
        state = c.state_dict()
        rest = [snap(b) for b in it]
    saved = state["image_size"]
    assert saved["sizes"] == [[32, 32], [48, 64], [64, 48]] and saved["every"] == 2
    assert schedule_of(saved) == ms
    assert [b["image_size"] for b in head[2:]] == [ms.size_at(SEED, 1, s) for s in range(2, 7)]
    state = json.loads(json.dumps(state))
    with make_client(servers[1].address, image_size=(32, 32), **kw) as c:
        c.load_state_dict(state)
        assert c.image_size == ms
        resumed = [snap(b) for b in c]
    assert resumed == rest and resumed[0]["step"] == 7
    assert [b["image_size"] for b in resumed] == [ms.size_at(SEED, 1, b["step"]) for b in resumed]
    assert sorted(delivered(head) + delivered(resumed)) == list(range(N))


# ------------------------------------------------------------------ StepSizes

STEPS = [(32, 32), (32, 32), (48, 64), (64, 48), (64, 48), (64, 48), (32, 32), (48, 64)]


def test_step_sizes_are_the_listed_size_of_each_step_then_the_last() -> None:
    st = StepSizes(STEPS)
    assert len(st) == len(STEPS) and st.steps == tuple(STEPS)
    assert st.sizes == ((32, 32), (48, 64), (64, 48))  # distinct, first seen first
    assert st.stored == (64, 64)
    assert st.runs == (((32, 32), 2), ((48, 64), 1), ((64, 48), 3), ((32, 32), 1), ((48, 64), 1))
    for epoch in (0, 3):  # every epoch, any seed
        assert [st.size_at(SEED + epoch, epoch, k) for k in range(len(STEPS))] == STEPS
    assert [st.size_at(SEED, 0, k) for k in (8, 9, 1000, 10**9)] == [(48, 64)] * 4  # the last
    assert StepSizes([40]).size_at(0, 0, 5) == (40, 40) and StepSizes(range(8, 10)).steps == (
        (8, 8),
        (9, 9),
    )
    assert StepSizes(np.array([[16, 24], [24, 16]])).steps == ((16, 24), (24, 16))
    # Round trips: the state (through JSON and msgpack), repr, equality, stored_at.
    assert st.to_state() == {
        "steps": [[32, 32, 2], [48, 64, 1], [64, 48, 3], [32, 32, 1], [48, 64, 1]]
    }
    for state in (
        json.loads(json.dumps(st.to_state())),
        msgpack.unpackb(msgpack.packb(st.to_state())),
    ):
        loaded = schedule_of(state)
        assert isinstance(loaded, StepSizes) and loaded == st and loaded.steps == tuple(STEPS)
    assert eval(repr(st), {"StepSizes": StepSizes}) == st
    assert repr(StepSizes([32, 32, (48, 64)])) == "StepSizes([[32, 32]] * 2 + [[48, 64]])"
    assert st == StepSizes(list(STEPS)) and st != StepSizes(STEPS[:-1]) and st != MultiScale(STEPS)
    assert hash(st) == hash(StepSizes(STEPS))
    big = st.stored_at((100, 40))
    assert big.stored == (100, 64) and big.steps == st.steps and big != st
    assert big.to_state()["stored"] == [100, 64] and schedule_of(big.to_state()) == big
    assert schedule_of(st) is st


def test_bad_step_sizes_are_refused_naming_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="StepSizes: give at least one size"):
        StepSizes([])
    with pytest.raises(ValueError, match=r"StepSizes: size 0 must be positive"):
        StepSizes([0])
    with pytest.raises(ValueError, match=r"StepSizes: size 2 must be positive"):
        StepSizes([32, 32, (48, -1)])
    with pytest.raises(ValueError, match=r"StepSizes: size 1 must be an int or \(h, w\)"):
        StepSizes([32, (1, 2, 3)])
    with pytest.raises(ValueError, match="StepSizes: sizes must be a sequence"):
        StepSizes("32")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=f"StepSizes: at most {MAX_STEPS} steps"):
        StepSizes([32] * (MAX_STEPS + 1))
    assert len(StepSizes([32] * MAX_STEPS)) == MAX_STEPS
    # A loaded state: its runs checked the same way, named as the state.
    for bad, problem in (
        ({"steps": []}, "non-empty list"),
        ({"steps": [[32, 32]]}, r"run 0 must be \[h, w, count\]"),
        ({"steps": [[32, 32, 0]]}, "run 0 count must be an int >= 1"),
        ({"steps": [[32, 32, 1], [0, 32, 1]]}, "run 1 must be positive"),
        ({"steps": [[32, 32, MAX_STEPS], [32, 32, 1]]}, f"at most {MAX_STEPS} steps"),
        ({"steps": [[32, 32, 1]], "every": 2}, "MultiScale or StepSizes state"),
    ):
        with pytest.raises(ValueError, match=problem):
            schedule_of(bad, "state 'image_size'")


def test_step_sizes_batches_come_at_their_sizes_and_a_resume_continues(
    servers: dict[int, Server],
) -> None:
    """A client built with ``StepSizes``: each batch at its step's size (the last one past
    the list), bit-identical to ``compose_one`` from sources stored at the widest size, the
    same in the next epoch, no batch planned again (plan_version unmoved); a state taken
    mid-epoch, loaded by a client built at another size, goes on at the listed sizes,
    bit-identical to the unbroken run."""
    st = StepSizes(STEPS)
    kw = {"batch_size": 2, "seed": SEED, **KW}
    want = [st.size_at(SEED, 0, k) for k in range(N // 2)]
    with make_client(servers[2].address, image_size=st, prefetch=4, **kw) as c:
        assert c.image_size == st
        version = c.stats()["plan_version"]
        for epoch in (0, 1):
            c.set_epoch(epoch)
            batches = list(c)
            assert [b.image_size for b in batches] == want
            assert sorted(delivered(batches)) == list(range(N))
            for b in batches:
                check_batch(b, st.size_at(SEED, epoch, b.step), st.stored)
        # One plan a started epoch; the scheduled size changes planned nothing again.
        assert c.stats()["plan_version"] == version + 2
        c.set_epoch(2)
        it = iter(c)
        head = [snap(next(it)) for _ in range(5)]
        state = c.state_dict()
        rest = [snap(b) for b in it]
    assert state["step"] == 5 and schedule_of(state["image_size"]) == st
    assert [b["image_size"] for b in head] == STEPS[:5]
    state = json.loads(json.dumps(state))
    with make_client(servers[1].address, image_size=(40, 40), **kw) as c:
        c.load_state_dict(state)
        assert c.image_size == st
        resumed = [snap(b) for b in c]
    assert resumed == rest and resumed[0]["step"] == 5
    assert [b["image_size"] for b in resumed] == want[5:]
    assert sorted(delivered(head) + delivered(resumed)) == list(range(N))


def test_step_sizes_set_before_the_epoch_and_refused_beyond_the_servers(
    servers: dict[int, Server],
) -> None:
    """``set_image_size(StepSizes)`` before an epoch starts is the schedule of its steps
    from 0; a listed size the servers would refuse is refused at the call."""
    with make_client(servers[2].address, batch_size=4, image_size=(32, 32), **KW) as c:
        with pytest.raises(ValueError, match=r"\(64, 4097\).*--max-image-side 4096"):
            c.set_image_size(StepSizes([32, (64, 4097)]))
        with pytest.raises(ValueError, match="too small for a 2x2 stitch"):
            c.set_image_size(StepSizes([32, (1, 64)]))
        assert c.image_size == (32, 32)
        c.set_image_size(StepSizes([(48, 64), (64, 48)]))
        c.set_epoch(0)
        sizes = [b.image_size for b in c]
    assert sizes == [(48, 64)] + [(64, 48)] * (N // 4 - 1)


# ------------------------------------------------------------------ store


def test_sources_are_stored_once_at_the_schedules_largest_size(start_server: Any) -> None:
    """With ``--cache-gb 0.1`` and a MultiScale client: epoch 0 decodes each source once
    (at (64, 64), whatever the batch's size), epoch 1 decodes nothing and reuses them."""
    server = start_server(
        "--dataset",
        "ds_plugins:flat",
        "--dataset-args",
        json.dumps({"n": N}),
        "--cache-gb",
        "0.1",
        workers=2,
    )

    def counters() -> tuple[int, int]:
        got = server.stats()["counters"]
        return got.get("sources_decoded", 0), got.get("sources_reused", 0)

    ms = MultiScale(SIZES, every=1)
    with make_client(server.address, batch_size=4, image_size=ms, seed=SEED, **KW) as c:
        c.set_epoch(0)
        first = list(c)
        assert sorted(delivered(first)) == list(range(N))
        assert len({b.image_size for b in first}) > 1  # several sizes were asked for
        # (results written straight into the client's memory are counted a moment later)
        assert wait_until(lambda: counters()[0] >= N, 10), counters()
        decoded, reused = counters()
        assert decoded == N, (decoded, reused)  # each source once, for every size
        c.set_epoch(1)
        second = list(c)
        assert sorted(delivered(second)) == list(range(N))
        for b in second:
            check_batch(b, ms.size_at(SEED, 1, b.step), ms.stored)
    assert wait_until(lambda: counters()[1] >= reused + N, 10), counters()
    assert counters()[0] == decoded  # epoch 1 decoded nothing
    assert server.stats()["sources"] == "stored"
