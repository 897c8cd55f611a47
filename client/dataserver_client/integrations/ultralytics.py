"""Ultralytics YOLO training from dataserver: ``DataServerTrainer``, a ``DetectionTrainer``
whose batches come from two ``dataserver serve`` pools (train and val), as Ultralytics
users start training::

    from ultralytics import YOLO
    from dataserver_client.integrations.ultralytics import DataServerTrainer

    DATA = {"train": "tcp://data-0:5555", "val": "tcp://data-val:5555"}  # or a YAML path
    YOLO("yolov8n.yaml").train(trainer=DataServerTrainer, data=DATA, epochs=100, imgsz=640)

``DATA`` (a dict, or the path of a YAML file holding one): ``train`` and ``val`` (and
``test`` for ``split="test"``): any address ``DataServerClient`` takes (``tcp://``, a DNS
name's ``tcp://NAME:PORT``, ``ray://NAME``, or a list of them); optional ``names`` (a list,
or Ultralytics' ``{index: name}``); optional ``label_offset``.

Classes. Labels on the wire stay as the dataset makes them (COCO's ids, the synthetic set's
1..80); the trainer maps them to Ultralytics' 0..nc-1. A dataset that announces its
categories (``client.categories``, (label, name) pairs) gives the classes: its labels,
sorted, are classes 0..nc-1, named by the categories (or by ``names``, which must then
have as many entries). A dataset that announces none needs ``names``: its labels are then
``label_offset .. label_offset + nc - 1`` (default ``label_offset=1``, torchvision's
convention with 0 the background, which the built-in ``synthetic`` set follows; give
``label_offset: 0`` for labels that are already 0..nc-1). A label outside that set stops
training with an error naming it (never an ``IndexError`` deep in the loss).

Batches are what Ultralytics' ``YOLODataset.collate_fn`` makes: ``img`` uint8 (B, 3, H, W)
on the CPU (``preprocess_batch`` moves it), ``cls`` float32 (N, 1), ``bboxes`` float32 (N, 4)
normalised xywh, ``batch_idx`` float32 (N,), ``im_file``, ``ori_shape``, ``resized_shape``,
``ratio_pad`` (from ``batch.files``/``batch.orig_sizes`` where the client has them and the
dataset gives ``file``/``orig_size``; placeholders otherwise). The servers' dataset
augments (``dataserver.data.yolo.YoloAugment`` as its ``augment_composed``); the trainer
sends it Ultralytics' hyperparameters with ``client.control`` (``params["control"]``).

What is honoured and what warns: see ``DataServerTrainer``.

Over the house's ~500 lines (about 800): the one Ultralytics integration (trainer,
validator, loader, label mapping), whose classes subclass Ultralytics' together and follow
its versions together.
"""

from __future__ import annotations

import inspect
import io
import os
from collections.abc import Iterator, Mapping, Sequence
from copy import copy
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import yaml
from ultralytics.cfg import DEFAULT_CFG_DICT
from ultralytics.data.utils import check_class_names, get_split_fraction
from ultralytics.engine import validator as validator_module
from ultralytics.models.yolo.detect import DetectionTrainer, DetectionValidator
from ultralytics.utils import DEFAULT_CFG, LOGGER, RANK

from dataserver_client.batch import Batch
from dataserver_client.client import DataServerClient
from dataserver_client.integrations.ultralytics_val import (
    letterbox_pad,
    rect_plan,
    rect_problem,
    rect_ratio_pad,
    start_rect,
)
from dataserver_client.plan.resume import RANK_KEYS
from dataserver_client.plan.sizes import MultiScale

CHECKPOINT_KEY = "dataserver"
LOADER_STATE_VERSION = 1
PAD_VALUE = 114  # Ultralytics' letterbox and mosaic fill
# The servers' dataset reads the hyperparameters from params["control"]["yolo"]
# (dataserver.data.yolo_set's CONTROL_KEY), by dataserver.data.yolo's names.
CONTROL_KEY = "yolo"
HYPERPARAMETERS = (
    "degrees",
    "translate",
    "scale",
    "shear",
    "perspective",
    "hsv_h",
    "hsv_s",
    "hsv_v",
    "fliplr",
    "flipud",
)
# Data arguments the service does not do, each warned about by name when set.
UNSERVED = {
    "mixup": "MixUp (a second composed image blended in) is not planned by the service",
    "cutmix": "CutMix (a second composed image pasted in) is not planned by the service",
    "copy_paste": "copy-paste needs segments, which the service does not carry",
    "bgr": "the RGB/BGR swap is not done by the service",
    "rect": "rectangular (aspect-grouped) training batches are not served; batches are square",
    "cache": "the servers' store keeps decoded sources (dataserver serve --cache-gb)",
    "augmentations": "custom Albumentations run in the servers' dataset (its augment)",
}


# ------------------------------------------------------------------ data and classes


def read_data(data: Any) -> dict[str, Any]:
    """``DATA`` as a dict: a mapping as it is, or a YAML file's mapping."""
    if isinstance(data, Mapping):
        return dict(data)
    if isinstance(data, str | Path) and Path(data).is_file():
        with open(data, encoding="utf-8") as f:
            loaded = yaml.safe_load(f)
        if isinstance(loaded, Mapping):
            return dict(loaded)
    raise ValueError(
        f"DataServerTrainer: data must be a dict (or a YAML file of one) with 'train' and "
        f"'val' server addresses, got {data!r}"
    )


def _probe(address: Any) -> tuple[int, list[tuple[int, str]] | None]:
    """(dataset length, announced categories or None) of the servers at ``address``."""
    with DataServerClient(
        address, batch_size=1, image_size=(32, 32), shuffle=False, rank=0, world_size=1,
        device="cpu",
    ) as probe:  # fmt: skip
        categories = getattr(probe, "categories", None)  # (clients that predate categories)
        pairs = [(int(label), str(name)) for label, name in categories or ()]
        return probe.dataset_len, pairs or None


def served_data(data: Any, split: str = "val", single_cls: bool = False) -> dict[str, Any]:
    """What ``trainer.data`` holds for ``DATA``: the addresses, ``names`` ({i: name}),
    ``nc``, ``channels`` and ``wire_labels`` (the label on the wire of class i), from the
    datasets' categories or ``DATA``'s ``names`` (module docstring). ``single_cls``: one
    class, "item", as Ultralytics' own ``get_dataset``. Raises ``ValueError`` naming what is
    missing or does not match."""
    raw = read_data(data)
    for key in dict.fromkeys(("train", "val", split)):
        if not raw.get(key):
            raise ValueError(f"DataServerTrainer: data has no {key!r} server address")
    sizes: dict[str, int] = {}
    found: dict[str, list[tuple[int, str]] | None] = {}
    for key in dict.fromkeys(("train", split)):
        sizes[key], found[key] = _probe(raw[key])
    categories = found["train"]
    if categories is not None and found[split] not in (None, categories):
        raise ValueError(
            f"DataServerTrainer: the {split!r} dataset announces other categories than the "
            "'train' dataset"
        )
    given = raw.get("names")
    names: dict[int, str] | None = None if given is None else check_class_names(given)
    if categories is not None:
        categories = sorted(categories)
        wire = [label for label, _ in categories]
        if names is not None and len(names) != len(wire):
            raise ValueError(
                f"DataServerTrainer: data 'names' has {len(names)} classes, the dataset "
                f"announces {len(wire)} categories"
            )
        if names is None:
            names = {i: name for i, (_, name) in enumerate(categories)}
    elif names is None:
        raise ValueError(
            "DataServerTrainer: the dataset announces no categories: give data 'names' "
            "(the class names, in label order)"
        )
    else:
        offset = int(raw.get("label_offset", 1))
        wire = list(range(offset, offset + len(names)))
    out = {
        **raw,
        "names": names,
        "nc": len(names),
        "channels": 3,
        "wire_labels": wire,
        "served_len": sizes,
    }
    if single_cls:
        out.update(names={0: "item"}, nc=1)
    return out


class LabelMap:
    """Labels on the wire to Ultralytics' classes: the label ``wire[i]`` is class i; then
    ``classes`` (keep only those) and ``single_cls`` (every class 0), as YOLODataset's
    ``update_labels``. An unknown label raises ``ValueError`` naming it."""

    def __init__(
        self, wire: Sequence[int], classes: Any = None, single_cls: bool = False, what: str = ""
    ) -> None:
        self._wire = torch.tensor(sorted(int(w) for w in wire), dtype=torch.int64)
        keep = None if classes is None else [classes] if isinstance(classes, int) else classes
        self._keep = None if keep is None else torch.tensor([int(c) for c in keep])
        self._single = bool(single_cls)
        self._what = what

    def __call__(self, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(class of each label kept, the mask of labels kept)."""
        labels = labels.to(torch.int64)
        at = torch.searchsorted(self._wire, labels).clamp(max=len(self._wire) - 1)
        known = self._wire[at] == labels
        if not bool(known.all()):
            bad = sorted({int(v) for v in labels[~known].tolist()})[:8]
            first, last = int(self._wire[0]), int(self._wire[-1])
            raise ValueError(
                f"DataServerTrainer: the {self._what} dataset sent labels {bad}, not among "
                f"its {len(self._wire)} classes' labels ({first}..{last}; see label_offset "
                "or the dataset's categories)"
            )
        keep = torch.ones_like(known) if self._keep is None else torch.isin(at, self._keep)
        classes = at[keep]
        return (torch.zeros_like(classes) if self._single else classes), keep


# ------------------------------------------------------------------ batches


def _fit(h0: int, w0: int, out_h: int, out_w: int) -> tuple[float, int, int]:
    """(gain, new h, new w) of an (h0, w0) image fitted into (out_h, out_w), the servers'
    rounding (``dataserver.data.transforms.fit_size``)."""
    gain = min(out_h / h0, out_w / w0)
    return gain, min(out_h, max(1, round(h0 * gain))), min(out_w, max(1, round(w0 * gain)))


def yolo_batch(batch: Batch, labels: LabelMap, *, val: bool, centred: bool, role: str) -> dict:
    """``batch`` as Ultralytics' ``collate_fn`` makes a batch (keys in its sorted order).

    ``ratio_pad``: for validation ((gain, gain), (left, top)) of each image's letterbox (what
    ``scale_boxes`` undoes); for training (gain, gain), as Ultralytics' training batches
    carry it. Without the image's original size (no ``batch.orig_sizes``, or no
    ``orig_size`` from the dataset) ``ori_shape`` is the batch's size and the ratio 1."""
    images = batch.images
    count, _, out_h, out_w = images.shape
    per = [len(t["labels"]) for t in batch.targets]
    if sum(per):
        wire = torch.cat([t["labels"] for t in batch.targets]).cpu()
        xyxy = torch.cat([t["boxes"] for t in batch.targets]).cpu().to(torch.float32)
    else:
        wire, xyxy = torch.zeros(0, dtype=torch.int64), torch.zeros((0, 4))
    owner = torch.repeat_interleave(torch.arange(count), torch.tensor(per, dtype=torch.int64))
    classes, keep = labels(wire)
    xyxy, owner = xyxy[keep], owner[keep]
    scale = torch.tensor([out_w, out_h, out_w, out_h], dtype=torch.float32)
    xywh = torch.cat([(xyxy[:, :2] + xyxy[:, 2:]) / 2, xyxy[:, 2:] - xyxy[:, :2]], 1) / scale
    files = getattr(batch, "files", None) or [None] * count
    sizes = getattr(batch, "orig_sizes", None) or [None] * count
    im_file, ori_shape, ratio_pad = [], [], []
    for i in range(count):
        anchor = batch.indices[i][0] if batch.indices[i] else -1
        im_file.append(str(files[i]) if files[i] else f"dataserver/{role}/{anchor}")
        hw = sizes[i]
        if not hw:
            ori_shape.append((out_h, out_w))
            ratio_pad.append(((1.0, 1.0), (0, 0)) if val else (1.0, 1.0))
            continue
        h0, w0 = int(hw[0]), int(hw[1])
        gain, new_h, new_w = _fit(h0, w0, out_h, out_w)
        ori_shape.append((h0, w0))
        if val:
            ratio_pad.append(((gain, gain), letterbox_pad(new_h, new_w, out_h, out_w, centred)))
        else:
            ratio_pad.append((gain, gain))
    return {
        "batch_idx": owner.to(torch.float32),
        "bboxes": xywh,
        "cls": classes.to(torch.float32).view(-1, 1),
        "im_file": tuple(im_file),
        "img": images,
        "ori_shape": tuple(ori_shape),
        "ratio_pad": tuple(ratio_pad),
        "resized_shape": tuple((out_h, out_w) for _ in range(count)),
    }


# ------------------------------------------------------------------ the loader


class ServedDataset:
    """What ``loader.dataset`` is to Ultralytics: its length (the served dataset, or the
    ``fraction`` of it), ``labels`` (empty: the labels live on the servers; the trainer
    warns where Ultralytics would read them) and ``close_mosaic(hyp)``."""

    def __init__(self, loader: ServedLoader, size: int) -> None:
        self._loader = loader
        self._size = size
        self.labels: list[dict[str, Any]] = []

    def __len__(self) -> int:
        return self._size

    def close_mosaic(self, hyp: Any = None) -> None:
        """Regular batches from the next one on (``client.set_mode("regular")``)."""
        self._loader.set_mode("regular")

    def __getitem__(self, index: int) -> Any:
        raise TypeError("a served dataset's samples are built on the servers: iterate the loader")


class EpochSampler:
    """``loader.sampler``: ``len`` is this rank's samples an epoch; ``set_epoch`` the epoch
    the next iteration serves."""

    def __init__(self, loader: ServedLoader) -> None:
        self._loader = loader

    def __len__(self) -> int:
        return self._loader.rank_samples()

    def set_epoch(self, epoch: int) -> None:
        self._loader.set_epoch(epoch)


class ServedLoader:
    """A ``DataServerClient`` with the surface Ultralytics' trainer and validator touch:
    iteration (one epoch of batches in Ultralytics' format), ``len`` (the epoch's batches
    in the mode the next batch has; with ``fraction``, its share), ``dataset``, ``sampler``,
    ``batch_size``, ``drop_last``, ``num_workers`` (0: no worker process on the trainer),
    ``reset()``, ``close()`` (closes the client) and ``state_dict``/``load_state_dict``.

    Each iteration serves one epoch (``sampler.set_epoch``'s; a training loader moves on to
    the next epoch by itself once one ends; a validation loader serves epoch 0 every time,
    so each validation sees the same batches). ``last_batch`` is the client's last
    ``Batch`` (its mode, indices, size). ``rect``: (the shape of each batch, imgsz) of rect
    validation batches (``ultralytics_val``)."""

    def __init__(
        self,
        client: DataServerClient,
        labels: LabelMap,
        *,
        val: bool,
        centred: bool,
        role: str,
        limit: int | None = None,
        rect: tuple[list[tuple[int, int]], int] | None = None,
    ) -> None:
        self.client = client
        self.rect = rect
        self.batch_size = client.config.batch_size
        self.drop_last = client.config.drop_last
        self.num_workers = 0
        self.last_batch: Batch | None = None
        self._labels = labels
        self._val = val
        self._centred = centred
        self._role = role
        world = client.config.world_size
        total = client.dataset_len if limit is None else min(limit, client.dataset_len)
        self._limit = None if limit is None else -(-total // world)
        self.dataset = ServedDataset(self, total)
        self.sampler = EpochSampler(self)
        self._epoch = 0

    def rank_samples(self) -> int:
        """Samples (anchors) this rank takes an epoch."""
        n = self.client.num_samples
        return n if self._limit is None else min(n, self._limit)

    def set_epoch(self, epoch: int) -> None:
        if not self._val:
            self._epoch = int(epoch)

    def set_mode(self, mode: str) -> None:
        """``client.set_mode(mode)`` when it is not the mode already (a steer costs)."""
        if self.client.mode != mode:
            self.client.set_mode(mode)

    def __len__(self) -> int:
        batches = len(self.client)
        if self._limit is None:
            return batches
        per = max(1, -(-self.client.num_samples // max(batches, 1)))  # samples a batch
        return min(batches, -(-self._limit // per))

    def __iter__(self) -> Iterator[dict[str, Any]]:
        # A generator: Ultralytics calls iter() once more than it iterates each epoch.
        return self._epoch_batches()

    def _epoch_batches(self) -> Iterator[dict[str, Any]]:
        if self.rect is not None:
            yield from self._rect_batches(self.rect[1])
            return
        epoch = self._epoch
        self.client.set_epoch(epoch)
        taken = 0
        for batch in self.client:
            self.last_batch = batch
            yield yolo_batch(
                batch, self._labels, val=self._val, centred=self._centred, role=self._role
            )
            taken += batch.num_samples
            if self._limit is not None and taken >= self._limit:
                break
        if not self._val:
            self._epoch = epoch + 1
            self.client.set_epoch(epoch + 1)

    def _rect_batches(self, imgsz: int) -> Iterator[dict[str, Any]]:
        """One epoch of rect validation batches: batch k at the plan's k-th shape (the
        client's ``StepSizes`` schedule, ``ultralytics_val.start_rect``), ``ratio_pad`` as
        Ultralytics' rect letterbox has it."""
        self.client.set_epoch(0)
        taken = 0
        for batch in self.client:
            self.last_batch = batch
            out = yolo_batch(batch, self._labels, val=True, centred=True, role=self._role)
            out["ratio_pad"] = rect_ratio_pad(batch, out, imgsz)
            yield out
            taken += batch.num_samples
            if self._limit is not None and taken >= self._limit:
                return

    def reset(self) -> None:
        """Nothing to restart: a mode change reaches the very next batch."""

    def close(self) -> None:
        self.client.close()

    def state_dict(self) -> dict[str, Any]:
        """The epoch the next iteration serves and the client's state (rank 0's, for every
        rank: Ultralytics saves on rank 0 only, and its ranks step in lockstep)."""
        state = self.client.state_dict(gather=False)
        world = self.client.config.world_size
        if world > 1:
            state["ranks"] = [{k: state[k] for k in RANK_KEYS} for _ in range(world)]
        return {"version": LOADER_STATE_VERSION, "epoch": self._epoch, "client": state}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Serve ``state``'s epoch next, with the client's mode and control values when the
        client can take its state (same dataset and configuration); a warning otherwise."""
        if not isinstance(state, Mapping) or state.get("version") != LOADER_STATE_VERSION:
            raise ValueError(
                f"not a DataServerTrainer loader state of version {LOADER_STATE_VERSION}"
            )
        self._epoch = int(state["epoch"])
        client_state = state.get("client")
        if isinstance(client_state, dict) and client_state.get("epoch") == self._epoch:
            try:
                self.client.load_state_dict(client_state)
            except ValueError as exc:
                LOGGER.warning(f"dataserver: resuming at epoch {self._epoch} afresh ({exc})")


def client_parameters() -> set[str]:
    """The keyword arguments this ``DataServerClient`` takes (features land over time)."""
    return set(inspect.signature(DataServerClient.__init__).parameters)


def rank_world(rank: int) -> tuple[int, int]:
    """(rank, world size) of a loader Ultralytics builds for ``rank`` (its LOCAL_RANK; -1:
    one process, or a loader of its own such as the QAT calibration one)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if rank == -1 or world <= 1 or RANK < 0:
        return 0, 1
    return RANK, world


def val_loader(
    address: Any,
    data: Mapping[str, Any],
    args: Any,
    batch_size: int,
    rank: int,
    warn: Any = LOGGER.warning,
    stride: int = 32,
    rect: bool = True,
) -> ServedLoader:
    """The validation loader: a ``DataServerClient`` on ``address`` in epoch order
    (``shuffle=False``, ``augment=False``: never mirrored nor augmented), regular images
    letterboxed centred on 114 where the client can,
    sharded across the ranks. ``rect`` (Ultralytics' val loader's): batches grouped by
    aspect, each its own shape (``ultralytics_val``), where the val dataset announces its
    sizes (``yolo_set`` in mode "val"); else, or without ``rect``, square ``imgsz`` (a
    warning says why, when ``rect`` was asked for)."""
    accepted = client_parameters()
    r, world = rank_world(rank)
    extra: dict[str, Any] = {}
    if "letterbox" in accepted:
        extra.update(letterbox="center", pad_value=PAD_VALUE)
    else:
        warn("dataserver: this client has no letterbox/pad_value: val images sit top-left on 0")
    if "augment" in accepted:  # (no built-in flip: only yolo_set's val mode was never mirrored)
        extra["augment"] = False
    else:
        warn("dataserver: this client has no augment switch: val images may be mirrored")
    imgsz = int(args.imgsz)
    client = DataServerClient(
        address, batch_size=int(batch_size), image_size=(imgsz, imgsz), shuffle=False,
        seed=int(args.seed), rank=r, world_size=world, device="cpu", drop_last=False, **extra,
    )  # fmt: skip
    split = args.split or "val"
    fraction = get_split_fraction(args.fraction, split)
    labels = LabelMap(data["wire_labels"], args.classes, bool(args.single_cls), split)
    limit = _count(client.dataset_len, fraction)
    plan = None
    problem = rect_problem(client, imgsz) if rect and "letterbox" in extra else None
    if rect and problem is None and "letterbox" in extra:
        client.control(**{CONTROL_KEY: {"imgsz": imgsz}})  # (the val set checks it is its own)
        shapes = rect_plan(
            client.size_array(), seed=int(args.seed), rank=r, world=world, batch=int(batch_size),
            imgsz=imgsz, stride=int(stride), limit=None if limit is None else -(-limit // world),
        )  # fmt: skip
        start_rect(client, shapes, imgsz)
        plan = (shapes, imgsz)
    elif rect:
        warn(
            "dataserver: validation batches are square imgsz letterboxes (Ultralytics' own val "
            f"loader groups images by aspect, rect): {problem or 'no letterbox'}; metrics can "
            "differ slightly"
        )
    return ServedLoader(
        client, labels, val=True, centred="letterbox" in extra, role=split, limit=limit,
        rect=plan,
    )  # fmt: skip


def _count(n: int, fraction: float | int) -> int | None:
    """Samples ``fraction`` keeps of ``n`` (Ultralytics: a ratio, or a count above 1)."""
    if isinstance(fraction, int) and not isinstance(fraction, bool) and fraction > 1:
        return min(n, fraction)
    if float(fraction) >= 1.0:
        return None
    return max(1, round(n * float(fraction)))


def multi_scale_sizes(imgsz: int, fraction: float, stride: int) -> list[int]:
    """The sizes Ultralytics' ``preprocess_batch`` draws for ``multi_scale=fraction``."""
    low = max(stride, int(imgsz * (1.0 - fraction)))
    high = int(imgsz * (1.0 + fraction) + stride)
    return sorted({v // stride * stride for v in range(low, high)} - {0})


# ------------------------------------------------------------------ validator


class DataServerValidator(DetectionValidator):
    """A ``DetectionValidator`` whose loader is served: during training the trainer's
    (``test_loader``), for a final or standalone validation (``model.val(data=DATA,
    validator=DataServerValidator)``) one it builds on DATA's ``val`` address (closed
    after). ``served``: the trainer's ``data``, when there is one."""

    def __init__(
        self,
        dataloader: Any = None,
        save_dir: Any = None,
        args: Any = None,
        _callbacks: Any = None,
        served: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(dataloader, save_dir, args, _callbacks)
        self.served = None if served is None else dict(served)
        self._built: ServedLoader | None = None

    def __call__(self, trainer: Any = None, model: Any = None, **kwargs: Any) -> Any:
        if trainer is not None:
            return super().__call__(trainer, model, **kwargs)
        if self.served is None:
            self.served = served_data(self.args.data, self.args.split, bool(self.args.single_cls))
        served = self.served

        def the_served_data(*_: Any, **__: Any) -> dict[str, Any]:
            return dict(served)

        # Outside training, BaseValidator reads the data with check_det_dataset, which wants
        # files; the served data replaces it for this call only.
        try:
            with mock.patch.object(validator_module, "check_det_dataset", the_served_data):
                return super().__call__(trainer, model, **kwargs)
        finally:
            if self._built is not None:
                self._built.close()
                self._built = None

    def get_dataloader(self, dataset_path: Any, batch_size: int) -> Any:
        if self._built is not None:
            self._built.close()
        data = self.data or self.served or {}
        given: Any = self.stride  # (the model's, as Ultralytics' own val loader takes it)
        stride = int(given.max()) if hasattr(given, "max") else int(given or 32)
        self._built = val_loader(
            dataset_path, data, self.args, batch_size, rank=-1, stride=stride,
            rect=bool(self.args.rect),
        )  # fmt: skip
        return self._built


# ------------------------------------------------------------------ trainer


def _epoch_start(trainer: Any) -> None:
    """Ultralytics calls ``sampler.set_epoch`` under DDP only: the served epoch follows the
    trainer's epoch in every case (resumes included)."""
    trainer.train_loader.sampler.set_epoch(trainer.epoch)


class DataServerTrainer(DetectionTrainer):
    """Ultralytics' ``DetectionTrainer`` on served data: ``YOLO(cfg).train(
    trainer=DataServerTrainer, data=DATA, ...)`` (``DATA``: module docstring).

    Honoured: ``imgsz``; ``batch`` (split over the ranks, as Ultralytics); ``epochs``,
    ``time``; ``mosaic`` (mosaics from the start: the client's window mosaic, an epoch of N
    images, with ``mosaic_p=mosaic``; without it in the client, the consume mosaic, an epoch
    4x shorter, warned) and ``close_mosaic`` (``set_mode("regular")`` at epoch ``epochs -
    close_mosaic``); ``multi_scale`` (a ``MultiScale`` of the sizes Ultralytics draws, made
    by the servers; the trainer-side resize is off); ``seed``, ``deterministic`` (the
    service is deterministic in (seed, epoch)); ``degrees``, ``translate``, ``scale``,
    ``shear``, ``perspective``, ``hsv_h/s/v``, ``fliplr``, ``flipud`` (sent to the servers'
    dataset with ``client.control``; a ``YoloAugment`` there applies them); ``fraction``
    (each epoch takes that share of its epoch order: a fresh subset each epoch, where
    Ultralytics keeps its first files); ``single_cls``; ``classes``; ``resume`` (the
    client's state rides in the checkpoint under ``"dataserver"``; ``data=`` given again
    overrides moved addresses). Validation is served from DATA's ``val`` (``split``): rect
    batches as Ultralytics' own val loader makes them where the val dataset announces its
    sizes (``yolo_set`` in mode "val"; ``ultralytics_val``), square ``imgsz`` otherwise.

    Warned about by name: ``mixup``, ``cutmix``, ``copy_paste``, ``bgr``, ``rect``,
    ``cache``, ``augmentations``, ``workers`` (set by the user), ``batch`` below 1
    (AutoBatch: 16 is used), ``cls_pw`` and ``plots``' label plot (both read every label on
    the trainer), ``save_json``/``save_txt`` without the images' files and sizes, and a
    client without window mosaic, ``pad_value`` or ``letterbox``.
    """

    def __init__(
        self, cfg: Any = DEFAULT_CFG, overrides: dict | None = None, _callbacks: Any = None
    ):
        self._loaders: dict[str, ServedLoader] = {}
        self._warned: set[str] = set()
        self._user = dict(overrides or {})
        super().__init__(cfg, overrides, _callbacks)
        if self.args.task != "detect":
            raise ValueError(f"DataServerTrainer trains detection, not task={self.args.task!r}")
        if _epoch_start not in self.callbacks["on_train_epoch_start"]:
            self.add_callback("on_train_epoch_start", _epoch_start)
        self._warn_unserved()

    def _warn(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            LOGGER.warning(f"dataserver: {message}")

    def _warn_unserved(self) -> None:
        for key, why in UNSERVED.items():
            value = getattr(self.args, key, None)
            if value and value != DEFAULT_CFG_DICT.get(key):
                self._warn(key, f"{key}={value!r} is ignored: {why}")
        if self._user.get("workers", DEFAULT_CFG_DICT["workers"]) != DEFAULT_CFG_DICT["workers"]:
            self._warn("workers", "workers is ignored: the servers' processes prepare the data")
        for key in ("save_json", "save_txt"):
            if getattr(self.args, key, False):
                self._warn(
                    key,
                    f"{key}: served validation images are mirrored at random by the service "
                    "unless the val pool is yolo_set in mode 'val', so predictions scaled "
                    "back to the files are mirrored for those",
                )

    # --------------------------------------------------------- data

    def get_dataset(self) -> dict[str, Any]:
        """``self.data`` from DATA and the servers (no files): see ``served_data``."""
        try:
            data = served_data(self.args.data, self.args.split or "val", bool(self.args.single_cls))
        except ValueError as exc:
            raise RuntimeError(str(exc)) from None
        if self.args.single_cls:
            LOGGER.info("Overriding class names with single class.")
        return data

    def build_dataset(self, img_path: str, mode: str = "train", batch: int | None = None) -> Any:
        raise TypeError("DataServerTrainer builds no dataset: its samples come from the servers")

    def get_dataloader(
        self, dataset_path: Any, batch_size: int = 16, rank: int = 0, mode: str = "train"
    ) -> ServedLoader:
        """A served loader for ``mode``; the one it replaces (an OOM retry) is closed."""
        old = self._loaders.pop(mode, None)
        if old is not None:
            old.close()
        if mode == "train":
            loader = self._train_loader(dataset_path, batch_size, rank)
        else:
            loader = val_loader(
                dataset_path, self.data, self.args, batch_size, rank, self._note,
                stride=int(getattr(self, "stride", 32)), rect=True,
            )  # fmt: skip
        self._loaders[mode] = loader
        return loader

    def _note(self, message: str) -> None:
        self._warn(message, message.removeprefix("dataserver: "))

    def _train_loader(self, address: Any, batch_size: int, rank: int) -> ServedLoader:
        args = self.args
        accepted = client_parameters()
        r, world = rank_world(rank)
        imgsz = int(args.imgsz)
        sizes: tuple[int, int] | MultiScale = (imgsz, imgsz)
        if args.multi_scale and float(args.multi_scale) > 0:
            stride = int(getattr(self, "stride", 32))
            sizes = MultiScale(multi_scale_sizes(imgsz, float(args.multi_scale), stride))
        extra: dict[str, Any] = {}
        mosaic = float(args.mosaic or 0.0)
        if mosaic > 0 and "mosaic_partners" in accepted:
            extra.update(mosaic_partners="window", mosaic_p=min(1.0, mosaic))
        elif mosaic > 0:
            self._warn(
                "consume",
                "this client has no window mosaic (mosaic_partners): mosaic epochs consume 4 "
                "samples an image and are 4x shorter than Ultralytics'",
            )
        if "letterbox" in accepted:
            extra.update(letterbox="center", pad_value=PAD_VALUE)
        else:
            self._warn("pad", "this client has no pad_value/letterbox: padding is 0, top-left")
        client = DataServerClient(
            address, batch_size=int(batch_size), image_size=sizes, shuffle=True,
            seed=int(args.seed), rank=r, world_size=world, device="cpu",
            drop_last=bool(args.compile), stitch_layout="mosaic", stitch_k=4, **extra,
        )  # fmt: skip
        hyp = {}
        for key in HYPERPARAMETERS:
            value = getattr(args, key, None)
            if value is not None:
                hyp[key] = list(value) if isinstance(value, list | tuple) else float(value)
        client.control(**{CONTROL_KEY: hyp})
        if mosaic > 0:
            client.set_mode("stitch")
        fraction = get_split_fraction(args.fraction, "train")
        labels = LabelMap(self.data["wire_labels"], args.classes, bool(args.single_cls), "train")
        return ServedLoader(
            client, labels, val=False, centred="letterbox" in extra, role="train",
            limit=_count(client.dataset_len, fraction),
        )  # fmt: skip

    def preprocess_batch(self, batch: dict) -> dict:
        """To the device, [0, 1] floats. No resize: ``multi_scale`` sizes are served."""
        for key, value in batch.items():
            if isinstance(value, torch.Tensor):
                batch[key] = value.to(
                    self.device, non_blocking=self.device.type not in {"cpu", "mps"}
                )
        batch["img"] = batch["img"].float() / 255
        return batch

    def get_validator(self) -> DataServerValidator:
        return DataServerValidator(
            self.test_loader, save_dir=self.save_dir, args=copy(self.args),
            _callbacks=self.callbacks, served=self.data,
        )  # fmt: skip

    # --------------------------------------------------------- what reads every label

    def set_class_weights(self) -> None:
        if self.args.cls_pw:
            self._warn(
                "cls_pw", "cls_pw is ignored: class counts would need every label on the trainer"
            )

    def plot_training_labels(self) -> None:
        self._warn(
            "plots", "plots: the training-labels plot needs every label on the trainer; skipped"
        )

    def auto_batch(self, max_num_obj: int = 0, dataset_size: int = 0) -> int:
        self._warn("batch", f"batch={self.args.batch} (AutoBatch) is not served: using batch=16")
        return 16

    # --------------------------------------------------------- checkpoints

    def save_model(self) -> bool:
        """Ultralytics' checkpoints, each with the loader's state under ``"dataserver"``
        (the checkpoint is written by ``BaseTrainer.save_model`` in one piece, so the key is
        added by writing it again)."""
        saved = super().save_model()
        ckpt = torch.load(
            io.BytesIO(self.last.read_bytes()), map_location="cpu", weights_only=False
        )
        ckpt[CHECKPOINT_KEY] = self.train_loader.state_dict()
        buffer = io.BytesIO()
        torch.save(ckpt, buffer)
        data = buffer.getvalue()
        self.last.write_bytes(data)
        if self.best_fitness == self.fitness:
            self.best.write_bytes(data)
        if self.save_period > 0 and self.epoch % self.save_period == 0:
            (self.wdir / f"epoch{self.epoch}.pt").write_bytes(data)
        return bool(saved)

    def resume_training(self, ckpt: Any) -> None:
        super().resume_training(ckpt)
        if not (self.resume and isinstance(ckpt, dict)):
            return
        state = ckpt.get(CHECKPOINT_KEY)
        if state is None:
            LOGGER.warning("dataserver: the checkpoint holds no loader state; resuming afresh")
        else:
            self.train_loader.load_state_dict(state)
        self.train_loader.sampler.set_epoch(self.start_epoch)
