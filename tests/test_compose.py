"""Composition settings (issue 24, points 3-4) through the public API on real servers:
``pad_value`` and ``letterbox`` (every pixel no sample covers is the padding value, a
regular image sits centred as Ultralytics' ``LetterBox`` puts it, its boxes shifted with
it; mosaic gaps padded too), bit-identical to ``compose_one`` on 1 and 2 workers, landed in
shared memory or sent over the socket; carried by ``state_dict()`` and ``batch.manifest``
(``client.rebuild`` honours the manifest's); the defaults unchanged (0, top-left)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from batches import flat_servers, snap
from clients import make_client
from conftest import Server
from ds_plugins import FlatDataset, colour_of

from dataserver.data.pipeline import compose_one, flip_of
from dataserver.protocol import BatchSizes
from dataserver_client import Batch

pytestmark = pytest.mark.timeout(180)

N = 24
DATASET = FlatDataset(N)
KW: dict[str, Any] = {"timeout": 20.0}


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[int, Server]]:
    yield from flat_servers(N)


def composed(batch: Batch, pad: int, letterbox: str) -> None:
    """Each image of ``batch`` is what ``compose_one`` makes of its indices."""
    stitched = batch.mode == "stitch"
    for j, idx in enumerate(batch.indices):
        canvas, want = compose_one(
            DATASET,
            idx,
            2 if stitched else 1,
            BatchSizes.of(batch.image_size),
            batch.manifest["seed"],
            batch.epoch,
            step=batch.step,
            mode=batch.mode,
            layout="mosaic" if stitched else "grid",
            pad_value=pad,
            letterbox=letterbox,
        )
        assert np.array_equal(canvas, batch.images[j].numpy()), (batch.step, idx)
        assert np.array_equal(want.boxes, batch.targets[j]["boxes"].numpy())
        assert want.labels.tolist() == batch.targets[j]["labels"].tolist()


def test_centre_letterbox_places_as_ultralytics_rounds() -> None:
    """A 70x100 image (index 1) in 64x64: fitted to 45x64, rows 10..54 (dh 9.5: top
    round(9.4) = 9), 114 around it; the box shifted down by the same 9 rows."""
    canvas, out = compose_one(
        DATASET, [1], 1, BatchSizes.of((64, 64)), 0, 0, pad_value=114, letterbox="center"
    )
    top = round((64 - 45) / 2 - 0.1)
    assert top == 9
    assert (canvas[:, :top] == 114).all() and (canvas[:, top + 45 :] == 114).all()
    assert (canvas[:, top : top + 45].transpose(1, 2, 0) == colour_of(1)).all()
    plain, base = compose_one(DATASET, [1], 1, BatchSizes.of((64, 64)), 0, 0)
    assert (plain[:, 45:] == 0).all()  # the default: top-left on 0, as before
    assert np.allclose(out.boxes, base.boxes + np.array([0, top, 0, top], np.float32))


class Textured:
    """Random pixels of a few shapes (no boxes)."""

    SHAPES = ((50, 90, 3), (90, 50, 3), (37, 61, 3), (64, 64, 3))

    def __init__(self) -> None:
        rng = np.random.default_rng(3)
        self.images = [rng.integers(0, 256, s, dtype=np.uint8) for s in self.SHAPES]

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"image": self.images[index]}


def test_centre_letterbox_equals_ultralytics_letterbox() -> None:
    """Pixels and padding exactly as Ultralytics' ``LetterBox(center=True)`` (114)."""
    augment = pytest.importorskip("ultralytics.data.augment")
    data = Textured()
    for index, image in enumerate(data.images):
        seed = next(s for s in range(64) if not flip_of(s, 0, index))  # (not mirrored)
        for size in [(64, 64), (48, 80)]:
            canvas, _ = compose_one(
                data, [index], 1, BatchSizes.of(size), seed, 0, pad_value=114, letterbox="center"
            )
            theirs = augment.LetterBox(size, auto=False, scale_fill=False, scaleup=True)(
                image=image.copy()
            )
            assert np.array_equal(canvas.transpose(1, 2, 0), theirs), (index, size)


@pytest.mark.parametrize("shared_memory", [True, False])
def test_pad_and_letterbox_on_servers(servers: dict[int, Server], shared_memory: bool) -> None:
    """Regular batches centred on 114, then mosaics whose gaps are 114: bit-identical to
    ``compose_one`` and between 1 and 2 workers, landed or sent."""
    runs = []
    for workers in (1, 2):
        got = []
        with make_client(
            servers[workers].address,
            batch_size=3,
            image_size=(48, 64),
            seed=5,
            stitch_layout="mosaic",
            shared_memory=shared_memory,
            pad_value=114,
            letterbox="center",
            **KW,
        ) as client:
            client.set_epoch(1)
            for n, batch in enumerate(client):
                composed(batch, 114, "center")
                assert batch.manifest["pad_value"] == 114
                assert batch.manifest["letterbox"] == "center"
                got.append(snap(batch))
                if n == 1:
                    client.set_mode("stitch")
        assert any(s["mode"] == "stitch" for s in got)
        runs.append(got)
    assert runs[0] == runs[1]


def test_state_and_manifest_carry_them(servers: dict[int, Server]) -> None:
    """``state_dict()`` carries both; a state of other values is refused, naming them; a
    state saved before they existed means the defaults. ``client.rebuild`` composes a
    manifest with its own values, whatever the rebuilding client's."""
    address = servers[2].address
    with make_client(
        address, batch_size=4, image_size=(40, 40), pad_value=114, letterbox="center", **KW
    ) as client:
        it = iter(client)
        first = next(it)
        kept = (snap(first), first.manifest)
        state = client.state_dict()
        assert (state["pad_value"], state["letterbox"]) == (114, "center")
    with make_client(address, batch_size=4, image_size=(40, 40), **KW) as other:
        with pytest.raises(ValueError, match="pad_value, letterbox"):
            other.load_state_dict(state)
        old = {k: v for k, v in other.state_dict().items() if k not in ("pad_value", "letterbox")}
        other.load_state_dict(old)  # (saved before they existed: 0, top-left)
        again = other.rebuild(kept[1])
        assert snap(again) == kept[0]
        assert again.manifest == kept[1]
        plain = next(iter(other))
        assert plain.manifest["pad_value"] == 0 and plain.manifest["letterbox"] == "top-left"
        composed(plain, 0, "top-left")
        for key, bad in (("pad_value", 256), ("letterbox", "middle"), ("pad_value", True)):
            with pytest.raises(ValueError, match=key):
                other.rebuild({**kept[1], key: bad})


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"pad_value": 256}, "pad_value"),
        ({"pad_value": -1}, "pad_value"),
        ({"pad_value": 1.5}, "pad_value"),
        ({"pad_value": True}, "pad_value"),
        ({"letterbox": "centre"}, "letterbox"),
    ],
)
def test_bad_values_are_refused_at_the_call(kwargs: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        make_client("tcp://127.0.0.1:9", **kwargs, **KW)
