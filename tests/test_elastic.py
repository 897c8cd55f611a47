"""Elastic resume (docs/contract.md, issue 9 point 7): a state saved by a job of N ranks and
loaded by a job of M != N ranks: together the new ranks deliver exactly the samples the old
job had not delivered in that epoch, each once, in the saved mode; the next epoch is a
normal one of M ranks. Delivered means: ``next()`` returned its batch on its rank before
that rank's ``state_dict()``."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import zlib
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
from clients import make_client
from conftest import PLUGINS, Server, free_port, server_env

from dataserver_client import DataServerClient
from dataserver_client.plan.epoch import (
    REGULAR,
    STITCH,
    Cursor,
    Layout,
    epoch_order,
    global_order,
    shard_of,
)
from dataserver_client.plan.resume import (
    DEALT_VERSION,
    MAX_DEAL_LEVELS,
    BitmapDeal,
    Deal,
    deal_from_state,
    undelivered,
)

pytestmark = pytest.mark.timeout(240)

N = 151  # samples of the test dataset (padded to 152 for 2 and 4 ranks)
SEED = 7  # as tests/plugins/elastic_rank.py
KW: dict[str, Any] = {"batch_size": 3, "image_size": (32, 32), "seed": SEED}


# ------------------------------------------------------------------ the rule, pure


def positions_of(deal: Deal | None, total: int, world: int, rank: int) -> np.ndarray:
    return np.arange(rank, total, world) if deal is None else deal.share(rank, world)[:]


@pytest.mark.parametrize("n", [150, 151])
@pytest.mark.parametrize("old", [1, 2, 3, 4])
@pytest.mark.parametrize("new", [1, 2, 3, 5])
def test_undelivered_positions_are_dealt_round_robin_each_once(n: int, old: int, new: int) -> None:
    rnd = random.Random(n * 100 + old * 10 + new)
    per_rank = -(-n // old)
    total = per_rank * old
    # Ranks not in lockstep: each at its own position (its own delivered prefix).
    positions = [rnd.randint(0, per_rank) for _ in range(old)]
    left = undelivered(n, False, old, positions, None)
    delivered = {int(p) for r in range(old) for p in np.arange(r, total, old)[: positions[r]]}
    expected = sorted(set(range(total)) - delivered)
    assert left.positions().tolist() == expected
    shares = [left.share(j, new)[:] for j in range(new)]
    assert sorted(np.concatenate(shares).tolist()) == expected  # each once, none missing
    for j, share in enumerate(shares):
        assert share.tolist() == expected[j::new]  # rank j: the j-th, j+new-th, ...
        assert len(share) == len(expected) // new + left.spare(j, new)
    assert {len(s) for s in shares} <= {len(expected) // new, len(expected) // new + 1}


def run_synchronised(
    shards: list[np.ndarray], spares: list[int], modes: Iterator[str], drop_last: bool
) -> list[list[int]]:
    """Every rank's cursor, stepped together with the same mode each step (as
    feedback(sync=True) makes them): the samples each rank's batches held, per step."""
    lay = Layout(4, (64, 64), 4, "spatial", drop_last)
    cursors = [Cursor(s, lay, REGULAR, 1, spare=sp) for s, sp in zip(shards, spares, strict=True)]
    steps: list[list[int]] = [[] for _ in shards]
    for mode in modes:
        plans = []
        for cursor in cursors:
            cursor.mode = mode
            plans.append(cursor.next_plan())
        if all(p is None for p in plans):
            return steps
        for j, plan in enumerate(plans):
            if plan is not None:
                steps[j].append(plan.stop - plan.start)
    raise AssertionError("ran out of modes")


@pytest.mark.parametrize("drop_last", [False, True])
def test_the_spare_sample_rides_in_the_last_batch_so_ranks_end_on_one_step(drop_last: bool) -> None:
    rnd = random.Random(3)
    for trial in range(300):
        count = rnd.randint(1, 120)
        world = rnd.randint(1, 5)
        deal = undelivered(count, False, 1, [0], None)  # every position of count
        shards = [deal.share(j, world)[:] for j in range(world)]
        spares = [deal.spare(j, world) for j in range(world)]
        modes = iter([rnd.choice((REGULAR, STITCH)) for _ in range(200)])
        steps = run_synchronised(shards, spares, modes, drop_last)
        if count >= world:
            assert len({len(s) for s in steps}) == 1, (trial, count, world, steps)
        taken = [sum(s) for s in steps]
        if not drop_last:
            assert taken == [len(s) for s in shards]  # every sample, once
        else:  # the ranks without a spare drop their tail; the spare goes iff they drop none
            base = count // world
            kept = taken[-1]  # the last rank never holds a spare
            whole = kept == base > 0  # (no batch to ride in when base is 0)
            assert taken == [kept + (sp if whole else 0) for sp in spares], (trial, steps)


def test_a_dealt_epoch_saved_again_and_dealt_again_stays_exact() -> None:
    rnd = random.Random(5)
    for _ in range(50):
        n = rnd.randint(20, 200)
        worlds = [rnd.randint(1, 5) for _ in range(4)]
        per_rank = -(-n // worlds[0])
        total = per_rank * worlds[0]
        deal: Deal | None = None
        delivered: list[int] = []
        for world in worlds:
            shares = [positions_of(deal, total, world, r) for r in range(world)]
            positions = [rnd.randint(0, len(s)) for s in shares]
            for share, p in zip(shares, positions, strict=True):
                delivered += share[:p].tolist()
            deal = undelivered(n, False, world, positions, deal)
        assert deal is not None
        assert sorted(delivered + deal.positions().tolist()) == list(range(total))


def test_a_deal_is_small_plain_data_and_a_bad_one_is_refused() -> None:
    mask = np.ones(152, dtype=bool)
    mask[[0, 4, 8, 12, 1, 5, 9]] = False  # rank 0 of 4 delivered 4 samples, rank 1 three
    deal = undelivered(150, False, 4, [4, 3, 0, 0], None)
    assert deal.positions().tolist() == np.flatnonzero(mask).tolist()
    state = msgpack.unpackb(msgpack.packb(deal.to_state()))
    again = deal_from_state(state, 150, False)
    assert again.plan_world == 4 and again.positions().tolist() == np.flatnonzero(mask).tolist()
    assert len(msgpack.packb(state)) < 100
    with pytest.raises(ValueError, match="does not fit"):
        deal_from_state(state, 10, False)  # another dataset size: rank 0 has 3, not 4
    with pytest.raises(ValueError, match="count"):
        deal_from_state(state, 160, False)  # another dataset size: another count
    with pytest.raises(ValueError, match="count"):
        deal_from_state({**state, "count": 3}, 150, False)
    level = state["levels"][0]
    with pytest.raises(ValueError, match="one position per rank"):
        deal_from_state({**state, "levels": [{**level, "positions": [4, 3]}]}, 150, False)
    with pytest.raises(ValueError, match="levels"):
        deal_from_state({**state, "levels": []}, 150, False)
    with pytest.raises(ValueError, match="levels"):
        deal_from_state({**state, "levels": [level] * (MAX_DEAL_LEVELS + 1)}, 150, False)
    with pytest.raises(ValueError, match="world_size"):
        deal_from_state({**state, "levels": [{**level, "world_size": 0}]}, 150, False)
    with pytest.raises(ValueError, match="positions"):
        deal_from_state({**state, "levels": [{**level, "positions": [4, -1, 0, 0]}]}, 150, False)
    with pytest.raises(ValueError, match="malformed"):
        deal_from_state(state, 150, False, legacy=True)  # a version 2 state's deal: a bitmap


def test_a_legacy_bitmap_deal_still_loads_and_is_refused_when_bad() -> None:
    """A deal of a state of version 2 (the bitmap of the client before issue 28)."""
    mask = np.ones(152, dtype=bool)
    mask[[0, 4, 8, 12, 1, 5, 9]] = False
    state = {
        "plan_world_size": 4,
        "count": 145,
        "undelivered": zlib.compress(np.packbits(mask).tobytes(), 9),
    }
    again = deal_from_state(state, 150, False, legacy=True)
    assert isinstance(again, BitmapDeal) and again.legacy
    assert again.plan_world == 4 and np.array_equal(again.mask, mask)
    assert again.positions().tolist() == np.flatnonzero(mask).tolist()
    assert again.to_state() == state  # saved again as it was
    with pytest.raises(ValueError, match="does not fit"):
        deal_from_state(state, 160, False, legacy=True)  # another dataset size
    with pytest.raises(ValueError, match="count"):
        deal_from_state({**state, "count": 3}, 150, False, legacy=True)
    with pytest.raises(ValueError, match="corrupt"):
        deal_from_state({**state, "undelivered": b"junk"}, 150, False, legacy=True)


def test_global_order_is_the_ranks_shards_interleaved() -> None:
    for n, world, drop_last in [(150, 4, False), (150, 4, True), (7, 3, False), (9, 3, True)]:
        order = epoch_order(n, 1, 2, True)
        g = global_order(order, world, drop_last)
        for r in range(world):
            assert np.array_equal(g[r::world], shard_of(order, r, world, drop_last)[:])


# ------------------------------------------------------------------ real ranks (gloo)


@pytest.fixture(scope="module")
def flat_server() -> Iterator[Server]:
    server = Server("--dataset", "ds_plugins:flat", "--dataset-args", json.dumps({"n": N}))
    yield server
    server.stop()


def run_job(address: str, world: int, args: list[list[str]]) -> list[dict[str, Any]]:
    """``world`` gloo ranks of tests/plugins/elastic_rank.py; rank r gets ``args[r]``."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(
            server_env(),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            WORLD_SIZE=str(world),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(PLUGINS / "elastic_rank.py"), address, *args[rank]],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
        )
    outs = []
    try:
        for rank, p in enumerate(procs):
            _, stderr = p.communicate(timeout=100)
            assert p.returncode == 0, stderr[-3000:]
            outs.append(json.loads(Path(args[rank][1]).read_text()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    return outs


def flat(batches: list[dict[str, Any]]) -> list[int]:
    return [i for b in batches for image in b["indices"] for i in image]


# 2 -> 3: rank 0 a batch ahead of rank 1 when saved, and 128 samples left for 3 ranks: two
# hold a spare, and at step 7 the others' last batch is exactly full, so without the spare
# riding in the last batch they would take a batch more and the feedback all-reduce would
# hang. 4 -> 2: in lockstep.
@pytest.mark.parametrize(("old", "new", "take", "lag"), [(2, 3, 2, 1), (4, 2, 2, 0)])
def test_a_job_resumes_on_another_number_of_ranks(
    flat_server: Server, tmp_path: Path, old: int, new: int, take: int, lag: int
) -> None:
    states = [tmp_path / f"state{r}.pt" for r in range(old)]
    first = run_job(
        flat_server.address,
        old,
        [
            ["old", str(tmp_path / f"old{r}.json"), str(states[r]), str(take), str(lag)]
            for r in range(old)
        ],
    )
    saved = [torch.load(s, weights_only=False) for s in states]
    for r, state in enumerate(saved):
        assert state["rank"] == r and state["world_size"] == old
        assert [e["position"] for e in state["ranks"]] == [
            sum(len(i) for b in first[q]["batches"] for i in b["indices"]) for q in range(old)
        ]
        assert state["ranks"][0]["mode"] == first[0]["mode"]
        assert len(msgpack.packb(state)) < 4096
    assert first[0]["mode"] == STITCH  # saved right after a switch to stitch
    # New rank j loads old rank (j % old)'s file: each holds the whole job's positions.
    second = run_job(
        flat_server.address,
        new,
        [["new", str(tmp_path / f"new{j}.json"), str(states[j % old])] for j in range(new)],
    )

    g = global_order(epoch_order(N, SEED, 1, True), old, False)
    before = Counter(i for out in first for i in flat(out["batches"]))
    after = Counter(i for out in second for i in flat(out["batches"]))
    assert after == Counter(g.tolist()) - before  # exactly what was not delivered, each once
    assert before + after == Counter(g.tolist())
    assert set(after) and set(range(N)) <= set(before + after)

    lengths = {len(out["batches"]) for out in second}
    assert len(lengths) == 1  # every new rank ended the epoch on the same step
    step0 = saved[0]["ranks"][0]["step"]
    for out in second:
        batches = out["batches"]
        assert out["mode_loaded"] == STITCH
        assert [b["step"] for b in batches] == list(range(step0, step0 + len(batches)))
        # The saved mode first, then every batch in the mode decided after the one before.
        assert [b["mode"] for b in batches] == [STITCH, *[b["decision"] for b in batches[:-1]]]
        assert {b["mode"] for b in batches} == {REGULAR, STITCH}
        for b in batches:
            sizes = [len(i) for i in b["indices"]]
            if b["mode"] == STITCH:
                assert all(s == 4 for s in sizes[:-1]) and 1 <= sizes[-1] <= 4
            else:
                assert set(sizes) == {1}
        # The next epoch is a normal epoch of the new world size.
        order = epoch_order(N, SEED, 2, True)
        assert flat(out["next_epoch"]) == shard_of(order, out["rank"], new, False).tolist()
        assert [b["epoch"] for b in out["next_epoch"]] == [2] * len(out["next_epoch"])


# ------------------------------------------------------------------ without a process group


def take(
    client: DataServerClient, it: Iterator[Any], count: int, modes: dict[int, str]
) -> list[int]:
    """The samples of ``count`` batches of ``it``; after batch s, set_mode(modes[s])."""
    got = []
    for _ in range(count):
        batch = next(it)
        got += [i for image in batch.indices for i in image]
        if batch.step in modes:
            client.set_mode(modes[batch.step])
    return got


def samples(batches: Any) -> list[list[int]]:
    return [[i for image in b.indices for i in image] for b in batches]


def test_merged_states_resume_elastically_twice_and_exactly_at_one_size(
    flat_server: Server,
) -> None:
    addr = flat_server.address
    delivered: list[int] = []
    states = []
    for r, count in enumerate([3, 2]):  # not in lockstep: rank 0 is a batch ahead
        with make_client(addr, rank=r, world_size=2, **KW) as c:
            c.set_epoch(1)
            delivered += take(c, iter(c), count, {1: STITCH})
            states.append(c.state_dict())
    with (
        make_client(addr, rank=0, world_size=3, **KW) as c,
        pytest.raises(ValueError, match="merge_states"),
    ):
        c.load_state_dict(states[1])  # one rank's state cannot say what the others took
    job = DataServerClient.merge_states(states[::-1])
    assert job["rank"] == 0 and [e["position"] for e in job["ranks"]] == [3 + 3 + 12, 3 + 3]

    # 2 -> 3 ranks (a list of states is merged by load_state_dict itself).
    dealt_states = []
    for j in range(3):
        with make_client(addr, rank=j, world_size=3, **KW) as c:
            c.load_state_dict(states)
            assert c.mode == STITCH  # rank 0's mode
            delivered += take(c, iter(c), 1, {})
            dealt_states.append(c.state_dict())
    assert all(
        s["version"] == DEALT_VERSION and s["deal"]["count"] == 152 - 24 for s in dealt_states
    )

    # Same size (3 -> 3): rank 1 goes on exactly as an unbroken run of its share does.
    with make_client(addr, rank=1, world_size=3, **KW) as c:
        c.load_state_dict(states)
        unbroken = samples(c)
    with make_client(addr, rank=1, world_size=3, **KW) as c:
        c.load_state_dict(dealt_states[1])
        assert samples(c) == unbroken[1:]

    # 3 -> 2 ranks, from a state of an elastic epoch: every sample still exactly once.
    for j in range(2):
        with make_client(addr, rank=j, world_size=2, **KW) as c:
            c.load_state_dict(DataServerClient.merge_states(dealt_states))
            delivered += [i for b in samples(c) for i in b]
    g = global_order(epoch_order(N, SEED, 1, True), 2, False)
    assert Counter(delivered) == Counter(g.tolist())


def test_a_state_of_other_data_or_another_job_is_refused(
    flat_server: Server, start_server: Any
) -> None:
    with make_client(flat_server.address, rank=0, world_size=2, **KW) as c:
        c.set_epoch(1)
        next(iter(c))
        s0 = c.state_dict()
    with make_client(flat_server.address, rank=1, world_size=2, **KW) as c:
        c.set_epoch(1)
        s1 = c.state_dict()
    job = DataServerClient.merge_states([s0, s1])
    with (
        make_client(flat_server.address, rank=0, world_size=3, **{**KW, "seed": 8}) as c,
        pytest.raises(ValueError, match="seed"),
    ):
        c.load_state_dict(job)
    other = start_server("--dataset", "ds_plugins:flat", "--dataset-args", json.dumps({"n": 152}))
    with (
        make_client(other.address, rank=0, world_size=3, **KW) as c,
        pytest.raises(ValueError, match="fingerprint"),
    ):
        c.load_state_dict(job)
    with pytest.raises(ValueError, match="rank 0"):
        DataServerClient.merge_states([s0, s0])
    with pytest.raises(ValueError, match="epoch"):
        DataServerClient.merge_states([s0, {**s1, "epoch": 2}])
    with make_client(flat_server.address, rank=2, world_size=3, **KW) as c:
        with pytest.raises(ValueError, match="position"):
            c.load_state_dict(
                {**job, "ranks": [{**job["ranks"][0], "position": 999}, job["ranks"][1]]}
            )
        c.load_state_dict(job)  # the real one is fine
        with pytest.raises(ValueError, match="gather=True"):
            c.state_dict(gather=True)  # no process group to gather over
        assert c.state_dict()["deal"]["count"] == 152 - 3
