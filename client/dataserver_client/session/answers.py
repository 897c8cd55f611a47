"""What a server's answer means, checked before the plan book believes it: pure functions
of the task asked and the message received, plus the answer deadlines drawn from the
latencies seen. No sockets; the engine routes each message here, then to the book."""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable

import numpy as np

from dataserver.protocol import ErrorMsg, Result
from dataserver.protocol.fields import MAX_LABEL
from dataserver_client.counts import Reject
from dataserver_client.errors import DataServerError
from dataserver_client.session.ledger import TaskRecord

BOX_TOLERANCE = 0.01  # pixels: float32 rounding of boxes a server clipped to the image


# boxes @ _MARGINS + (0, 0, 0, 0, W, H) = (x1, y1, x2 - x1, y2 - y1, W - x2, H - y2): every
# one of them >= 0 (less the tolerance) is the whole check, in one product and one minimum.
_MARGINS = np.array(
    [[1, 0, -1, 0, 0, 0], [0, 1, 0, -1, 0, 0], [0, 0, 1, 0, -1, 0], [0, 0, 0, 1, 0, -1]],
    np.float32,
)


@functools.cache
def _sides(h: int, w: int) -> np.ndarray:
    """(0, 0, 0, 0, W, H): what turns ``boxes @ _MARGINS`` into the margins."""
    sides = np.array([0, 0, 0, 0, w, h], np.float32)
    sides.setflags(write=False)  # (shared by every call: cached)
    return sides


def boxes_problem(boxes: np.ndarray, labels: np.ndarray, out_hw: tuple[int, int]) -> str | None:
    """What is wrong with a RESULT's boxes and labels for images of ``out_hw`` (H, W), or
    None: boxes must be finite xyxy with 0 <= x1 <= x2 <= W and 0 <= y1 <= y2 <= H (within
    ``BOX_TOLERANCE``), labels class ids in 0..MAX_LABEL. Vectorised: for an answer that is
    fine, one small matrix product and two reductions, whatever the number of boxes."""
    if not len(labels):
        return None
    h, w = out_hw
    with np.errstate(invalid="ignore"):  # an infinite coordinate times 0: NaN, refused
        margins = boxes @ _MARGINS
    margins += _sides(h, w)
    # NaN compares False, so a NaN anywhere fails the check as a box outside does.
    # As unsigned, a negative label is huge too: one reduction checks both ends.
    ids = labels.view(np.uint64) if labels.dtype == np.int64 else labels.astype(np.uint64)
    if margins.min() >= -BOX_TOLERANCE and ids.max() <= MAX_LABEL:
        return None
    bad = ~(margins >= -BOX_TOLERANCE).all(axis=1)
    if bad.any():
        j = int(np.flatnonzero(bad)[0])
        return f"box {boxes[j].tolist()} is not inside its {w}x{h} image"
    j = int(np.flatnonzero((labels < 0) | (labels > MAX_LABEL))[0])
    return f"label {int(labels[j])} is not a class id (0..{MAX_LABEL})"


class Deadlines:
    """How long a task may stay unanswered before it is asked again: a multiple of the
    recent answer latencies (which include queueing), never below ``floor``; before enough
    were seen, ``initial``."""

    def __init__(self, floor: float, initial: float, factor: float = 8.0) -> None:
        self.floor = floor
        self.initial = initial
        self.factor = factor
        self._seen: deque[float] = deque(maxlen=256)
        self._count = 0  # latencies observed (the deque stops growing at 256)
        self._value = initial

    def observe(self, latency: float) -> None:
        """One answer's latency; every 16th recomputes the deadline from the last 256."""
        self._seen.append(latency)
        self._count += 1
        if self._count % 16 == 0:
            ordered = sorted(self._seen)
            p90 = ordered[int(0.9 * (len(ordered) - 1))]
            self._value = max(self.floor, self.factor * p90)

    @property
    def value(self) -> float:
        return self._value


def file_of(index: int, reason: str) -> str | None:
    """The file a worker's failure reason names: it writes "sample I (FILE): why" when the
    dataset named the sample's file (``SampleError``), "sample I: why" otherwise."""
    head = f"sample {index} ("
    if not reason.startswith(head) or "): " not in reason:
        return None
    return reason[len(head) : reason.index("): ")]


def _other_images(rec: TaskRecord, msg: Result) -> bool:
    """Whether ``msg`` names other images than ``rec`` asked (less the samples it says
    failed, which must be ones asked)."""
    if not msg.failed and msg.images == rec.images:  # (the common answer: just what was asked)
        return False
    failed = {i for i, _ in msg.failed}
    wanted = [tuple(i for i in image if i not in failed) for image in rec.images]
    return list(msg.images) != wanted or not failed <= set(rec.indices)


def result_problem(
    rec: TaskRecord, msg: Result, sealed: Callable[[], bool]
) -> tuple[Reject, str] | None:
    """What is wrong with ``msg`` as the answer to ``rec``: (the ``rejected`` counter, why),
    or None. ``sealed()``: whether the seal records of a landed answer are in our buffer."""
    no_pixels = rec.land_gen is None if msg.landed else msg.pixels is None
    if no_pixels or _other_images(rec, msg):
        shown = [list(i) for i in msg.images][:4]
        how = " and no pixels" if no_pixels else ""
        return (
            Reject.WRONG_ANSWER,
            f"answered task {msg.task_id} with images {shown}{how}, not those asked",
        )
    if msg.control_digest and msg.control_digest != rec.batch.control_digest:
        # Its worker composed with other values than the task's (a relay rewrote the
        # session's CONTROL and the task's digest): other pixels, never delivered.
        return (
            Reject.WRONG_CONTROL,
            f"task {msg.task_id}: composed with control values of digest "
            f"{msg.control_digest.hex()}, not the {rec.batch.control_digest.hex()} asked",
        )
    if msg.landed and not sealed():
        # "Landed" without the seal records it must write under its lock: the buffer holds
        # whatever was there before (a stale batch), which must never be delivered.
        return Reject.LANDED_UNSEALED, f"task {msg.task_id}: said it landed, wrote no seal"
    assert msg.boxes is not None and msg.labels is not None  # (receive checked them)
    problem = boxes_problem(msg.boxes, msg.labels, rec.sizes.out) or content_problem(
        msg, rec.sizes.out
    )
    if problem is not None:
        return Reject.BAD_BOXES, f"task {msg.task_id}: {problem}"
    return None


def content_problem(msg: Result, out_hw: tuple[int, int]) -> str | None:
    """What is wrong with ``msg``'s content boxes (where each picture lies): one outside
    its canvas of ``out_hw``, or empty."""
    out_h, out_w = out_hw
    for top, left, h, w in msg.content or ():
        if not h or not w or top + h > out_h or left + w > out_w:
            return f"content box {(top, left, h, w)} is not within its {out_h}x{out_w} canvas"
    return None


def left_out(address: str, msg: Result) -> DataServerError:
    """The error of a task that said "raise" and came back with samples left out: the one a
    failed sample gives, never a silent skip."""
    index, reason = msg.failed[0]
    return DataServerError(
        f"{address}: {reason}" if reason else f"{address}: sample {index} failed",
        index,
        file_of(index, reason),
    )


def task_error(address: str, msg: ErrorMsg) -> DataServerError:
    """The trainer's error for a task's ERROR (a sample's own words stand alone)."""
    return DataServerError(
        msg.message if msg.kind in ("sample", "poison") else f"{address}: {msg.message}",
        msg.index,
        msg.file,
    )
