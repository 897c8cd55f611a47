"""Issue 28, item 4: states saved before the epoch order was computed per position (version
1: a normal epoch in the table-shuffled order; version 2: a dealt one, its deal a bitmap)
still load, and their epoch goes on exactly as the client that saved them would have gone
on: the same samples, batches, modes and steps (tests/fixtures/legacy_states.msgpack, made
by that client: tests/fixtures/make_legacy_states.py). Saved again within that epoch, they
stay of their version; the epoch after it is in the new order."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from clients import make_client
from conftest import Server

from dataserver_client import Batch, DataServerClient
from dataserver_client.plan.epoch import epoch_order, global_order, legacy_order, shard_of
from dataserver_client.plan.resume import (
    CONFIG_KEYS,
    DEALT_VERSION,
    LEGACY_DEALT_VERSION,
    LEGACY_STATE_VERSION,
    STATE_VERSION,
    BitmapDeal,
    check_state,
    config_value,
    plan_resume,
)

pytestmark = pytest.mark.timeout(180)

FIXTURE = msgpack.unpackb(
    (Path(__file__).parent / "fixtures" / "legacy_states.msgpack").read_bytes()
)
N = FIXTURE["n"]
KW: dict[str, Any] = {**FIXTURE["kw"], "image_size": (32, 32)}


@pytest.fixture(scope="module")
def flat_server() -> Iterator[Server]:
    server = Server("--dataset", "ds_plugins:flat", "--dataset-args", json.dumps({"n": N}))
    yield server
    server.stop()


def rec(b: Batch) -> dict[str, Any]:
    return {"indices": [list(map(int, i)) for i in b.indices], "mode": b.mode, "step": b.step}


def samples(batches: list[dict[str, Any]]) -> list[int]:
    return [i for b in batches for image in b["indices"] for i in image]


def test_the_legacy_order_is_the_table_shuffle_of_before() -> None:
    for n, seed, epoch in [(1, 0, 0), (151, 7, 1), (1000, 3, 9)]:
        rng = np.random.default_rng(np.random.SeedSequence([seed, epoch, 0xE90C]))
        assert legacy_order(n, seed, epoch, True).tolist() == rng.permutation(n).tolist()
    assert legacy_order(5, 1, 0, False).tolist() == [0, 1, 2, 3, 4]
    # The fixture's epoch, as its client delivered it, is that order ...
    v1 = FIXTURE["v1"]
    assert samples(v1["first"] + v1["rest"]) == legacy_order(N, 7, 1, True).tolist()
    # ... and not the new one (so the tests below tell the two apart).
    assert samples(v1["first"] + v1["rest"]) != epoch_order(N, 7, 1, True).tolist()


def test_a_version_1_state_goes_on_in_its_order_and_is_saved_as_version_1(
    flat_server: Server,
) -> None:
    v1 = FIXTURE["v1"]
    assert v1["state"]["version"] == LEGACY_STATE_VERSION
    with make_client(flat_server.address, **KW) as c:
        c.load_state_dict(v1["state"])
        assert c.state_dict()["version"] == LEGACY_STATE_VERSION  # before the iteration
        it = iter(c)
        head = [rec(next(it)) for _ in range(2)]
        again = c.state_dict()  # within the resumed epoch: its order is still the old one
        tail = [rec(b) for b in it]
        assert head + tail == v1["rest"]
        assert again["version"] == LEGACY_STATE_VERSION and again["step"] == head[-1]["step"] + 1
        # The epoch after it is in the new order.
        c.set_epoch(2)
        assert samples([rec(b) for b in c]) == epoch_order(N, 7, 2, True).tolist()
        assert c.state_dict()["version"] == STATE_VERSION
    with make_client(flat_server.address, **KW) as c:
        c.load_state_dict(again)
        assert [rec(b) for b in c] == v1["rest"][2:]


def test_version_2_states_go_on_as_dealt_exactly_and_elastically(flat_server: Server) -> None:
    v2 = FIXTURE["v2"]
    states = v2["states"]
    assert [s["version"] for s in states] == [LEGACY_DEALT_VERSION] * 3
    where = plan_resume(DataServerClient.merge_states(states), 0, 2)
    assert isinstance(where["deal"], BitmapDeal) and where["legacy"]
    # Same size (3 -> 3): rank 1 goes on exactly as the old client did.
    with make_client(flat_server.address, rank=1, world_size=3, **KW) as c:
        c.load_state_dict(states[1])
        it = iter(c)
        first = rec(next(it))
        saved = c.state_dict()
        assert [first, *map(rec, it)] == v2["rest_rank1_of_3"]
    assert saved["version"] == LEGACY_DEALT_VERSION and saved["deal"] == states[1]["deal"]
    # 3 -> 2: dealt again from the bitmap, exactly as the old client dealt it.
    job = DataServerClient.merge_states(states)
    for j in range(2):
        with make_client(flat_server.address, rank=j, world_size=2, **KW) as c:
            c.load_state_dict(job)
            assert [rec(b) for b in c] == v2["rest_of_2"][j]
    # Together the 3 -> 2 ranks finish the old job's epoch in its (legacy) order.
    delivered = samples(v2["rest_of_2"][0]) + samples(v2["rest_of_2"][1])
    whole = global_order(legacy_order(N, 7, 1, True), 2, False).tolist()
    assert len(delivered) == len(set(delivered)) and set(delivered) <= set(whole)


def test_a_state_whose_deal_does_not_match_its_version_is_refused() -> None:
    v1, v2 = FIXTURE["v1"]["state"], FIXTURE["v2"]["states"][0]
    # (a key added after the fixtures were made: what its absence means)
    expected = {**{k: config_value(v1, k) for k in CONFIG_KEYS}, "fingerprint": v1["fingerprint"]}
    expected["dataset_len"] = N
    check_state(v1, expected)
    check_state(v2, expected)
    for bad in (
        {**v1, "deal": v2["deal"]},  # a normal epoch's version with a deal
        {**v2, "deal": None},  # a dealt epoch's version without one
        {**v2, "version": STATE_VERSION},
    ):
        with pytest.raises(ValueError, match="does not match its version"):
            check_state(bad, expected)
    # A bitmap under this client's dealt version: not read as one.
    with pytest.raises(ValueError, match="levels"):
        plan_resume({**v2, "version": DEALT_VERSION}, 0, 3)


def test_a_new_state_is_not_read_in_the_legacy_order(flat_server: Server) -> None:
    """The same position, saved by this client: its epoch goes on in the new order."""
    with make_client(flat_server.address, **KW) as c:
        c.set_epoch(1)
        it = iter(c)
        head = [rec(next(it)) for _ in range(3)]
        state = c.state_dict()
    assert state["version"] == STATE_VERSION
    with make_client(flat_server.address, **KW) as c:
        c.load_state_dict(state)
        rest = [rec(b) for b in c]
    assert samples(head + rest) == shard_of(epoch_order(N, 7, 1, True), 0, 1, False).tolist()
