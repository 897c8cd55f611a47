"""The sample record every dataset returns, and the checks applied to a user's samples."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from dataserver.protocol.fields import MAX_LABEL
from dataserver.protocol.messages import MAX_FILE, MAX_ORIG_SIDE


class SampleError(Exception):
    """A sample could not be produced. ``file`` names the source when there is one."""

    def __init__(self, index: int, message: str, file: str | None = None) -> None:
        where = f" ({file})" if file else ""
        super().__init__(f"sample {index}{where}: {message}")
        self.index = index
        self.file = file
        self.reason = message


@dataclass(slots=True)
class Sample:
    """One source image with its objects.

    ``image`` is uint8 (H, W, 3) RGB; ``boxes`` float32 (M, 4) xyxy in image pixels;
    ``labels`` int64 (M,). Optional: ``file``, the name of the file it was read from (at
    most 1024 characters), and ``orig_size``, the (h, w) of the image as read, before any
    resize the dataset made (none: the image's own size).
    """

    image: np.ndarray
    boxes: np.ndarray
    labels: np.ndarray
    file: str | None = None
    orig_size: tuple[int, int] | None = None

    @property
    def nbytes(self) -> int:
        return int(self.image.nbytes + self.boxes.nbytes + self.labels.nbytes)


def as_sample(index: int, raw: Any, who: str = "dataset") -> Sample:
    """Turn what a dataset's ``__getitem__`` (or, ``who="augment"``, its ``augment``)
    returned into a checked ``Sample``.

    Accepts the documented dict (``image``, ``boxes``, ``labels``); raises ``SampleError``
    naming the index and what is wrong otherwise.
    """
    if isinstance(raw, Sample):
        _meta(index, raw.file, raw.orig_size, "")
        return raw
    by = "" if who == "dataset" else f"{who}: "  # (a dataset's problems read as before)
    if not isinstance(raw, dict) or "image" not in raw:
        raise SampleError(
            index, f"{who} returned {type(raw).__name__}, expected a dict with 'image'"
        )
    try:
        image = np.asarray(raw["image"])
        boxes = np.asarray(raw.get("boxes", np.zeros((0, 4))), dtype=np.float32).reshape(-1, 4)
        labels = np.asarray(raw.get("labels", np.zeros((0,))), dtype=np.int64).reshape(-1)
    except (TypeError, ValueError, OverflowError) as exc:
        raise SampleError(index, f"{who} returned unusable boxes or labels: {exc}") from None
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        raise SampleError(
            index, f"{by}image must be uint8 (H, W, 3), got {image.dtype} {tuple(image.shape)}"
        )
    if image.shape[0] < 1 or image.shape[1] < 1:
        raise SampleError(index, f"{by}image is empty: {tuple(image.shape)}")
    if len(boxes) != len(labels):
        raise SampleError(index, f"{by}{len(boxes)} boxes but {len(labels)} labels")
    if not np.isfinite(boxes).all():
        raise SampleError(index, f"{by}boxes hold NaN or infinity")
    if len(labels) and (labels >> 31).any():  # negative, or above MAX_LABEL
        raise SampleError(index, f"{by}labels must be class ids in 0..{MAX_LABEL}")
    file, orig_size = _meta(index, raw.get("file"), raw.get("orig_size"), by)
    return Sample(np.ascontiguousarray(image), boxes, labels, file, orig_size)


def _meta(index: int, file: Any, orig: Any, by: str) -> tuple[str | None, tuple[int, int] | None]:
    """A sample's ``file`` and ``orig_size``, checked (``SampleError`` naming the index)."""
    problem = _meta_problem(file, orig)
    if problem:
        raise SampleError(index, f"{by}{problem}")
    return file, None if orig is None else (int(orig[0]), int(orig[1]))


def _meta_problem(file: Any, orig: Any) -> str | None:
    """What is wrong with a sample's ``file`` and ``orig_size``, or None."""
    if file is not None and (not isinstance(file, str) or len(file) > MAX_FILE):
        return f"file must be a string of at most {MAX_FILE} characters"
    if file is not None and not file.isascii():
        try:
            file.encode()
        except UnicodeEncodeError:
            return "file must be a string that UTF-8 can encode"
    if orig is None:
        return None
    try:
        h, w = orig
    except (TypeError, ValueError):
        return f"orig_size must be (h, w), got {orig!r}"
    for side in (h, w):
        ok = isinstance(side, int | np.integer) and not isinstance(side, bool)
        if not ok or not 1 <= side <= MAX_ORIG_SIDE:
            return f"orig_size must be (h, w) of sides 1..{MAX_ORIG_SIDE}, got {orig!r}"
    return None
