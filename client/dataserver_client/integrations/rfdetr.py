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
training config written to ``output_dir``. Only the data module differs:
``RFDETRServedDataModule``, a ``DataServerDataModule`` that hands RF-DETR's module batches
as its own loaders do. Nothing of RF-DETR is patched or replaced.

Batches, as RF-DETR's datasets make them:

- Images stretched to ``resolution`` x ``resolution`` by the servers (``fit="stretch"``, as
  RF-DETR's square resize), ImageNet mean/std on the device; a ``NestedTensor`` whose mask
  is True on padding (none for a stretch; from ``batch.content``).
- Targets: ``labels`` the dataset's categories as indices 0..n-1 (sorted label order, as a
  Roboflow COCO export remaps them; ``class_names`` from ``client.categories``), ``boxes``
  normalized cxcywh, ``orig_size`` (the image as read, so ``COCOEvalCallback``'s mAP is in
  original pixels), ``size``, ``image_id`` (the dataset index), ``area``, ``iscrowd``.
- Validation (``val``) from a client that never mirrors nor augments (``augment=False``),
  evaluated by RF-DETR's own ``COCOEvalCallback`` (``val/mAP_50_95``, ...).
- Multi-scale: RF-DETR's ``multi_scale="per-batch"`` resizes each batch on the device in
  its module's ``on_train_batch_start``; that runs unchanged on the served batches.
- Augmentation: the servers' built-in augmentation (``augment=True``: the horizontal flip)
  on training batches. RF-DETR's ``aug_config`` (Albumentations on its CPU workers, or its
  Kornia stage on the GPU) is **not** applied: a warning names ``aug_config`` /
  ``augmentation_backend`` when given. (Its Kornia stage could be run on the trainer on the
  served batch; not done yet.)
- Resume: the training client's state rides in RF-DETR's Lightning checkpoints
  (``last.ckpt``, ``checkpoint_<epoch>.ckpt``: ``DataServerDataModule``'s entry);
  ``train_rfdetr(..., resume=path)`` goes on from exactly the samples not yet trained on.
- Epochs: each epoch every sample of the rank's shard once, ``drop_last`` batches of
  ``batch_size``. RF-DETR pads its dataset to whole accumulation windows
  (batch x ``grad_accum_steps`` x world); a served epoch is not padded: when its batch count
  is not a multiple of ``grad_accum_steps`` a warning says so (Lightning then steps on the
  partial last window, Lightning issue #19987).

Arguments honoured from ``kwargs``: every ``TrainConfig`` field RF-DETR's module and trainer
read (``epochs``, ``lr``, ``batch_size``, ``eval_batch_size``, ``grad_accum_steps``,
``resolution``, ``device``, ``seed``, ``multi_scale``/``expanded_scales``, ``output_dir``,
``resume``, ``class_names``, ...). Warned about by name and without effect: ``dataset_dir``,
``dataset_file``, ``num_workers``, ``pin_memory``, ``persistent_workers``,
``prefetch_factor``, ``aug_config``, ``augmentation_backend``, ``save_dataset_grids``,
``pad_targets_to``, ``pack_targets``. ``client_kwargs`` go to both clients (``timeout``,
``shared_memory``, ...).

Trainer side only (RF-DETR imports torch); nothing in the core imports this module.
"""

from __future__ import annotations

import logging
from argparse import Namespace
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from dataserver_client.batch import Batch, content_mask
from dataserver_client.errors import DataServerError
from dataserver_client.integrations.lightning import Address, DataServerDataModule

if TYPE_CHECKING:
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
    "aug_config",
    "augmentation_backend",
    "pad_targets_to",
    "pack_targets",
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


def rfdetr_batch(batch: Batch, classes: ClassIndex) -> tuple[Any, list[dict[str, torch.Tensor]]]:
    """A served ``Batch`` as RF-DETR's ``(NestedTensor, targets)`` (see the module)."""
    from rfdetr.utilities.tensors import NestedTensor

    images = batch.images.float() / 255.0
    mean = torch.tensor(MEAN, device=images.device).view(1, 3, 1, 1)
    std = torch.tensor(STD, device=images.device).view(1, 3, 1, 1)
    images = (images - mean) / std
    height, width = int(images.shape[-2]), int(images.shape[-1])
    content = batch.content or [(0, 0, height, width)] * len(batch.targets)
    padding = content_mask(content, height, width, images.device) == 0
    scale = torch.tensor([width, height, width, height], dtype=torch.float32, device=images.device)
    targets = []
    for i, target in enumerate(batch.targets):
        boxes = target["boxes"].to(images.device)
        x1, y1, x2, y2 = boxes.unbind(-1)
        cxcywh = torch.stack([(x1 + x2) / 2, (y1 + y2) / 2, x2 - x1, y2 - y1], -1) / scale
        h, w = content[i][2], content[i][3]
        orig = batch.orig_sizes[i] if batch.orig_sizes and batch.orig_sizes[i][0] else (h, w)
        labels = classes(target["labels"].to(images.device))
        targets.append(
            {
                "boxes": cxcywh,
                "labels": labels,
                "area": (x2 - x1) * (y2 - y1),
                "iscrowd": torch.zeros_like(labels),
                "orig_size": torch.tensor(orig, dtype=torch.int64, device=images.device),
                "size": torch.tensor((height, width), dtype=torch.int64, device=images.device),
                "image_id": torch.tensor(batch.indices[i][0], device=images.device),
            }
        )
    return NestedTensor(images, padding), targets


class RFDETRServedDataModule(DataServerDataModule):
    """RF-DETR's data module on dataserver: a ``DataServerDataModule`` whose batches reach
    RF-DETR's ``RFDETRModelModule`` as ``(NestedTensor, targets)`` (``rfdetr_batch``), with
    clients made from RF-DETR's ``model_config``/``train_config`` (see the module).
    ``class_names`` (read by RF-DETR's callbacks and ``train_rfdetr``): the dataset's
    category names in class-index order, once the clients exist."""

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
        super().__init__(
            train,
            val,
            **{
                **client_kwargs,
                "batch_size": int(train_config.batch_size),
                "image_size": (side, side),
                "fit": "stretch",
                "seed": int(train_config.seed) if train_config.seed is not None else 0,
                "drop_last": True,
            },
        )
        self.model_config = model_config
        self.train_config = train_config
        self.eval_batch_size = int(eval_batch) if eval_batch is not None else None
        self._classes: ClassIndex | None = None

    def _kwargs(self, *, val: bool) -> dict[str, Any]:
        kwargs = super()._kwargs(val=val)
        if val and self.eval_batch_size is not None:
            kwargs["batch_size"] = self.eval_batch_size
        return kwargs

    def setup(self, stage: str) -> None:
        super().setup(stage)
        client = self.client or self.val_client
        if client is not None and self._classes is None:
            self._classes = ClassIndex(list(client.categories))
        if stage == "fit" and self.client is not None and self.trainer is not None:
            accum = int(self.trainer.accumulate_grad_batches)
            batches = len(self.client)
            if accum > 1 and batches % accum:
                log.warning(
                    "dataserver: an epoch holds %d batches of batch_size %d, not a multiple of "
                    "grad_accum_steps=%d: the last accumulation window of each epoch is partial "
                    "(RF-DETR's own loader pads its dataset to whole windows)",
                    batches,
                    self.client.config.batch_size,
                    accum,
                )

    @property
    def class_names(self) -> list[str] | None:
        """The dataset's category names, by class index (None before ``setup``)."""
        return None if self._classes is None else list(self._classes.names)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """A served ``Batch`` as RF-DETR's ``(NestedTensor, targets)``."""
        if not isinstance(batch, Batch):
            return batch
        if self._classes is None:
            raise RuntimeError("RFDETRServedDataModule: a batch before setup()")
        return rfdetr_batch(batch, self._classes)


def train_rfdetr(
    model: Any,
    train: Address,
    val: Address | None = None,
    *,
    client_kwargs: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> RFDETRServedDataModule:
    """Train ``model`` (an ``rfdetr`` model: ``RFDETRNano()``, ...) as ``model.train(**kwargs)``
    does, its data from the pools at ``train`` (and ``val``, validated every
    ``eval_interval`` epochs by RF-DETR's COCO evaluation). Returns the data module (its
    clients closed). See the module for what is honoured and what is warned about."""
    try:
        from rfdetr.detr import _prepare_run_config
        from rfdetr.training import RFDETRModelModule, build_trainer
    except ModuleNotFoundError as exc:
        raise ImportError(
            'train_rfdetr needs RF-DETR\'s training stack: pip install "dataserver[rfdetr]"'
        ) from exc

    kwargs = _checked(kwargs)
    config, accelerator, devices = _prepare_run_config(model, dataset_dir=None, **kwargs)
    datamodule = RFDETRServedDataModule(
        model.model_config, config, train, val, **dict(client_kwargs or {})
    )
    # The class count from the dataset, as RF-DETR's _align_num_classes_from_dataset does
    # (an explicit num_classes wins).
    datamodule.setup("validate" if val is not None else "fit")
    names = datamodule.class_names or []
    datamodule.teardown("probe")  # (fit builds its clients anew, on its device)
    if names:
        _align_num_classes(model, len(names))

    module = RFDETRModelModule(model.model_config, config)
    trainer_kwargs: dict[str, Any] = {"accelerator": accelerator}
    if devices is not None:
        trainer_kwargs["devices"] = devices
    trainer = build_trainer(config, model.model_config, **trainer_kwargs)
    trainer.fit(module, datamodule, ckpt_path=config.resume or None)

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
        log.warning("dataserver: multi_scale='per-sample' is RF-DETR's dataset transform: not run")
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
