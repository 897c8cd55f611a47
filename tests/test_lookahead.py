"""Zero-stall mode flips: a client whose trainer steers the mode often prepares the next
batch in the other mode too, from the same samples, so a flip is served by a batch that was
ready before it; no source is decoded twice for it, and the batches are bit-identical to
those of a client without lookahead. A trainer that steers once or twice (close-mosaic)
composes no such twins and keeps its depth."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from clients import make_client

from dataserver_client import Batch, DataServerClient

pytestmark = pytest.mark.timeout(180)

N = 150  # not a multiple of a batch in either mode: the epoch ends with partial batches


def client_for(server: Any, lookahead: bool, **kw: Any) -> DataServerClient:
    kw.setdefault("image_size", (64, 64))
    return make_client(
        server.address,
        batch_size=4,
        stitch_k=4,
        seed=11,
        prefetch=3,
        lookahead=lookahead,
        **kw,
    )


def signature(batch: Batch) -> tuple[Any, ...]:
    return (
        batch.step,
        batch.mode,
        batch.indices,
        batch.images.numpy().tobytes(),
        [(t["boxes"].numpy().tobytes(), t["labels"].tolist()) for t in batch.targets],
    )


def run_flipping(client: DataServerClient, epoch: int, wait_ready: bool) -> list[Batch]:
    """One epoch that flips mode after every batch (with ``wait_ready``: only once the
    lookahead batch is complete, so every flip must be served by it)."""
    from conftest import wait_until

    client.set_epoch(epoch)
    batches = []
    mode = client.mode
    client.set_mode(mode)  # no change, but two steers close together: a trainer that
    client.set_mode(mode)  # steers often, so the lookahead starts
    for batch in client:
        assert batch.mode == mode, f"batch {batch.step} is stale"
        batches.append(batch)
        if wait_ready:
            nxt = batch.step + 1

            def ready(step: int = nxt) -> bool:
                la = client.stats()["lookahead"] or {}
                return bool(la.get("step") == step and la.get("ready"))

            # (the last batch has no next one: nothing to wait for)
            wait_until(ready, 30 if len(delivered(batches)) < N else 0.5)
        mode = "stitch" if mode == "regular" else "regular"
        client.set_mode(mode)
    return batches


def delivered(batches: list[Batch]) -> list[int]:
    return [i for b in batches for cell in b.indices for i in cell]


def test_a_flip_at_every_step_is_exact_and_bit_identical_to_no_lookahead(
    start_server: Any,
) -> None:
    server = start_server("--dataset", f"synthetic:images={N},seed=5", workers=2)
    runs = {}
    for lookahead in (True, False):
        with client_for(server, lookahead) as c:
            batches = run_flipping(c, epoch=1, wait_ready=False)
            stats = c.stats()
            if lookahead:  # all but the flip after the last batch (no batch to promote)
                assert stats["flips"]["promoted"] == len(batches) - 1
                assert stats["flips"]["replanned"] == 1
            else:
                assert stats["flips"]["promoted"] == 0
                assert stats["flips"]["replanned"] == len(batches)
            runs[lookahead] = batches
    with_la, without = runs[True], runs[False]
    assert [b.mode for b in with_la] == ["regular", "stitch"] * (len(with_la) // 2) + [
        "regular"
    ] * (len(with_la) % 2)
    got = delivered(with_la)
    assert len(got) == N and sorted(got) == list(range(N)), "not exactly once"
    assert [signature(b) for b in with_la] == [signature(b) for b in without]


def test_flips_are_served_by_batches_made_before_them_and_no_source_is_decoded_twice(
    start_server: Any,
) -> None:
    # A fresh server (its store counts decodes from zero), large enough for the epoch.
    server = start_server("--dataset", f"synthetic:images={N},seed=5", workers=2)
    with client_for(server, True) as c:
        batches = run_flipping(c, epoch=0, wait_ready=True)
        flips = c.stats()["flips"]
    assert flips["promoted"] == flips["promoted_ready"] == len(batches) - 1
    got = delivered(batches)
    assert sorted(got) == list(range(N))
    decoded = server.stats()["counters"]["sources_decoded"]
    # Every sample of the epoch was decoded once: the lookahead composed some of them in
    # both modes (and some batches were dropped after a flip), but read and fitted them once.
    assert decoded == N, f"{decoded} decodes for {N} samples"


def test_lookahead_follows_the_steps_without_flips_and_control_replans(start_server: Any) -> None:
    """Without flips the lookahead batch moves with the trainer (always the next step, in
    the other mode); control() still drops every planned batch, the lookahead with them."""
    from conftest import wait_until

    server = start_server("--dataset", f"synthetic:images={N},seed=5", workers=2)
    with client_for(server, True) as c:
        c.set_mode("regular")  # a trainer that steers often (though not yet flipping)
        c.set_mode("regular")
        c.set_epoch(0)
        it = iter(c)
        for step in range(3):
            batch = next(it)
            assert batch.step == step and batch.mode == "regular"
            assert wait_until(
                lambda s=step: (c.stats()["lookahead"] or {}).get("step") == s + 1, 30
            )
            assert c.stats()["lookahead"]["mode"] == "stitch"
        version = c.stats()["plan_version"]
        c.control(anything=1)
        assert c.stats()["plan_version"] == version + 1
        rest = list(it)
        assert all(b.mode == "regular" for b in rest)
        modes = Counter(b.mode for b in rest)
        assert modes["regular"] == -(-(N - 12) // 4)
    assert torch.cat([b.images for b in rest]).shape[1:] == (3, 64, 64)


def test_two_servers_flip_exactly_and_keep_each_sample_in_one_store(start_server: Any) -> None:
    """With two servers the samples a flip may stitch together are sent to one server (the
    group of k shard positions is the affinity key), so its store has them for either mode."""
    a = start_server("--dataset", f"synthetic:images={N},seed=5", workers=2)
    b = start_server("--dataset", f"synthetic:images={N},seed=5", workers=2)
    alone = start_server("--dataset", f"synthetic:images={N},seed=5", workers=2)
    with make_client(
        [a.address, b.address],
        batch_size=4,
        image_size=(64, 64),
        stitch_k=4,
        seed=11,
        prefetch=3,
    ) as c:
        two = run_flipping(c, epoch=2, wait_ready=False)
        assert c.stats()["flips"]["promoted"] == len(two) - 1
        # A task hedged to the other server (a slow answer on a loaded machine) has its
        # sources decoded there too: at most a batch of 4 images of 4 sources each.
        hedged = int(c.stats().get("hedged", 0))
    with client_for(alone, False) as c:
        one = run_flipping(c, epoch=2, wait_ready=False)
    assert sorted(delivered(two)) == list(range(N))
    assert [signature(x) for x in two] == [signature(y) for y in one]
    decoded = [s.stats()["counters"]["sources_decoded"] for s in (a, b)]
    assert min(decoded) > N // 5, decoded  # both did a real share
    # One server's worth each, give or take a group, and the hedged copies.
    assert sum(decoded) <= N + 8 + 16 * hedged, (decoded, hedged)


def composed(server: Any) -> int:
    """Images the server has composed so far (every task answered, cancelled or not)."""
    return int(server.stats()["counters"].get("images_done", 0))


def settled(server: Any) -> int:
    """``composed`` once it stops moving (a worker's DONE reaches the front after its
    result reached the client)."""
    import time

    last, same = -1, 0
    deadline = time.monotonic() + 30
    while same < 3 and time.monotonic() < deadline:
        now = composed(server)
        same = same + 1 if now == last else 0
        last = now
        time.sleep(0.1)
    return last


@pytest.mark.parametrize("close_after", [20, 8])
def test_a_one_time_set_mode_composes_no_twins_and_keeps_the_depth(
    start_server: Any, close_after: int
) -> None:
    """Mosaic from the start, close-mosaic after 20 batches (or 8: closer than two steers
    that arm, ARM_WINDOW, but the first one only picked the starting mode). No lookahead
    batch is ever planned, both steers plan again (zero stale), and from the second batch
    after the close every image composed is one delivered."""
    n = 400
    server = start_server("--dataset", f"synthetic:images={n},seed=5", workers=2)
    with make_client(
        server.address,
        batch_size=4,
        image_size=(64, 64),
        stitch_k=4,
        stitch_layout="mosaic",
        seed=3,
    ) as c:
        assert c.config.prefetch == 4
        c.set_mode("stitch")
        c.set_epoch(0)
        it = iter(c)
        batches = [next(it) for _ in range(close_after)]
        assert all(b.mode == "stitch" for b in batches)
        c.set_mode("regular")  # close-mosaic, close_after batches after the first steer
        batches += [next(it), next(it)]
        assert batches[-1].mode == batches[-2].mode == "regular"
        before = settled(server)
        later = list(it)
        after = settled(server)
        stats = c.stats()
        assert stats["lookahead"] is None
        assert stats["flips"] == {"promoted": 0, "promoted_ready": 0, "replanned": 2}
    assert all(b.mode == "regular" for b in later)
    delivered_later = sum(len(b) for b in later)
    # (the batches composed ahead at ``before`` were counted then, delivered later)
    assert after - before <= 1.02 * delivered_later, (after - before, delivered_later)
    got = delivered(batches + later)
    assert sorted(got) == list(range(n)), "not exactly once"


def test_a_trainer_that_stops_steering_goes_back_to_no_lookahead(start_server: Any) -> None:
    """Steered at every step (armed), then not at all: 64 batches later the lookahead is
    dropped and the depth is ``prefetch`` again; the epoch stays exactly once."""
    from conftest import wait_until

    server = start_server("--dataset", f"synthetic:images={N},seed=5", workers=2)
    with make_client(server.address, batch_size=2, image_size=(32, 32), stitch_k=4, seed=1) as c:
        c.set_epoch(0)
        it = iter(c)
        batches = []
        for _ in range(3):
            c.set_mode("regular")
            batches.append(next(it))
        assert wait_until(lambda: c.stats()["lookahead"] is not None, 30)
        while batches[-1].step < 3 + 64:
            batches.append(next(it))
        assert wait_until(lambda: c.stats()["lookahead"] is None, 30)
        batches += list(it)
    assert sorted(delivered(batches)) == list(range(N))


def test_a_store_smaller_than_the_dataset_decodes_no_twin_twice(start_server: Any) -> None:
    """A store that admits only a subset of the dataset (a quarter of its sources' bytes):
    the lookahead's twins still decode nothing twice (their tasks ask the store to keep what
    they decode, ``Task.recent``); without that, every source outside the admitted subset
    was decoded for the batch and again for its twin."""
    # 150 sources stored at 320x320 (300 KiB each, ~44 MiB) over the smallest store (16 MiB)
    server = start_server(
        "--dataset", f"synthetic:images={N},seed=5", "--cache-gb", str(16 / 1024), workers=2
    )
    with client_for(server, True, image_size=(320, 320)) as c:
        batches = run_flipping(c, epoch=0, wait_ready=True)
        flips = c.stats()["flips"]
    assert flips["promoted"] == flips["promoted_ready"] == len(batches) - 1
    assert sorted(delivered(batches)) == list(range(N))
    stats = server.stats()
    admitted = stats["store"]["admitted"]
    assert admitted is not None and admitted < 0.5, f"the store admits {admitted} of the set"
    decoded = stats["counters"]["sources_decoded"]
    assert decoded == N, f"{decoded} decodes for {N} samples"
