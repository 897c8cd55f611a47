"""``len(client)``: the batches of the epoch if the mode does not change again, so progress
bars (tqdm, MMEngine's log line) stay sensible when feedback switches modes."""

from __future__ import annotations

import io
import math
from collections.abc import Iterator
from typing import Any

import pytest
from clients import make_client

from dataserver_client import DataServerClient

pytestmark = pytest.mark.timeout(120)

N = 40  # batch 4, k = 4: 10 regular batches, 3 stitched (16 + 16 + 8)


@pytest.fixture(scope="module")
def server() -> Iterator[Any]:
    from conftest import Server

    s = Server("--dataset", f"synthetic:images={N},seed=6", workers=2)
    yield s
    s.stop()


def client_of(server: Any, **kwargs: Any) -> DataServerClient:
    return make_client(server.address, batch_size=4, image_size=(64, 64), **kwargs)


def projected(taken: int, consumed: int, mode: str, drop_last: bool = False) -> int:
    per = 4 if mode == "regular" else 16
    left = N - consumed
    return taken + (left // per if drop_last else math.ceil(left / per))


@pytest.mark.parametrize("drop_last", [False, True])
def test_len_is_the_epoch_in_the_current_mode_and_follows_switches(
    server: Any, drop_last: bool
) -> None:
    with client_of(server, drop_last=drop_last) as client:
        assert len(client) == projected(0, 0, "regular", drop_last)
        client.set_mode("stitch")
        assert len(client) == projected(0, 0, "stitch", drop_last)
        client.set_mode("regular")
        modes = ["regular", "stitch", "stitch", "regular", "regular", "stitch", "regular"]
        for epoch in range(2):
            client.set_epoch(epoch)
            taken = consumed = 0
            lengths = []
            for batch in client:
                taken += 1
                consumed += batch.num_samples
                client.set_mode(modes[taken % len(modes)])
                lengths.append(len(client))
                assert lengths[-1] == projected(taken, consumed, client.mode, drop_last)
            # On the last batch it was exact; after the epoch, len() is the next epoch's.
            assert lengths[-1] == taken
            assert len(client) == projected(0, 0, client.mode, drop_last)


def test_len_after_a_loaded_state_counts_the_whole_epoch(server: Any) -> None:
    with client_of(server) as client:
        it = iter(client)
        for _ in range(3):
            next(it)
        client.set_mode("stitch")
        state = client.state_dict()
    with client_of(server) as client:
        client.load_state_dict(state)
        assert len(client) == 3 + math.ceil((N - 12) / 16)
        rest = list(client)
        assert [b.step for b in rest] == [3, 4] and {b.mode for b in rest} == {"stitch"}


def test_tqdm_over_the_client_stays_sensible_under_mode_switches(server: Any) -> None:
    tqdm = pytest.importorskip("tqdm").tqdm
    with client_of(server) as client:
        # Plain tqdm(client): its total is len() when the bar starts; stitching ends the
        # epoch early, the count never passes the total and every batch is counted.
        out = io.StringIO()
        bar = tqdm(client, file=out, mininterval=0, ascii=True)
        assert bar.total == 10
        seen: list[int] = []
        for i, batch in enumerate(bar):
            seen.extend(j for idx in batch.indices for j in idx)
            assert bar.n == i < bar.total
            if i == 1:
                client.set_mode("stitch")
        assert sorted(seen) == list(range(N))
        assert bar.n == 2 + math.ceil((N - 8) / 16) <= bar.total
        bar.close()

        # Following the switches: `bar.total = len(client)` after each decision keeps the
        # bar exact; it ends at 100% whichever way the mode went (here stitch -> regular,
        # where a fixed total would be overrun).
        client.set_epoch(1)
        client.set_mode("stitch")
        out = io.StringIO()
        bar = tqdm(client, file=out, mininterval=0, ascii=True)
        assert bar.total == 3
        for i, _ in enumerate(bar):
            client.set_mode("regular")
            bar.total = len(client)
            assert bar.n == i < bar.total
        assert bar.n == bar.total == 1 + (N - 16) // 4
        bar.close()
        last = out.getvalue().replace("\r", "\n").strip().splitlines()[-1]
        assert last.startswith("100%") and f"{bar.n}/{bar.n}" in last
