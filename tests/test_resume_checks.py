"""Issue 39, item 4: a resume state whose parts disagree (its rank table and its own fields,
its deal's levels and world sizes, positions beyond a rank's share) is refused at
``load_state_dict``, the error naming the field; one that loads never delivers fewer
samples than it says remain (before: a state of many ranks, all at position 0, loaded by a
one-rank job gave an empty epoch, silently)."""

from __future__ import annotations

import copy
import random
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

import pytest
from clients import make_client
from conftest import Server
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from dataserver_client.plan.epoch import shard_size
from dataserver_client.plan.resume import (
    CONFIG_KEYS,
    RANK_KEYS,
    Deal,
    check_state,
    deal_from_state,
    epoch_shard,
    plan_resume,
    version_of,
)

pytestmark = pytest.mark.timeout(180)

N_IMAGES = 96  # conftest's synthetic_server
FIELD = re.compile(r"'\w+'")  # an error names the field it refused, quoted


# ------------------------------------------------------------------ end to end


def tampered(state: dict[str, Any], case: str) -> dict[str, Any]:
    """The issue's states, made from a real one-rank state at position 0."""
    out = copy.deepcopy(state)
    entry = {k: state[k] for k in RANK_KEYS}
    if case == "100k_ranks":  # the issue's: 100,000 ranks, all at position 0
        out["world_size"] = 100_000
        out["ranks"] = [dict(entry) for _ in range(100_000)]
    elif case == "dealt_many_ranks_at_0":  # as many ranks as a state may hold, in a deal
        world = 1 << 16
        out["version"] = version_of(True, False)
        out["deal"] = {
            "plan_world_size": world,
            "count": 0,
            "levels": [{"world_size": world, "positions": [0] * world}],
        }
    elif case == "rank_table_says_done":  # its rank table disagrees with its own position
        out["ranks"] = [{**entry, "position": N_IMAGES}]
    return out


@pytest.mark.parametrize("case", ["100k_ranks", "dealt_many_ranks_at_0", "rank_table_says_done"])
def test_an_inconsistent_state_is_refused_never_an_empty_epoch(
    synthetic_server: Server, case: str
) -> None:
    with make_client(
        synthetic_server.address, batch_size=4, image_size=(32, 32), seed=1, drop_last=True
    ) as client:
        state = tampered(client.state_dict(), case)
        try:
            client.load_state_dict(state)
        except ValueError as exc:
            assert FIELD.search(str(exc)), exc  # refused, naming the field
            # ... and the client is left as it was: its epoch is the whole shard.
        delivered = [int(i) for batch in client for image in batch.indices for i in image]
        assert sorted(delivered) == list(range(N_IMAGES))


# ------------------------------------------------------------------ any state, pure


@dataclass(frozen=True)
class Cfg:
    """What ``epoch_shard`` reads of a client's configuration."""

    rank: int
    world_size: int
    seed: int = 5
    shuffle: bool = True
    drop_last: bool = False


BASE: dict[str, Any] = {
    "fingerprint": "f",
    "seed": 5,
    "shuffle": True,
    "batch_size": 2,
    "stitch_k": 4,
    "stitch_layout": "spatial",
    "pad_value": 0,
    "letterbox": "top-left",
    "fit": "letterbox",
    "augment": True,
    "mosaic_partners": "consume",
    "mosaic_p": 1.0,
    "image_size": [32, 32],
    "epoch": 3,
}


def job_state(
    n: int, drop_last: bool, world: int, positions: list[int], deal: Deal | None
) -> dict[str, Any]:
    """A job-wide state as ``state_dict`` writes it (under torch.distributed: with
    ``ranks``), rank 0's, every rank at ``positions``, its steps the batches it took."""
    ranks = [
        {
            "position": p,
            "step": -(-p // 2),
            "mode": "regular",
            "control": {},
            "control_seq": 0,
            "feedback_seq": 0,
        }
        for p in positions
    ]
    return {
        **BASE,
        "version": version_of(deal is not None, False),
        "dataset_len": n,
        "drop_last": drop_last,
        "rank": 0,
        "world_size": world,
        "deal": None if deal is None else deal.to_state(),
        **ranks[0],
        "ranks": ranks,
    }


def samples(state: dict[str, Any], rank: int, world: int, position: int, deal: Deal | None) -> Any:
    """The dataset indices rank ``rank`` of ``world`` delivers from ``position`` on."""
    cfg = Cfg(rank, world, drop_last=state["drop_last"])
    shard, _ = epoch_shard(cfg, state["dataset_len"], state["epoch"], deal)  # type: ignore[arg-type]
    return shard[position:].tolist() if position < len(shard) else []


def share_len(state: dict[str, Any], rank: int, deal: Deal | None) -> int:
    world = state["world_size"]
    if deal is None:
        return shard_size(state["dataset_len"], world, state["drop_last"])
    return deal.share_len(rank, world)


def said_to_remain(state: dict[str, Any]) -> list[int]:
    """What the state says its job had not delivered: every rank's share from its position."""
    deal = None
    if state["deal"] is not None:
        deal = deal_from_state(state["deal"], state["dataset_len"], state["drop_last"])
    out: list[int] = []
    for r, entry in enumerate(state["ranks"]):
        out += samples(state, r, state["world_size"], int(entry["position"]), deal)
    return out


def load_everywhere(state: dict[str, Any], world: int) -> list[int]:
    """What a job of ``world`` ranks delivers from ``state`` (each rank loading it as
    ``load_state_dict`` does), or the ValueError it is refused with."""
    expected = {k: state.get(k) for k in CONFIG_KEYS} | {
        "fingerprint": "f",
        "dataset_len": state.get("dataset_len"),
        "seed": 5,
        "drop_last": state.get("drop_last"),
    }
    out: list[int] = []
    for j in range(world):
        check_state(state, expected)
        where = plan_resume(state, j, world)
        out += samples(state, j, world, where["position"], where["deal"])
    return out


def fresh_start(state: dict[str, Any], world: int) -> bool:
    """A state in which nothing was delivered yet, loaded by another world size: the rule
    (``plan_resume``) starts a normal epoch of the new job, as a fresh run would (with
    ``drop_last`` it drops the new job's tail: DistributedSampler's, not the resume's)."""
    taken = state["deal"] is not None or any(e["position"] for e in state["ranks"])
    return not taken and world != state["world_size"]


def normal_epoch(state: dict[str, Any], world: int) -> list[int]:
    return [i for j in range(world) for i in samples(state, j, world, 0, None)]


@st.composite
def valid_states(draw: Any) -> tuple[dict[str, Any], int]:
    """A job-wide state as a run makes it: an epoch at random positions, resumed
    elastically 0-2 times (each on another world size, at random positions again), and the
    world size of the job that loads it."""
    n = draw(st.integers(1, 40))
    drop_last = draw(st.booleans())
    world = draw(st.integers(1, 6))
    deal: Deal | None = None
    for _ in range(draw(st.integers(0, 2))):
        state = job_state(
            n, drop_last, world, draw_positions(draw, n, drop_last, world, deal), deal
        )
        new = draw(st.sampled_from([w for w in range(1, 7) if w != world]))
        deal = plan_resume(state, 0, new)["deal"]
        world = new
    positions = draw_positions(draw, n, drop_last, world, deal)
    return job_state(n, drop_last, world, positions, deal), draw(st.integers(1, 6))


def draw_positions(draw: Any, n: int, drop_last: bool, world: int, deal: Deal | None) -> list[int]:
    shares = [
        shard_size(n, world, drop_last) if deal is None else deal.share_len(r, world)
        for r in range(world)
    ]
    return [draw(st.integers(0, s)) for s in shares]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(valid_states())
def test_a_valid_state_loads_and_delivers_exactly_what_remains(
    case: tuple[dict[str, Any], int],
) -> None:
    state, world = case
    remain = said_to_remain(state)
    delivered = load_everywhere(state, world)
    if fresh_start(state, world):
        assert Counter(delivered) == Counter(normal_epoch(state, world))
        if not state["drop_last"]:
            assert set(delivered) == set(range(state["dataset_len"])) >= set(remain)
    else:
        assert Counter(delivered) == Counter(remain)


def tamper(draw: Any, state: dict[str, Any]) -> dict[str, Any]:
    """One field of ``state`` changed: a rank's position or step, the world size, its rank,
    its own position, the rank table's length, the deal's count, world sizes or positions."""
    out = copy.deepcopy(state)
    big = st.integers(0, 200)
    choices = ["rank_position", "rank_step", "world_size", "rank", "own_position", "ranks"]
    if out["deal"] is not None:
        choices += ["deal_count", "plan_world", "level_world", "level_position"]
    what = draw(st.sampled_from(choices))
    ranks = out["ranks"]
    if what == "rank_position":
        ranks[draw(st.integers(0, len(ranks) - 1))]["position"] = draw(big)
    elif what == "rank_step":
        ranks[draw(st.integers(0, len(ranks) - 1))]["step"] = draw(big)
    elif what == "world_size":
        out["world_size"] = draw(st.integers(1, 100_000))
    elif what == "rank":
        out["rank"] = draw(st.integers(0, len(ranks) - 1))
    elif what == "own_position":
        out["position"] = draw(big)
    elif what == "ranks":
        size = draw(st.integers(1, 8))
        out["ranks"] = [dict(ranks[0], position=draw(big)) for _ in range(size)]
        out["world_size"] = draw(st.sampled_from([size, out["world_size"]]))
    elif what == "deal_count":
        out["deal"]["count"] = draw(big)
    elif what == "plan_world":
        out["deal"]["plan_world_size"] = draw(st.integers(1, 100))
    else:
        level = draw(st.sampled_from(out["deal"]["levels"]))
        if what == "level_world":
            level["world_size"] = size = draw(st.integers(1, 8))
            level["positions"] = [draw(big) for _ in range(size)]
        else:
            level["positions"][draw(st.integers(0, len(level["positions"]) - 1))] = draw(big)
    return out


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(valid_states(), st.data())
def test_a_tampered_state_is_refused_naming_a_field_or_delivers_what_it_says_remains(
    case: tuple[dict[str, Any], int], data: Any
) -> None:
    state, world = case
    bad = tamper(data.draw, state)
    try:
        delivered = load_everywhere(bad, world)
    except ValueError as exc:
        assert FIELD.search(str(exc)), exc
        event("refused")
        return
    event("loaded")
    if fresh_start(bad, world):
        assert Counter(delivered) == Counter(normal_epoch(bad, world))
        return
    remain = said_to_remain(bad)
    assert len(delivered) >= len(set(remain)) and set(delivered) >= set(remain), bad


def test_positions_past_a_share_or_a_disagreeing_rank_table_are_refused() -> None:
    """The tampering above is not vacuous: of states whose positions were pushed past the
    end, or whose rank table disagrees with their own fields, none load."""
    rnd = random.Random(1)
    for _ in range(50):
        n, world = rnd.randint(1, 40), rnd.randint(1, 5)
        share = shard_size(n, world, False)
        state = job_state(n, False, world, [rnd.randint(0, share) for _ in range(world)], None)
        past = copy.deepcopy(state)
        past["ranks"][rnd.randrange(world)]["position"] = share + 1
        with pytest.raises(ValueError, match="'position'"):
            load_everywhere(past, rnd.randint(1, 5))
        disagree = copy.deepcopy(state)
        disagree["position"] = (state["position"] + 1) % (share + 1) if share else 1
        with pytest.raises(ValueError, match="'position'"):
            load_everywhere(disagree, world)
