"""Rect validation batches for ``DataServerTrainer``/``DataServerValidator``: what
Ultralytics' own val loader (``build_yolo_dataset(..., mode="val")``, ``rect``) makes, from
a val dataset that announces its images' sizes (``client.size_array()``) and serves them as
``load_image`` reads them: ``dataserver.data.yolo_set:yolo_set`` with ``"mode": "val"``
(aspect order, long side resized to ``imgsz``, never mirrored or enlarged).

The plan, made before the first batch is asked for: this rank's indices of the epoch
(the served order is the aspect order; ranks take their shard, as the client shards), cut
into batches, each batch's shape from its images' aspects by ``YOLODataset.set_rectangle``'s
rule (``ceil(shape * imgsz / stride + pad) * stride``, ``pad`` 0.5); the client follows it
as a ``StepSizes`` schedule (batch k at shape k, set once before the first epoch starts),
so the prefetch plans every batch at its own shape and no shape change plans a batch
again (the servers place each image unscaled, centred on 114, in that shape).
``ratio_pad`` is Ultralytics' per axis ((h / h0, w / w0), (left, top)). Torch is only used
through ``ServedLoader``."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from dataserver_client.plan.epoch import epoch_order, shard_of
from dataserver_client.plan.sizes import StepSizes

RECT_PAD = 0.5  # build_yolo_dataset's pad for mode "val"


def load_size(h0: int, w0: int, imgsz: int) -> tuple[int, int]:
    """(h, w) of an (h0, w0) image as Ultralytics' ``load_image`` resizes it (long side to
    ``imgsz``, ``math.ceil``)."""
    r = imgsz / max(h0, w0)
    if r == 1:
        return h0, w0
    return min(math.ceil(h0 * r), imgsz), min(math.ceil(w0 * r), imgsz)


def batch_shapes(
    sizes: Sequence[tuple[int, int]] | np.ndarray,
    batch: int,
    imgsz: int,
    stride: int,
    pad: float = RECT_PAD,
) -> list[tuple[int, int]]:
    """(H, W) of each batch of ``batch`` consecutive images of ``sizes`` (h, w), as
    ``YOLODataset.set_rectangle`` computes them (the same float operations, every batch at
    once: the last one's missing images are left out of its min and max)."""
    s = np.asarray(sizes, dtype=np.float64).reshape(-1, 2)
    ar = s[:, 0] / s[:, 1]
    n = -(-len(ar) // batch)
    if n == 0:
        return []
    padded = np.full(n * batch, np.nan)
    padded[: len(ar)] = ar
    grid = padded.reshape(n, batch)
    mini, maxi = np.nanmin(grid, axis=1), np.nanmax(grid, axis=1)
    shapes = np.ones((n, 2))
    tall = maxi < 1
    wide = ~tall & (mini > 1)
    shapes[tall, 0] = maxi[tall]
    shapes[wide, 1] = 1 / mini[wide]
    out = np.ceil(shapes * imgsz / stride + pad).astype(int) * stride
    return [(int(h), int(w)) for h, w in out.reshape(-1, 2)]


def rect_plan(
    sizes: Sequence[tuple[int, int]] | np.ndarray,
    *,
    seed: int,
    rank: int,
    world: int,
    batch: int,
    imgsz: int,
    stride: int,
    limit: int | None = None,
) -> list[tuple[int, int]]:
    """The shape of each of this rank's batches of the (unshuffled) epoch 0: its shard as
    the client cuts it (``shard_of``, ``drop_last=False``), its first ``limit`` samples.

    Exempt from the epoch order's "nothing grows with the dataset" (the design notes' scale
    section): a rect plan is made of every image's size, which the val dataset announces
    one by one (``client.size_array()``, sorted by aspect by ``yolo_set``), so it is O(N) by
    what it is (vectorized: 2^24 sizes in seconds). Its shard is built whole (``[:limit]``)
    for that reason."""
    table = np.asarray(sizes, dtype=np.int64).reshape(-1, 2)
    mine = shard_of(epoch_order(len(table), seed, 0, False), rank, world, False)[:limit]
    return batch_shapes(table[np.asarray(mine, dtype=np.int64)], batch, imgsz, stride)


def rect_problem(client: Any, imgsz: int) -> str | None:
    """Why ``client``'s dataset cannot be served as rect batches, or None (asks the
    servers for the sizes: ``client.size_array()``)."""
    table = getattr(client, "size_array", None)
    if table is None:
        return "this client cannot read the dataset's sizes"
    if len(table()) == 0:
        return (
            "the val dataset announces no image sizes (serve it with "
            'dataserver.data.yolo_set:yolo_set and "mode": "val" for rect batches)'
        )
    return None


def start_rect(client: Any, shapes: Sequence[tuple[int, int]], imgsz: int) -> None:
    """Batch k of every epoch at ``shapes[k]`` (a ``StepSizes``; every source stored at the
    largest height and width), set before any epoch starts: nothing is planned yet, so
    nothing is planned again, and no later batch needs a ``set_image_size``."""
    if shapes:  # (none: a rank without samples; its client keeps the square size)
        client.set_image_size(StepSizes(shapes))


def letterbox_pad(new_h: int, new_w: int, out_h: int, out_w: int, centred: bool) -> tuple[int, int]:
    """(left, top) of a letterboxed image, Ultralytics' ``LetterBox`` rounding."""
    if not centred:
        return 0, 0
    return round((out_w - new_w) / 2 - 0.1), round((out_h - new_h) / 2 - 0.1)


def rect_ratio_pad(batch: Any, out: dict[str, Any], imgsz: int) -> tuple:
    """``out``'s ``ratio_pad`` (``yolo_batch``'s of ``batch``) as Ultralytics' rect
    letterbox has it: per axis, each image ``load_image``'s size of its original one,
    centred in the batch's shape."""
    out_h, out_w = batch.images.shape[2:]
    ratio_pad = list(out["ratio_pad"])
    for i, (h0, w0) in enumerate(out["ori_shape"]):
        if getattr(batch, "orig_sizes", None) and batch.orig_sizes[i]:
            new_h, new_w = load_size(int(h0), int(w0), imgsz)
            ratio_pad[i] = (
                (new_h / h0, new_w / w0),
                letterbox_pad(new_h, new_w, out_h, out_w, True),
            )
    return tuple(ratio_pad)
