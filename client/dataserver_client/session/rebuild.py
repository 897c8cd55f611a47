"""Replayable batches: ``batch.manifest``, what names a batch completely, and the batches
being rebuilt from one (``client.rebuild``).

A batch is a pure function of its recipe: the servers' dataset, the planned indices of each
image, the epoch, step, mode, layout, image size, stored size, seed, control values,
``on_error``, padding value and letterbox (the augmentation's randomness comes from (seed,
epoch, index), a mosaic's from (seed, epoch, indices)). The manifest holds exactly that as
plain data (msgpack- and JSON-able: lists, ints, strings), so any client connected to
servers of the same dataset composes the same bytes again: the way to look at the batch
behind a loss spike. A rebuilt batch is composed with the manifest's control values (sent
with its tasks, for them alone: the session's own values are untouched) and never enters
the trainer's stream of batches.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from dataserver.protocol import MAX_IMAGE_SIDE, MAX_INT, BatchSizes, control_problem
from dataserver_client.plan.epoch import (
    FITS,
    LETTERBOXES,
    MODES,
    REGULAR,
    BatchPlan,
    ImagePlan,
    Layout,
)
from dataserver_client.plan.partners import CONSUME, PARTNER_MODES, WINDOW
from dataserver_client.plan.sizes import schedule_of
from dataserver_client.session.inflight import Delivery, InflightBatch, Sealing

if TYPE_CHECKING:
    from dataserver_client.buffers.assembly import HostBuffers
    from dataserver_client.errors import DataServerError
    from dataserver_client.session.ledger import TaskLedger

    PlanTasks = Callable[[BatchPlan, InflightBatch], object]

MANIFEST_VERSION = 1
MAX_MANIFEST_IMAGES = 1 << 16


def manifest_of(batch: InflightBatch, layout: Layout, on_error: str) -> dict[str, Any]:
    """The manifest of a planned batch (its indices as planned: a sample left out under
    ``on_error="skip"`` is left out again when it is rebuilt)."""
    plan = batch.plan
    return {
        "version": MANIFEST_VERSION,
        "epoch": plan.epoch,
        "step": plan.step,
        "mode": plan.mode,
        "stitch_layout": layout.stitch_layout,
        "stitch_k": layout.stitch_k,
        "image_size": list(plan.sizes.fit),
        "source_size": list(plan.sizes.stored),
        "indices": [list(image.indices) for image in plan.images],
        "control_seq": batch.control_seq,
        # (a copy: the batch's values are the plan book's own, which a caller's edit of
        # the manifest must not change)
        "control": copy.deepcopy(batch.control) if batch.control else {},
        "seed": plan.seed,
        "on_error": batch.on_error or on_error,
        "pad_value": plan.pad_value,
        "letterbox": plan.letterbox,
        "fit": plan.fit,
        "augment": plan.augment,
        "mosaic_partners": layout.mosaic_partners,
        "mosaic_p": layout.mosaic_p,
    }


def _partners(manifest: dict[str, Any], layout: Any, mode: Any) -> bool:
    """Whether the manifest's images are window mosaics (``mosaic_partners``, checked with
    ``mosaic_p``; absent: a manifest of a client before they existed, "consume")."""
    partners = manifest.get("mosaic_partners", CONSUME)
    if partners not in PARTNER_MODES or (partners == WINDOW and layout != "mosaic"):
        raise ValueError(
            f"manifest 'mosaic_partners' must be one of {PARTNER_MODES} ('window' with "
            f"stitch_layout 'mosaic'), got {partners!r}"
        )
    p = manifest.get("mosaic_p", 1.0)
    if isinstance(p, bool) or not isinstance(p, int | float) or not 0.0 <= p <= 1.0:
        raise ValueError(f"manifest 'mosaic_p' must be a probability in [0, 1], got {p!r}")
    return partners == WINDOW and mode != REGULAR


def _count(manifest: dict[str, Any], key: str, hi: int = MAX_INT) -> int:
    value = manifest.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= hi:
        raise ValueError(f"manifest {key!r} must be an integer in 0..{hi}, got {value!r}")
    return value


def _size(manifest: dict[str, Any], key: str) -> tuple[int, int]:
    hw = schedule_of(manifest.get(key), f"manifest {key!r}")
    if hw.to_state() != list(hw.sizes[0]) or max(hw.sizes[0]) > MAX_IMAGE_SIDE:
        raise ValueError(f"manifest {key!r} must be [h, w] of at most {MAX_IMAGE_SIDE}")
    return hw.sizes[0]


def _sizes(manifest: dict[str, Any], grid: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The manifest's image size and source size (what sources are stored at: never
    smaller), checked."""
    fit, stored = _size(manifest, "image_size"), _size(manifest, "source_size")
    if min(fit) < grid:
        raise ValueError(f"manifest 'image_size' {fit} is too small for its grid")
    if stored[0] < fit[0] or stored[1] < fit[1]:
        raise ValueError(f"manifest 'source_size' {stored} is smaller than 'image_size'")
    return fit, stored


def _images(manifest: dict[str, Any], k: int, per_image: int) -> list[tuple[int, ...]]:
    indices = manifest.get("indices")
    if not isinstance(indices, list) or not 1 <= len(indices) <= MAX_MANIFEST_IMAGES:
        raise ValueError("manifest 'indices' must be a list of images' index lists")
    out = []
    for image in indices:
        if (
            not isinstance(image, list)
            or not 1 <= len(image) <= per_image
            or not all(isinstance(i, int) and not isinstance(i, bool) for i in image)
            or min(image) < 0
        ):
            raise ValueError(
                f"manifest 'indices' must hold lists of 1..{per_image} indices (stitch_k {k})"
            )
        out.append(tuple(image))
    return out


def _padding(manifest: dict[str, Any]) -> tuple[int, str]:
    """The manifest's ``pad_value`` and ``letterbox``, checked (absent: a manifest of a
    client before they existed, which padded 0 at the top-left)."""
    pad_value = manifest.get("pad_value", 0)
    if isinstance(pad_value, bool) or not isinstance(pad_value, int) or not 0 <= pad_value <= 255:
        raise ValueError(f"manifest 'pad_value' must be an integer in 0..255, got {pad_value!r}")
    letterbox = manifest.get("letterbox", "top-left")
    if letterbox not in LETTERBOXES:
        raise ValueError(f"manifest 'letterbox' must be one of {LETTERBOXES}, got {letterbox!r}")
    return pad_value, str(letterbox)


def _fitting(manifest: dict[str, Any]) -> tuple[str, bool]:
    """The manifest's ``fit`` and ``augment``, checked (absent: a manifest of a client
    before they existed, which letterboxed and augmented)."""
    fit = manifest.get("fit", "letterbox")
    if fit not in FITS:
        raise ValueError(f"manifest 'fit' must be one of {FITS}, got {fit!r}")
    augment = manifest.get("augment", True)
    if not isinstance(augment, bool):
        raise ValueError(f"manifest 'augment' must be True or False, got {augment!r}")
    return str(fit), augment


def plan_of(manifest: Any, dataset_len: int) -> tuple[BatchPlan, dict[str, Any], str]:
    """The batch plan a manifest names, its control values and ``on_error``: every field
    checked (ValueError naming it)."""
    if not isinstance(manifest, dict) or manifest.get("version") != MANIFEST_VERSION:
        raise ValueError(f"not a batch manifest of version {MANIFEST_VERSION}")
    mode, layout, k = manifest.get("mode"), manifest.get("stitch_layout"), manifest.get("stitch_k")
    if mode not in MODES:
        raise ValueError(f"manifest 'mode' must be one of {MODES}, got {mode!r}")
    if layout not in ("spatial", "batch", "mosaic"):
        raise ValueError(f"manifest 'stitch_layout' is not a layout: {layout!r}")
    if (
        not isinstance(k, int)
        or isinstance(k, bool)
        or k not in (1, 4, 9, 16)
        or (layout == "mosaic" and k != 4)
    ):
        raise ValueError(f"manifest 'stitch_k' {k!r} does not fit stitch_layout {layout!r}")
    grid = 1 if mode == REGULAR or layout == "batch" else math.isqrt(k)
    fit, stored = _sizes(manifest, grid)
    _count(manifest, "control_seq")
    images = _images(manifest, k, grid * grid)
    if max(max(image) for image in images) >= dataset_len:
        raise ValueError(f"manifest 'indices' name samples beyond this dataset ({dataset_len})")
    control = manifest.get("control")
    problem = "not a dict" if not isinstance(control, dict) else control_problem(control)
    if problem is not None or not isinstance(control, dict):
        raise ValueError(f"manifest 'control' is not valid control values: {problem}")
    on_error = manifest.get("on_error")
    if on_error not in ("raise", "skip"):
        raise ValueError(f"manifest 'on_error' must be 'raise' or 'skip', got {on_error!r}")
    pad_value, letterbox = _padding(manifest)
    fitting, augment = _fitting(manifest)
    out = fit
    if mode != REGULAR and layout == "batch":
        side = math.isqrt(k)
        out = (fit[0] // side, fit[1] // side)
    count = sum(len(image) for image in images)
    plan = BatchPlan(
        step=_count(manifest, "step"),
        plan_version=0,
        mode=str(mode),
        start=0,
        stop=count,
        images=tuple(ImagePlan(image, grid) for image in images),
        sizes=BatchSizes.of(out, fit, stored),
        epoch=_count(manifest, "epoch"),
        seed=_count(manifest, "seed"),
        layout="mosaic" if layout == "mosaic" and mode != REGULAR else "grid",
        partners=_partners(manifest, layout, mode),
        pad_value=pad_value,
        letterbox=letterbox,
        fit=fitting,
        augment=augment,
    )
    return plan, dict(control), str(on_error)


class Rebuilds:
    """The batches being rebuilt (``client.rebuild``), each with the Future its caller waits
    on: their buffers, their tasks in the ledger, their seals. Owned by the plan book, which
    plans their tasks (``plan_tasks``) and delivers them; apart from the epoch's batches, so
    no plan of the epoch's touches them. The I/O thread is the only caller."""

    def __init__(self, buffers: HostBuffers, ledger: TaskLedger) -> None:
        self._buffers = buffers
        self._ledger = ledger
        self._futures: dict[int, tuple[InflightBatch, Future[Delivery]]] = {}
        self._sealing = Sealing(buffers)

    def __contains__(self, batch: object) -> bool:
        return id(batch) in self._futures and self._futures[id(batch)][0] is batch

    def start(
        self,
        plan: BatchPlan,
        control_seq: int,
        control: dict[str, Any],
        on_error: str,
        tasks: PlanTasks,
    ) -> Future[Delivery]:
        """Rebuild ``plan`` with the manifest's ``control`` values and ``on_error`` (its
        tasks carry them: the session's own stand); ``tasks`` plans its tasks."""
        host = self._buffers.take((len(plan.images), 3, *plan.sizes.out))
        batch = InflightBatch(plan, host, control_seq, control, inline=True, on_error=on_error)
        future: Future[Delivery] = Future()
        self._futures[id(batch)] = (batch, future)
        tasks(plan, batch)
        return future

    def replan(self, plan_version: int, control_seq: int, tasks: PlanTasks) -> None:
        """The plan moved on (a steer, a new epoch): the servers drop tasks of older plans,
        so the batches still being answered are asked again under ``plan_version``."""
        for old, future in [v for v in self._futures.values() if not v[0].complete]:
            self._drop(old)
            plan = replace(old.plan, plan_version=plan_version)
            host = self._buffers.take((len(plan.images), 3, *plan.sizes.out))
            batch = old.again(plan, host, control_seq)
            del self._futures[id(old)]
            self._futures[id(batch)] = (batch, future)
            tasks(plan, batch)

    def seal(self, batch: InflightBatch) -> bool:
        """Seal a complete batch's buffer: True to deliver it now; else it waits."""
        return self._sealing.seal(batch)

    def sealed(self) -> list[InflightBatch]:
        """The complete batches whose buffers seal now (``Sealing.sealed``)."""
        return self._sealing.sealed()

    def finished(self, batch: InflightBatch, item: Delivery | DataServerError) -> None:
        """``batch`` is delivered (or failed): its Future has it."""
        _, future = self._futures.pop(id(batch))
        if isinstance(item, Delivery):
            future.set_result(item)
        else:
            future.set_exception(item)

    def abandon(self, future: Future[Delivery]) -> None:
        """The caller stopped waiting (a timeout): drop its batch's tasks and buffer."""
        for key, (batch, each) in list(self._futures.items()):
            if each is future:
                del self._futures[key]
                self._drop(batch)
                return

    def _drop(self, batch: InflightBatch) -> None:
        """Forget ``batch``'s tasks (cancelled on the servers), its seal, its buffer."""
        self._ledger.forget(lambda rec: rec.batch is batch, cancel=True)
        self._sealing.drop(lambda each: each is batch)
        self._buffers.give(batch.host)
