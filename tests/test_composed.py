"""``augment_composed`` (issue 24, point 4): a dataset's hook run by the workers on every
composed output, before it lands. A mosaic is handed over as Ultralytics' ``_mosaic4``
leaves it (2H x 2W, padded, the sources unscaled and unmirrored, border (-H // 2, -W // 2));
anything else as composed (border 0). Its draws come from (seed, epoch, anchor) with their
own tag; its answer must be the output size (else a ``SampleError`` naming the anchor);
batches are bit-identical to ``compose_one`` and on 1 and 2 workers."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from batches import snap
from clients import make_client
from compose_plugins import Composed
from conftest import Server
from ds_plugins import colour_of

from dataserver.data.composed import composed_rng
from dataserver.data.mosaic import mosaic4_canvas, mosaic_rng
from dataserver.data.pipeline import Source, augment_rng, compose_one, in_layout
from dataserver.data.sample import SampleError
from dataserver.protocol import BatchSizes
from dataserver_client import Batch, DataServerError

pytestmark = pytest.mark.timeout(180)

N = 24
KW: dict[str, Any] = {"timeout": 20.0, "stitch_layout": "mosaic"}


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[Any, Server]]:
    args = ("--dataset", "compose_plugins:composed", "--dataset-args")
    started: dict[Any, Server] = {w: Server(*args, json.dumps({"n": N}), workers=w) for w in (1, 2)}
    started["bad"] = Server(*args, json.dumps({"n": N, "bad": True}), workers=1)
    yield started
    for server in started.values():
        server.stop()


def same_as_here(batch: Batch, pad: int) -> None:
    """Each image of ``batch`` is what ``compose_one`` makes here with the hook."""
    stitched = batch.mode == "stitch"
    for j, idx in enumerate(batch.indices):
        canvas, want = compose_one(
            Composed(N),
            idx,
            2 if stitched else 1,
            BatchSizes.of(batch.image_size),
            batch.manifest["seed"],
            batch.epoch,
            step=batch.step,
            mode=batch.mode,
            layout="mosaic" if stitched else "grid",
            pad_value=pad,
            letterbox="center",
        )
        assert np.array_equal(canvas, batch.images[j].numpy()), (batch.step, idx)
        assert np.array_equal(want.boxes, batch.targets[j]["boxes"].numpy())
        assert want.labels.tolist() == batch.targets[j]["labels"].tolist()


def test_the_hook_is_told_what_it_is_given() -> None:
    data = Composed(N)
    compose_one(data, [5], 1, BatchSizes.of((48, 64)), 3, 2, step=7, letterbox="center")
    canvas, out = compose_one(
        data, [4, 9, 1, 2], 2, BatchSizes.of((48, 64)), 3, 2, mode="stitch", layout="mosaic"
    )
    regular, mosaic = data.seen
    assert regular["mosaic"] is False and regular["border"] == (0, 0)
    assert (regular["index"], regular["epoch"], regular["step"]) == (5, 2, 7)
    assert regular["image_size"] == (48, 64) and regular["mode"] == "regular"
    # index 5 is 80x100: fitted into 48x64 as 48x60, centred: 2 columns of padding left
    assert regular["content"] == (0, 2, 48, 60)
    assert mosaic["mosaic"] is True and mosaic["border"] == (-24, -32)
    assert mosaic["index"] == 4 and mosaic["mode"] == "stitch"
    assert canvas.shape == (3, 48, 64) and out.indices == [4, 9, 1, 2]
    assert ((out.boxes >= 0) & (out.boxes <= [64, 48, 64, 48])).all()


def test_its_generator_is_its_own() -> None:
    ours, theirs = composed_rng(1, 2, 3).random(4), augment_rng(1, 2, 3).random(4)
    assert not np.array_equal(ours, theirs)
    assert np.array_equal(ours, composed_rng(1, 2, 3).random(4))


def test_a_wrong_size_is_a_sample_error_naming_the_anchor() -> None:
    with pytest.raises(SampleError, match=r"sample 6: augment_composed returned a 47x64"):
        compose_one(Composed(N, bad=True), [6], 1, BatchSizes.of((48, 64)), 0, 0)
    with pytest.raises(SampleError, match=r"sample 8: augment_composed returned a 95x128"):
        compose_one(
            Composed(N, bad=True), [8, 1, 2, 3], 2, BatchSizes.of((48, 64)), 0, 0, layout="mosaic"
        )


def test_the_mosaic_canvas_is_ultralytics_mosaic4() -> None:
    """Ultralytics' own ``Mosaic`` (4 images, imgsz s) given the same centre draws and the
    same four pictures: the same 2s x 2s canvas, boxes and classes."""
    augment = pytest.importorskip("ultralytics.data.augment")
    instance = pytest.importorskip("ultralytics.utils.instance")
    s = 64
    rng = np.random.default_rng(11)
    shapes = [(64, 48), (40, 64), (64, 64), (30, 50)]
    pictures = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in shapes]
    boxes = [np.array([[2, 3, w - 5, h - 4], [0, 0, 9, 7]], np.float32) for h, w in shapes]

    def labels_of(t: int) -> dict[str, Any]:
        return {
            "img": pictures[t],
            "resized_shape": shapes[t],
            "ori_shape": shapes[t],
            "im_file": f"{t}.jpg",
            "cls": np.array([[t], [10 + t]], np.float32),
            "instances": instance.Instances(boxes[t].copy(), bbox_format="xyxy", normalized=False),
        }

    for seed in range(6):
        sources = [
            Source(np.ascontiguousarray(p.transpose(2, 0, 1)), b, np.array([t, 10 + t]))
            for t, (p, b) in enumerate(zip(pictures, boxes, strict=True))
        ]
        canvas, got_boxes, got_labels = mosaic4_canvas(
            sources, (s, s), 114, mosaic_rng(seed, 0, [])
        )
        # Sources kept HWC (a dataset with augment_composed) lay out the same canvas.
        hwc = [in_layout(src, True) for src in sources]
        assert all(src.hwc and src.image.shape[2] == 3 for src in hwc)
        canvas_hwc, boxes_hwc, _ = mosaic4_canvas(hwc, (s, s), 114, mosaic_rng(seed, 0, []))
        assert np.array_equal(canvas, canvas_hwc) and np.array_equal(got_boxes, boxes_hwc)
        draws = mosaic_rng(seed, 0, [])

        def uniform(a: float, b: float, draws: np.random.Generator = draws) -> float:
            return 0.0 if (a, b) == (0, 1) else a + (b - a) * draws.random()

        dataset = SimpleNamespace(cache=None, buffer=[1, 2, 3], get_image_and_label=labels_of)
        mosaic = augment.Mosaic(dataset, imgsz=s, p=1.0, n=4)
        patched = {
            "uniform": uniform,
            "choices": lambda seq, k: list(seq)[:k],
        }
        saved = {name: getattr(random, name) for name in patched}
        try:
            for name, fn in patched.items():
                setattr(random, name, fn)
            theirs = mosaic(labels_of(0))
        finally:
            for name, fn in saved.items():
                setattr(random, name, fn)
        assert np.array_equal(canvas, theirs["img"]), seed
        theirs["instances"].convert_bbox("xyxy")
        assert np.allclose(got_boxes, theirs["instances"].bboxes), seed
        assert got_labels.tolist() == theirs["cls"].reshape(-1).astype(int).tolist()


def test_hook_on_servers_is_bit_identical(servers: dict[Any, Server]) -> None:
    """Regular batches, then mosaics, through the hook on 1 and 2 workers: the same bytes,
    and those ``compose_one`` makes here; a mosaic's pixels come only from its sources or
    the padding (no pixel pulled in that was never composed)."""
    runs = []
    for workers in (1, 2):
        got = []
        with make_client(
            servers[workers].address,
            batch_size=3,
            image_size=(48, 64),
            seed=9,
            pad_value=114,
            letterbox="center",
            **KW,
        ) as client:
            client.set_epoch(1)
            for n, batch in enumerate(client):
                same_as_here(batch, 114)
                if batch.mode == "stitch":
                    for image, idx in zip(batch.images, batch.indices, strict=True):
                        seen = set(map(tuple, image.numpy().reshape(3, -1).T.tolist()))
                        assert seen <= {(114, 114, 114), *(colour_of(i) for i in idx)}
                got.append(snap(batch))
                if n == 1:
                    client.set_mode("stitch")
        assert any(s["mode"] == "stitch" for s in got)
        runs.append(got)
    assert runs[0] == runs[1]


def test_a_bad_hook_fails_the_batch_naming_the_anchor(servers: dict[Any, Server]) -> None:
    bad = servers["bad"].address
    with (
        make_client(bad, batch_size=2, image_size=(32, 32), **KW) as c,
        pytest.raises(DataServerError, match=r"sample \d+: augment_composed returned"),
    ):
        next(iter(c))
    with make_client(
        servers["bad"].address, batch_size=2, image_size=(32, 32), on_error="skip", **KW
    ) as c:
        batch = next(iter(c))
        assert len(batch) == 0 and batch.skipped == 2
