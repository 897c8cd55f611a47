"""RF-DETR's own training with dataserver pools as its data: ``train_rfdetr``.

::

    from rfdetr import RFDETRNano
    from dataserver_client.integrations.rfdetr import train_rfdetr

    model = RFDETRNano()
    train_rfdetr(model, "tcp://data-0:5555", val="tcp://data-val:5555",
                 epochs=12, batch_size=8, grad_accum_steps=2, output_dir="runs/nano")
    model.predict(image)             # the trained weights, as after model.train()

``train_rfdetr(model, train, val=None, **kwargs)`` runs what ``RFDETR.train(**kwargs)`` runs
around Lightning's ``fit`` (RF-DETR 1.11): the same ``TrainConfig`` from ``kwargs`` (its
``_prepare_run_config``: ``device``, ``resolution``, ``batch_size``, ...), its
``RFDETRModelModule`` (model, criterion, optimizer, EMA, multi-scale), its ``build_trainer``
(callbacks: checkpoints, ``COCOEvalCallback``, best model, early stopping, loggers), then its
post-fit steps: the trained module synced back onto ``model.model``, ``model.args`` rebuilt
from the run's config, ``model.model.class_names`` from the dataset's categories, the
training config written to ``output_dir``. The data module differs:
``RFDETRServedDataModule``, a ``DataServerDataModule`` that hands RF-DETR's module batches
as its own loaders do; and with per-batch multi-scale the module is a subclass of RF-DETR's
that skips its own resize (the servers made the size). Nothing of RF-DETR is patched.

Batches, as RF-DETR's datasets make them:

- Images stretched to ``resolution`` x ``resolution`` by the servers (``fit="stretch"``, as
  RF-DETR's square resize), ImageNet mean/std on the device; a ``NestedTensor`` whose mask
  is True on padding (none for a stretch; from ``batch.content``).
- Targets: ``labels`` the dataset's categories as indices 0..n-1 (sorted label order, as a
  Roboflow COCO export remaps them; ``class_names`` from ``client.categories``), ``boxes``
  normalized cxcywh, ``orig_size`` (the image as read, so ``COCOEvalCallback`` scores
  predictions and ground truth in original pixels), ``size``, ``image_id`` (the dataset
  index), ``area``, ``iscrowd``.
- Validation (``val``) at ``resolution`` from a client that never mirrors nor augments
  (``augment=False``), evaluated by RF-DETR's own ``COCOEvalCallback`` (``val/mAP_50_95``...).
- Multi-scale: RF-DETR's ``multi_scale="per-batch"`` (its default) draws one of its scales
  (``compute_multi_scale_scales``: ``resolution``, ``expanded_scales``, patch size, windows)
  per optimizer step and resizes the batch on the device. Here the servers make each batch
  at its scale (``MultiScale(scales, every=grad_accum_steps)``: one size per accumulation
  window, the same on every rank, known ahead so the prefetch plans it; sources stored once
  at the largest), and RF-DETR's module (``served_module``) skips its own resize. The draw
  is dataserver's (by seed, epoch, step), not RF-DETR's ``random.Random(global_step)``.
- Augmentation. ``aug_config=None`` (RF-DETR's default: ``HorizontalFlip(p=0.5)``) is the
  servers' built-in flip (about half the images mirrored, by (seed, epoch, index)), with
  the pool's own dataset ``augment`` if it has one; ``aug_config={}`` turns both off
  (``augment=False``). Any other ``aug_config``, or ``augmentation_backend="kornia"``, runs
  as **RF-DETR's own Kornia stage on the trainer** (``KorniaStage``: its
  ``build_kornia_pipeline`` on the served batch after it reaches the device, boxes and the
  padding mask through the same warps, then normalization: what ``RFDETRDataModule`` does
  in ``on_after_batch_transfer``), and the servers then neither flip nor augment. Why not a
  server-side translation: ``aug_config`` is a trainer argument, a pool's pipeline is fixed
  when it is started and shared by its trainers, servers never import torch (nor RF-DETR);
  RF-DETR ships this stage for exactly this place (batched, on the device, with its
  documented mapping of each ``aug_config`` entry), so its semantics stay RF-DETR's. It
  runs on whatever device trains (CPU too; needs ``rfdetr[augment]``'s kornia), for either
  backend (RF-DETR's CPU default would run ``aug_config`` in Albumentations in its loader
  workers: entries Kornia does not map, such as ``HueSaturationValue`` and the crops, are
  refused by its ``build_kornia_pipeline``). Not run: ``scale_jitter`` (its random
  resize-then-crop branch; warned about by name).
- Epochs: a whole number of accumulation windows, as RF-DETR aligns its own (Lightning
  issue #19987): each rank's epoch is its shard's batches of ``batch_size`` rounded down to
  a multiple of ``grad_accum_steps`` (job-wide: batch x grad_accum x world); the samples of
  the partial last window are left out of that epoch (a different few each epoch, the order
  being shuffled by epoch; RF-DETR instead pads its dataset with repeats). The client's
  next epoch starts at once, so a checkpoint at the epoch's end resumes at the next one.
- Resume: the training client's state rides in RF-DETR's Lightning checkpoints
  (``last.ckpt``, ``checkpoint_<epoch>.ckpt``: ``DataServerDataModule``'s entry) and in any
  mid-epoch checkpoint (``trainer_callbacks=[ModelCheckpoint(every_n_train_steps=N)]`` or
  ``OnExceptionCheckpoint``); ``train_rfdetr(..., resume=path)`` goes on with exactly the
  batches an uninterrupted run would have trained on (same samples, sizes and flips).

Arguments honoured from ``kwargs``: every ``TrainConfig`` field RF-DETR's module and trainer
read (``epochs``, ``lr``, ``batch_size``, ``eval_batch_size``, ``grad_accum_steps``,
``resolution``, ``device``, ``seed``, ``multi_scale``/``expanded_scales``, ``aug_config``,
``augmentation_backend``, ``output_dir``, ``resume``, ``class_names``, ...). Warned about
by name and without effect: ``dataset_dir``, ``dataset_file``, ``num_workers``,
``pin_memory``, ``persistent_workers``, ``prefetch_factor``, ``save_dataset_grids``,
``pad_targets_to``, ``pack_targets``, ``scale_jitter``, ``square_resize_div_64=False``,
``multi_scale="per-sample"``. ``client_kwargs`` go to both clients (``timeout``,
``shared_memory``, ...); ``trainer_callbacks`` are added to RF-DETR's Lightning callbacks.

Trainer side only (RF-DETR imports torch); nothing in the core imports this module.
"""

from __future__ import annotations

import logging
from argparse import Namespace
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from dataserver_client.batch import Batch, content_mask
from dataserver_client.errors import DataServerError
from dataserver_client.integrations.lightning import Address, DataServerDataModule
from dataserver_client.plan.sizes import MultiScale

if TYPE_CHECKING:
    from pytorch_lightning import Trainer
    from rfdetr.config import ModelConfig
    from rfdetr.detr import RFDETR
    from rfdetr.inference import ModelContext

log = logging.getLogger(__name__)

# ImageNet mean/std, as RF-DETR's Normalize (rfdetr.datasets.transforms).
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
# TrainConfig fields about RF-DETR's own loading, with no effect here (the servers load).
IGNORED = (
    "dataset_dir",
    "dataset_file",
    "num_workers",
    "pin_memory",
    "persistent_workers",
    "prefetch_factor",
    "pad_targets_to",
    "pack_targets",
)
KORNIA_MISSING = (
    "train_rfdetr runs RF-DETR's aug_config as its Kornia stage on the trainer, which needs "
    'kornia: pip install "rfdetr[augment]" (or pass aug_config=None for the servers\' flip)'
)


class ClassIndex:
    """Dataset labels as class indices 0..n-1 of the sorted categories."""

    def __init__(self, categories: list[tuple[int, str]]) -> None:
        ordered = sorted(categories)
        self.names = [name for _, name in ordered]
        labels = [label for label, _ in ordered]
        self.table: torch.Tensor | None = None
        if labels:
            table = torch.full((max(labels) + 1,), -1, dtype=torch.int64)
            table[torch.tensor(labels)] = torch.arange(len(labels))
            self.table = table

    def __call__(self, labels: torch.Tensor) -> torch.Tensor:
        if self.table is None:
            return labels
        table = self.table.to(labels.device)
        if len(labels) and (int(labels.max()) >= len(table) or bool((table[labels] < 0).any())):
            known = set(torch.nonzero(table >= 0).flatten().tolist())
            bad = sorted(set(labels.tolist()) - known)
            raise DataServerError(f"labels {bad} are not among the dataset's categories")
        return table[labels]


def uses_kornia(train_config: Any) -> bool:
    """Whether ``train_config`` asks for augmentation the servers do not make: a non-empty
    ``aug_config``, or an ``augmentation_backend`` RF-DETR resolves to its Kornia stage
    ("kornia"/"gpu"; "auto" with CUDA and kornia), run on the trainer. ``aug_config=None``
    otherwise is RF-DETR's default flip (the servers'); ``{}`` is none at all."""
    from rfdetr.datasets.kornia_transforms import is_gpu_postprocess, resolve_augmentation_backend

    backend = train_config.augmentation_backend
    return bool(train_config.aug_config) or is_gpu_postprocess(
        resolve_augmentation_backend(getattr(backend, "value", backend))
    )


class KorniaStage:
    """RF-DETR's GPU augmentation (``RFDETRDataModule.on_after_batch_transfer``, Kornia),
    built from its ``aug_config`` by its own ``build_kornia_pipeline``, run on the served
    training batch on the trainer's device: images in [0, 1], boxes xyxy pixels and the
    padding mask through the same warps, then ImageNet normalization; boxes clipped and
    those of no area dropped (its ``unpack_boxes``)."""

    def __init__(self, aug_config: dict[str, Any] | None, resolution: int) -> None:
        try:
            import kornia  # noqa: F401
        except ModuleNotFoundError as exc:
            raise ImportError(KORNIA_MISSING) from exc
        from rfdetr.datasets.aug_configs import AUG_CONFIG
        from rfdetr.datasets.kornia_transforms import build_kornia_pipeline, build_normalize

        self.pipeline = build_kornia_pipeline(
            aug_config if aug_config else AUG_CONFIG, resolution, with_masks=True
        )
        self.normalize = build_normalize()

    def __call__(
        self, images: torch.Tensor, padding: torch.Tensor, targets: list[dict[str, torch.Tensor]]
    ) -> tuple[torch.Tensor, torch.Tensor, list[dict[str, torch.Tensor]]]:
        from rfdetr.datasets.kornia_transforms import collate_boxes, unpack_boxes

        self.pipeline.to(images.device)
        self.normalize.to(images.device)
        boxes, valid = collate_boxes(targets, images.device)
        warped, boxes, masks = self.pipeline(images, boxes, padding.unsqueeze(1).float())
        out = self.normalize(warped)
        height, width = int(out.shape[-2]), int(out.shape[-1])
        return out, masks[:, 0] > 0.5, unpack_boxes(boxes, valid, targets, height, width)


def normalize(images: torch.Tensor) -> torch.Tensor:
    """[0, 1] images with ImageNet mean/std, as RF-DETR's ``Normalize``."""
    mean = torch.tensor(MEAN, device=images.device).view(1, 3, 1, 1)
    std = torch.tensor(STD, device=images.device).view(1, 3, 1, 1)
    return (images - mean) / std


def rfdetr_batch(
    batch: Batch, classes: ClassIndex, augment: KorniaStage | None = None
) -> tuple[Any, list[dict[str, torch.Tensor]]]:
    """A served ``Batch`` as RF-DETR's ``(NestedTensor, targets)`` (see the module); with
    ``augment``, through RF-DETR's Kornia stage first."""
    from rfdetr.utilities.tensors import NestedTensor

    images = batch.images.float() / 255.0
    height, width = int(images.shape[-2]), int(images.shape[-1])
    content = batch.content or [(0, 0, height, width)] * len(batch.targets)
    padding = content_mask(content, height, width, images.device) == 0
    targets = []
    for i, target in enumerate(batch.targets):
        boxes = target["boxes"].to(images.device)
        h, w = content[i][2], content[i][3]
        orig = batch.orig_sizes[i] if batch.orig_sizes and batch.orig_sizes[i][0] else (h, w)
        labels = classes(target["labels"].to(images.device))
        targets.append(
            {
                "boxes": boxes,  # xyxy pixels until the end
                "labels": labels,
                "area": (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1]),
                "iscrowd": torch.zeros_like(labels),
                "orig_size": torch.tensor(orig, dtype=torch.int64, device=images.device),
                "size": torch.tensor((height, width), dtype=torch.int64, device=images.device),
                "image_id": torch.tensor(batch.indices[i][0], device=images.device),
            }
        )
    if augment is not None:
        images, padding, targets = augment(images, padding, targets)
    else:
        images = normalize(images)
    scale = torch.tensor([width, height, width, height], dtype=torch.float32, device=images.device)
    for target in targets:
        x1, y1, x2, y2 = target["boxes"].unbind(-1)
        target["boxes"] = torch.stack([(x1 + x2) / 2, (y1 + y2) / 2, x2 - x1, y2 - y1], -1) / scale
    return NestedTensor(images, padding), targets


def served_sizes(model_config: Any, train_config: Any) -> tuple[int, int] | MultiScale:
    """The training batches' size: ``resolution`` square, or with ``multi_scale``
    "per-batch" RF-DETR's scales (``compute_multi_scale_scales``) as a ``MultiScale`` whose
    size holds for each accumulation window, as RF-DETR's own draw holds for a step."""
    from rfdetr.config import MultiScale as Mode
    from rfdetr.datasets.coco import compute_multi_scale_scales

    side = int(model_config.resolution)
    if Mode.from_value(train_config.multi_scale) is not Mode.PER_BATCH:
        return (side, side)
    scales = compute_multi_scale_scales(
        side, train_config.expanded_scales, model_config.patch_size, model_config.num_windows
    )
    return MultiScale(scales, every=max(1, int(train_config.grad_accum_steps)))


class RFDETRServedDataModule(DataServerDataModule):
    """RF-DETR's data module on dataserver: a ``DataServerDataModule`` whose batches reach
    RF-DETR's ``RFDETRModelModule`` as ``(NestedTensor, targets)`` (``rfdetr_batch``), with
    clients made from RF-DETR's ``model_config``/``train_config`` (see the module): training
    at ``served_sizes``, epochs of whole accumulation windows, RF-DETR's Kornia stage on the
    trainer when its ``aug_config`` asks for more than the servers' flip; validation at
    ``resolution``, never augmented. ``class_names`` (read by RF-DETR's callbacks and
    ``train_rfdetr``): the dataset's category names in class-index order, once the clients
    exist."""

    def __init__(
        self,
        model_config: Any,
        train_config: Any,
        train: Address,
        val: Address | None = None,
        **client_kwargs: Any,
    ) -> None:
        side = int(model_config.resolution)
        eval_batch = train_config.eval_batch_size
        kornia = uses_kornia(train_config)
        super().__init__(
            train,
            val,
            **{
                **client_kwargs,
                "batch_size": int(train_config.batch_size),
                "image_size": served_sizes(model_config, train_config),
                "fit": "stretch",
                "seed": int(train_config.seed) if train_config.seed is not None else 0,
                "drop_last": True,
                # aug_config None: RF-DETR's default flip (p=0.5), the servers' own;
                # {}: none; more: RF-DETR's Kornia stage on the trainer, in place of the flip.
                "augment": train_config.aug_config is None and not kornia,
            },
        )
        self.model_config = model_config
        self.train_config = train_config
        self.side = side
        self.accumulate = max(1, int(train_config.grad_accum_steps))
        self.eval_batch_size = int(eval_batch) if eval_batch is not None else None
        self._classes: ClassIndex | None = None
        self._augment: KorniaStage | None = (
            KorniaStage(train_config.aug_config, side) if kornia else None
        )

    def _kwargs(self, *, val: bool) -> dict[str, Any]:
        kwargs = super()._kwargs(val=val)
        if val:
            kwargs["image_size"] = (self.side, self.side)  # RF-DETR validates at resolution
            if self.eval_batch_size is not None:
                kwargs["batch_size"] = self.eval_batch_size
        return kwargs

    def _window(self) -> int:
        """An epoch is a whole number of accumulation windows (batch x grad_accum_steps on
        each rank: x world job-wide), as RF-DETR aligns its own."""
        return self.accumulate

    def setup(self, stage: str) -> None:
        super().setup(stage)
        client = self.client or self.val_client
        if client is not None and self._classes is None:
            self._classes = ClassIndex(list(client.categories))
        if stage == "fit" and self.client is not None:
            window = self.client.config.batch_size * self.accumulate
            if self.client.num_samples < window:
                raise ValueError(
                    f"train_rfdetr: this rank's shard holds {self.client.num_samples} samples, "
                    f"fewer than one accumulation window (batch_size "
                    f"{self.client.config.batch_size} x grad_accum_steps {self.accumulate})"
                )
            dropped = self.client.num_samples % window
            if dropped:
                log.info(
                    "dataserver: each epoch leaves out %d of the rank's %d samples (a partial "
                    "accumulation window of batch_size x grad_accum_steps = %d; another each epoch)",
                    dropped,
                    self.client.num_samples,
                    window,
                )

    @property
    def class_names(self) -> list[str] | None:
        """The dataset's category names, by class index (None before ``setup``)."""
        return None if self._classes is None else list(self._classes.names)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """A served ``Batch`` as RF-DETR's ``(NestedTensor, targets)``; training batches
        through RF-DETR's Kornia stage when it runs."""
        if not isinstance(batch, Batch):
            return batch
        if self._classes is None:
            raise RuntimeError("RFDETRServedDataModule: a batch before setup()")
        training = self.trainer is not None and self.trainer.training
        return rfdetr_batch(batch, self._classes, self._augment if training else None)


def served_module(model_config: Any, train_config: Any) -> Any:
    """RF-DETR's ``RFDETRModelModule`` for served batches: with ``multi_scale`` "per-batch"
    the servers made each batch at its scale already (``served_sizes``), so its own
    per-batch resize (``on_train_batch_start``) is not run again; otherwise it is RF-DETR's
    module unchanged."""
    from rfdetr.config import MultiScale as Mode
    from rfdetr.training import RFDETRModelModule

    class ServedScales(RFDETRModelModule):
        """``RFDETRModelModule`` whose batches come at their scale from the servers."""

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            return None

    if Mode.from_value(train_config.multi_scale) is Mode.PER_BATCH:
        return ServedScales(model_config, train_config)
    return RFDETRModelModule(model_config, train_config)


def train_rfdetr(
    model: Any,
    train: Address,
    val: Address | None = None,
    *,
    client_kwargs: Mapping[str, Any] | None = None,
    trainer_callbacks: Sequence[Any] = (),
    **kwargs: Any,
) -> RFDETRServedDataModule:
    """Train ``model`` (an ``rfdetr`` model: ``RFDETRNano()``, ...) as ``model.train(**kwargs)``
    does, its data from the pools at ``train`` (and ``val``, validated every
    ``eval_interval`` epochs by RF-DETR's COCO evaluation). ``trainer_callbacks``: Lightning
    callbacks added to RF-DETR's own (e.g. ``ModelCheckpoint(every_n_train_steps=N)`` or
    ``OnExceptionCheckpoint``: mid-epoch checkpoints, which resume exactly). Returns the
    data module (its clients closed). See the module for what is honoured and what is
    warned about."""
    try:
        from rfdetr.detr import _prepare_run_config
        from rfdetr.training import build_trainer
    except ModuleNotFoundError as exc:
        raise ImportError(
            'train_rfdetr needs RF-DETR\'s training stack: pip install "dataserver[rfdetr]"'
        ) from exc

    kwargs = _checked(kwargs)
    config, accelerator, devices = _prepare_run_config(model, dataset_dir=None, **kwargs)
    datamodule = RFDETRServedDataModule(
        model.model_config, config, train, val, **dict(client_kwargs or {})
    )
    try:
        # The class count from the dataset, as RF-DETR's _align_num_classes_from_dataset does
        # (an explicit num_classes wins).
        datamodule.setup("validate" if val is not None else "fit")
        names = datamodule.class_names or []
        datamodule.teardown("probe")  # (fit builds its clients anew, on its device)
        if names:
            _align_num_classes(model, len(names))

        module = served_module(model.model_config, config)
        trainer_kwargs: dict[str, Any] = {"accelerator": accelerator}
        if devices is not None:
            trainer_kwargs["devices"] = devices
        trainer: Trainer = build_trainer(config, model.model_config, **trainer_kwargs)
        # (Lightning's connector sets ``callbacks`` on the Trainer: a plain list)
        trainer.callbacks.extend(trainer_callbacks)  # type: ignore[attr-defined]
        trainer.fit(module, datamodule, ckpt_path=config.resume or None)
    finally:
        datamodule.teardown("fit")  # closes the clients also when fit raised

    _after_fit(model, module, config, names)
    return datamodule


def _checked(kwargs: dict[str, Any]) -> dict[str, Any]:
    """RF-DETR's training arguments less those about its own loading (each warned about by
    name when given); ``save_dataset_grids`` off (it renders RF-DETR's own datasets)."""
    for name in IGNORED:
        if kwargs.get(name) is not None:
            log.warning("dataserver: RF-DETR argument %s has no effect (the servers load)", name)
    kwargs = {k: v for k, v in kwargs.items() if k not in ("dataset_dir", "dataset_file")}
    if kwargs.pop("save_dataset_grids", False):
        log.warning("dataserver: RF-DETR argument save_dataset_grids has no effect")
    kwargs["save_dataset_grids"] = False
    if kwargs.get("multi_scale") == "per-sample":
        log.warning(
            "dataserver: RF-DETR argument multi_scale='per-sample' is its dataset transform: "
            "not run (batches at resolution; 'per-batch' is served)"
        )
    if kwargs.get("scale_jitter", True):
        log.warning(
            "dataserver: RF-DETR argument scale_jitter (its random resize-and-crop branch) is "
            "not run: the servers stretch each image whole (scale_jitter=False says so)"
        )
    if kwargs.get("square_resize_div_64") is False:
        log.warning(
            "dataserver: RF-DETR argument square_resize_div_64=False has no effect: batches "
            "are served square (stretched to resolution)"
        )
    if kwargs.get("batch_size") == "auto":
        raise ValueError(
            "train_rfdetr: batch_size='auto' probes RF-DETR's own dataset; give a number"
        )
    return kwargs


def _after_fit(model: Any, module: Any, config: Any, names: list[str]) -> None:
    """``RFDETR.train()``'s post-fit steps: the trained weights onto ``model.model``, its
    ``args`` from the run's config, class names (explicit ones win), the saved config."""
    from rfdetr._namespace import _namespace_from_configs
    from rfdetr.detr import _save_training_config
    from rfdetr.utilities.distributed import is_main_process

    detector: RFDETR = model
    context: ModelContext = detector.model
    context.model = module.model
    context.args = _namespace_from_configs(detector.model_config, config)
    detector._has_been_trained = True
    detector.remove_optimized_model()
    explicit = getattr(config, "class_names", None)
    if explicit is not None:
        context.class_names = explicit
    elif names:
        context.class_names = names
    if is_main_process():
        _save_training_config(config, detector.model_config, context.class_names)


def _align_num_classes(model: Any, classes: int) -> None:
    """``model_config.num_classes`` (and its ``args``) set to the dataset's class count before
    the module is built, as ``RFDETR._align_num_classes_from_dataset`` does; an explicit
    ``num_classes`` is kept."""
    detector: RFDETR = model
    cfg: ModelConfig = detector.model_config
    if classes == cfg.num_classes or "num_classes" in cfg.model_fields_set:
        return
    cfg.num_classes = classes
    args: Namespace | None = getattr(detector.model, "args", None)
    if args is not None:
        args.num_classes = classes
