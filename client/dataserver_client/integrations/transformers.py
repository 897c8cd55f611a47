"""Hugging Face ``transformers.Trainer`` on the service: ``DataServerTrainer``.

    trainer = DataServerTrainer(
        model=RTDetrForObjectDetection(config), args=TrainingArguments(...),
        train="tcp://data-0:5555", val="tcp://data-val:5555", image_processor=processor,
    )
    trainer.train()          # or trainer.train(resume_from_checkpoint=True)
    trainer.evaluate()       # eval_map (COCO mAP in original pixels), eval_loss

What the object-detection guide does in a DataLoader's workers, the servers do here, in the
processor's own semantics:

- The processor's resize runs on the servers: ``size={"height", "width"}`` (RT-DETR) is a
  stretch to that size (``fit="stretch"``); ``size={"max_height", "max_width"}`` a top-left
  letterbox into it (its bottom/right padding, as ``do_pad`` pads); ``size={"shortest_edge",
  "longest_edge"}`` (DETR) has no fixed canvas: a top-left letterbox into longest x
  longest, with a warning. Its rescale (``rescale_factor``) and ``image_mean``/``image_std``
  run on the device, on the uint8 batch.
- Labels as the processor makes them (``format`` COCO detection): ``class_labels`` the
  dataset's categories as indices 0..n-1 (``id2label`` from ``client.categories``, set on
  the model's config), ``boxes`` normalized cxcywh (``do_convert_annotations``; else xyxy
  pixels), ``area``, ``iscrowd``, ``orig_size`` (the image as read), ``size`` (the canvas,
  as the processor's after its padding), ``image_id`` (the dataset index), plus
  ``content`` (top, left, h, w: where the picture lies), which the model ignores and the
  metric reads. ``pixel_mask`` (letterbox only: 0 on
  the padding) from ``batch.content``.
- Validation clients are never augmented (``augment=False``). Evaluation reports
  ``eval_map``, ``eval_map_50``, ``eval_map_75`` (pycocotools' COCOeval, boxes mapped back to
  original pixels) unless ``compute_metrics`` is given.
- ``TrainingArguments`` honoured: ``per_device_train_batch_size``,
  ``per_device_eval_batch_size``, ``seed`` (``data_seed`` when set), ``device``,
  ``dataloader_drop_last``, ``process_index``/``world_size`` (each rank its shard; the
  clients are built when the loaders are asked for, after accelerate's process group
  exists), ``ignore_data_skip``. Warned about by name and otherwise without effect:
  ``dataloader_num_workers``, ``dataloader_prefetch_factor``,
  ``dataloader_persistent_workers``, ``group_by_length``, ``auto_find_batch_size``,
  ``eval_do_concat_batches`` (evaluation keeps batches apart: images of a batch hold
  different box counts).
- Resume: the client's state is saved beside every Trainer checkpoint
  (``dataserver_client.pt``; under DDP a collective, every rank calls it); ``train(
  resume_from_checkpoint=...)`` continues mid-epoch from it (transformers'
  ``skip_first_batches`` is not run: the client already stands there) or at the next
  epoch's start. Tested on one process and under torchrun on 2 CPU ranks (gloo).

Trainer side only (transformers imports torch); nothing in the core imports this module.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
from transformers import EvalPrediction, Trainer, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from dataserver_client.batch import Batch, content_mask
from dataserver_client.client import DataServerClient
from dataserver_client.errors import DataServerError

log = logging.getLogger(__name__)

STATE_FILE = "dataserver_client.pt"
# TrainingArguments with no meaning here: the servers do the loading (name -> its default).
IGNORED_ARGS: dict[str, Any] = {
    "dataloader_num_workers": 0,
    "dataloader_prefetch_factor": None,
    "dataloader_persistent_workers": False,
    "group_by_length": False,
    "auto_find_batch_size": False,
}
MAX_DETECTIONS = 100  # per image, as COCOeval's maxDets
BILINEAR = 2  # PIL's (and transformers' PILImageResampling) number for bilinear


def _size_of(processor: Any) -> dict[str, Any]:
    size = getattr(processor, "size", None)
    if size is None:
        return {}
    keys = ("height", "width", "max_height", "max_width", "shortest_edge", "longest_edge")
    if isinstance(size, Mapping):
        return {k: size[k] for k in keys if size.get(k) is not None}
    return {k: getattr(size, k) for k in keys if getattr(size, k, None) is not None}


def served_geometry(processor: Any, warn: Any = log.warning) -> tuple[tuple[int, int], str]:
    """(image size, fit) the servers use for ``processor``'s resize: its ``size`` read as
    the module says; a processor that does not resize is refused (the servers' canvas is
    fixed)."""
    if not getattr(processor, "do_resize", True):
        raise ValueError(
            "DataServerTrainer: image_processor has do_resize=False; the servers resize to "
            "a fixed canvas: give the processor a size"
        )
    resample = getattr(processor, "resample", BILINEAR)
    if int(getattr(resample, "value", resample)) != BILINEAR:
        warn(
            f"dataserver: image_processor resample={resample!r}: the servers resize with "
            "OpenCV's bilinear interpolation"
        )
    size = _size_of(processor)
    if "height" in size and "width" in size:
        return (int(size["height"]), int(size["width"])), "stretch"
    if "max_height" in size and "max_width" in size:
        return (int(size["max_height"]), int(size["max_width"])), "letterbox"
    if "longest_edge" in size:
        side = int(size["longest_edge"])
        warn(
            f"dataserver: image_processor size {size} keeps each image's aspect with no fixed "
            f"canvas; served as a top-left letterbox into {side}x{side} (masked by pixel_mask)"
        )
        return (side, side), "letterbox"
    raise ValueError(f"DataServerTrainer: image_processor size {size!r} is not one it can serve")


class Prepare:
    """A served ``Batch`` as the model's inputs: the processor's rescale and normalization
    on the batch's device, labels as its annotations would be (see the module)."""

    def __init__(self, processor: Any, categories: list[tuple[int, str]], fit: str) -> None:
        self.fit = fit
        self.rescale = float(processor.rescale_factor) if processor.do_rescale else 1.0
        self.normalize = bool(getattr(processor, "do_normalize", False))
        self.mean = torch.tensor(processor.image_mean, dtype=torch.float32).view(1, 3, 1, 1)
        self.std = torch.tensor(processor.image_std, dtype=torch.float32).view(1, 3, 1, 1)
        self.convert = bool(getattr(processor, "do_convert_annotations", True))
        self.mask = fit == "letterbox"
        labels = sorted(label for label, _ in categories)
        self.index_of = {label: i for i, label in enumerate(labels)}
        self.lookup: torch.Tensor | None = None
        if labels:
            table = torch.full((max(labels) + 1,), -1, dtype=torch.int64)
            table[torch.tensor(labels)] = torch.arange(len(labels))
            self.lookup = table

    def classes(self, labels: torch.Tensor) -> torch.Tensor:
        """Dataset labels as indices 0..n-1 of the sorted categories (none: as they are)."""
        if self.lookup is None:
            return labels
        table = self.lookup.to(labels.device)
        if len(labels) and (int(labels.max()) >= len(table) or bool((table[labels] < 0).any())):
            bad = sorted(set(labels.tolist()) - set(self.index_of))
            raise DataServerError(f"labels {bad} are not among the dataset's categories")
        return table[labels]

    def __call__(self, batch: Batch) -> dict[str, Any]:
        images = batch.images.float()
        if self.rescale != 1.0:
            images = images * self.rescale
        if self.normalize:
            images = (images - self.mean.to(images.device)) / self.std.to(images.device)
        height, width = int(images.shape[-2]), int(images.shape[-1])
        scale = torch.tensor([width, height, width, height], dtype=torch.float32)
        labels = []
        for i, target in enumerate(batch.targets):
            boxes = target["boxes"]
            area = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
            if self.convert:
                x1, y1, x2, y2 = boxes.unbind(-1)
                cxcywh = torch.stack([(x1 + x2) / 2, (y1 + y2) / 2, x2 - x1, y2 - y1], -1)
                boxes = cxcywh / scale.to(boxes.device)
            top, left, h, w = batch.content[i] if batch.content else (0, 0, height, width)
            orig = batch.orig_sizes[i] if batch.orig_sizes and batch.orig_sizes[i][0] else (h, w)
            device = boxes.device
            labels.append(
                {
                    "class_labels": self.classes(target["labels"]),
                    "boxes": boxes,
                    "area": area,
                    "iscrowd": torch.zeros(len(boxes), dtype=torch.int64, device=device),
                    "orig_size": torch.tensor(orig, dtype=torch.int64, device=device),
                    "size": torch.tensor((height, width), dtype=torch.int64, device=device),
                    "image_id": torch.tensor(batch.indices[i][0], device=device),
                    "content": torch.tensor((top, left, h, w), dtype=torch.int64, device=device),
                }
            )
        inputs: dict[str, Any] = {"pixel_values": images, "labels": labels}
        if self.mask:
            inputs["pixel_mask"] = content_mask(batch.content, height, width, images.device)
        return inputs


class ServedLoader:
    """What the trainer's ``get_*_dataloader`` return: each ``iter()`` one epoch of
    ``client`` as model inputs. ``len()``: the epoch's batches (regular mode), fixed.
    Training: ``set_epoch`` reaches the client; a loaded state is gone on from by the next
    iteration. Evaluation: every iteration is epoch 0 from its start."""

    def __init__(self, client: DataServerClient, prepare: Prepare, *, train: bool) -> None:
        self.client = client
        self.prepare = prepare
        self.train = train
        self.batch_size = client.config.batch_size
        self.delivered = 0  # batches of the running epoch handed out (a resumed one's too)
        self._length = len(client)

    def __len__(self) -> int:
        return self._length

    def set_epoch(self, epoch: int) -> None:
        if self.train:
            self.client.set_epoch(int(epoch))

    def resumed_step(self) -> int:
        """Batches of the epoch handed out (before its first batch: a loaded state's)."""
        return int(self.client.state_dict(gather=False)["step"])

    def finished(self) -> bool:
        """Whether the running epoch has handed out all of its batches."""
        return self.delivered >= len(self.client)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if not self.train:
            self.client.set_epoch(0)
        epoch = iter(self.client)
        self.delivered = self.resumed_step()  # (0, or a loaded state's batches)
        for batch in epoch:
            self.delivered += 1
            yield self.prepare(batch)


class ServedData:
    """What the Trainer holds as its ``eval_dataset``: the val servers' address (the
    batches come from ``get_eval_dataloader``)."""

    def __init__(self, address: Any) -> None:
        self.address = address

    def __repr__(self) -> str:
        return f"ServedData({self.address!r})"


class DataServerTrainer(Trainer):
    """A ``transformers.Trainer`` whose training and evaluation batches come from
    dataserver pools at ``train``/``val`` (any address ``DataServerClient`` takes), made
    as ``image_processor`` makes them (see the module). ``client_kwargs`` go to both
    clients (``timeout``, ``shared_memory``, ...; not those the arguments decide).
    ``compute_metrics`` defaults to COCO mAP in original pixels (``coco_map``)."""

    def __init__(
        self,
        model: Any = None,
        args: TrainingArguments | None = None,
        *,
        train: Any,
        val: Any = None,
        image_processor: Any,
        client_kwargs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if image_processor is None:
            raise ValueError("DataServerTrainer needs the model's image_processor")
        fmt = str(getattr(getattr(image_processor, "format", None), "value", "coco_detection"))
        if "coco_detection" not in fmt:
            raise ValueError(
                f"DataServerTrainer: image_processor format {fmt!r}: COCO detection only"
            )
        args = args if args is not None else TrainingArguments(output_dir="trainer_output")
        for name, default in IGNORED_ARGS.items():
            if getattr(args, name, default) != default:
                log.warning(
                    "dataserver: TrainingArguments.%s has no effect (the servers load)", name
                )
        if getattr(args, "eval_do_concat_batches", False):  # (images hold their own box counts)
            args = _replace(args, eval_do_concat_batches=False)
        if kwargs.get("eval_dataset") is not None or kwargs.get("train_dataset") is not None:
            raise ValueError("DataServerTrainer takes train=/val= addresses, not datasets")
        if val is not None:  # (the Trainer checks an eval_strategy has something to evaluate)
            kwargs["eval_dataset"] = ServedData(val)
        kwargs.setdefault("compute_metrics", coco_map)
        kwargs.setdefault("processing_class", image_processor)
        super().__init__(model=model, args=args, **kwargs)
        self.train_address = train
        self.val_address = val
        self.image_processor = image_processor
        self.image_size, self.fit = served_geometry(image_processor)
        self.client_kwargs = dict(client_kwargs or {})
        self._train_loader: ServedLoader | None = None
        self._val_loader: ServedLoader | None = None
        self._resume_from: str | None = None

    # ------------------------------------------------------------ clients

    def _client(self, address: Any, *, val: bool) -> DataServerClient:
        args = self.args
        data_seed = getattr(args, "data_seed", None)
        seed = args.seed if data_seed is None else data_seed
        batch = args.per_device_eval_batch_size if val else args.per_device_train_batch_size
        return DataServerClient(
            address,
            **{
                **self.client_kwargs,
                "batch_size": int(batch),
                "image_size": self.image_size,
                "fit": self.fit,
                "shuffle": not val,
                "augment": not val,
                "seed": int(seed),
                "rank": int(args.process_index),
                "world_size": int(args.world_size),
                "device": args.device,
                "drop_last": bool(args.dataloader_drop_last),
            },
        )

    def _prepare_of(self, client: DataServerClient) -> Prepare:
        categories = client.categories
        config = getattr(self.model, "config", None)
        if categories and config is not None:
            names = {i: name for i, (_, name) in enumerate(sorted(categories))}
            if int(getattr(config, "num_labels", len(names))) != len(names):
                raise ValueError(
                    f"DataServerTrainer: the model has {config.num_labels} labels, the "
                    f"dataset {len(names)} categories"
                )
            config.update({"id2label": names, "label2id": {n: i for i, n in names.items()}})
        return Prepare(self.image_processor, categories, self.fit)

    def get_train_dataloader(self) -> Any:
        if self._train_loader is None:
            client = self._client(self.train_address, val=False)
            self._train_loader = ServedLoader(client, self._prepare_of(client), train=True)
        loader = self._train_loader
        if self._resume_from is not None:
            self._load_client_state(loader, self._resume_from)
            self._resume_from = None
        return loader

    def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
        if eval_dataset is not None and not isinstance(eval_dataset, ServedData):
            raise ValueError("DataServerTrainer evaluates its val servers: no eval_dataset")
        if self.val_address is None:
            raise ValueError("DataServerTrainer: evaluation needs val= servers")
        if self._val_loader is None:
            client = self._client(self.val_address, val=True)
            self._val_loader = ServedLoader(client, self._prepare_of(client), train=False)
        return self._val_loader

    def get_resumed_dataloader(self, dataloader: Any, num_batches: int) -> Any:
        """The loader as it is: its client goes on from the checkpoint's state (no batch is
        read to be skipped); a state that stands elsewhere is an error."""
        if isinstance(dataloader, ServedLoader):
            step = dataloader.resumed_step()
            if step != num_batches:
                raise DataServerError(
                    f"the checkpoint's client state stands at batch {step} of its epoch, "
                    f"the Trainer's at {num_batches}"
                )
            return dataloader
        return super().get_resumed_dataloader(dataloader, num_batches)

    def close(self) -> None:
        """Close both clients."""
        for loader in (self._train_loader, self._val_loader):
            if loader is not None:
                loader.client.close()
        self._train_loader = self._val_loader = None

    # ------------------------------------------------------------ checkpoints

    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
    ) -> Any:
        """``Trainer.train``; a checkpoint (``True``: the last in ``output_dir``) also gives
        the training client its state (unless ``ignore_data_skip``)."""
        resume: str | None = None
        if resume_from_checkpoint is True:
            resume = get_last_checkpoint(str(self.args.output_dir))
            if resume is None:
                raise ValueError(f"no checkpoint found in {self.args.output_dir}")
        elif isinstance(resume_from_checkpoint, str) and resume_from_checkpoint:
            resume = resume_from_checkpoint
        self._resume_from = None if self.args.ignore_data_skip else resume
        return super().train(resume, trial, ignore_keys_for_eval)

    def _load_client_state(self, loader: ServedLoader, checkpoint: str) -> None:
        path = os.path.join(checkpoint, STATE_FILE)
        if not os.path.isfile(path):
            log.warning("dataserver: %s has no client state: the epoch starts over", checkpoint)
            return
        saved = torch.load(path, weights_only=False)
        if saved["finished"]:  # saved at an epoch's end: the Trainer starts the next one
            return
        loader.client.load_state_dict(saved["state"])

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        super()._save_checkpoint(model, trial)
        loader = self._train_loader
        if loader is None:
            return
        state = loader.client.state_dict()  # (a collective under DDP: every rank is here)
        if self.args.should_save:
            folder = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            path = os.path.join(self._get_output_dir(trial=trial), folder, STATE_FILE)
            torch.save({"state": state, "finished": loader.finished()}, path)

    # ------------------------------------------------------------ evaluation

    def prediction_step(
        self,
        model: Any,
        inputs: dict[str, Any],
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
    ) -> tuple[Any, Any, Any]:
        """The loss, (logits, pred_boxes) and the labels: what ``coco_map`` reads."""
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            outputs = model(**inputs)
        loss = outputs.loss.detach() if getattr(outputs, "loss", None) is not None else None
        if prediction_loss_only:
            return loss, None, None
        return loss, (outputs.logits.detach(), outputs.pred_boxes.detach()), inputs["labels"]


def _replace(args: TrainingArguments, **changes: Any) -> TrainingArguments:
    import dataclasses

    return dataclasses.replace(args, **changes)


def to_original(boxes: np.ndarray, label: Mapping[str, Any], canvas: tuple[int, int]) -> np.ndarray:
    """Normalized cxcywh ``boxes`` of a canvas of ``canvas`` (h, w) as xywh in the original
    image's pixels (``label``'s ``content`` and ``orig_size``)."""
    height, width = canvas
    top, left, h, w = (float(v) for v in np.asarray(label["content"]))
    oh, ow = (float(v) for v in np.asarray(label["orig_size"]))
    cx, cy, bw, bh = (boxes[:, i] for i in range(4))
    x1 = ((cx - bw / 2) * width - left) * ow / w
    y1 = ((cy - bh / 2) * height - top) * oh / h
    return np.stack([x1, y1, bw * width * ow / w, bh * height * oh / h], -1)


def coco_map(prediction: EvalPrediction) -> dict[str, float]:
    """COCO mAP (pycocotools' COCOeval, bbox) of ``DataServerTrainer.prediction_step``'s
    outputs, batch by batch, in original pixels: each image's top ``MAX_DETECTIONS``
    (query, class) scores (sigmoid) against its labels."""
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    images: list[dict[str, Any]] = []
    annotations: list[dict[str, Any]] = []
    detections: list[dict[str, Any]] = []
    for (logits, pred_boxes), labels in zip(
        prediction.predictions, prediction.label_ids, strict=True
    ):
        scores_all, boxes_all = np.asarray(logits), np.asarray(pred_boxes)
        for n, label in enumerate(labels):
            image_id = len(images) + 1
            oh, ow = (int(v) for v in np.asarray(label["orig_size"]))
            images.append({"id": image_id, "height": oh, "width": ow})
            ch, cw = (int(v) for v in np.asarray(label["size"]))
            canvas = (ch, cw)
            truth = to_original(np.asarray(label["boxes"]).reshape(-1, 4), label, canvas)
            for box, cls in zip(truth, np.asarray(label["class_labels"]).tolist(), strict=True):
                ann = {"id": len(annotations) + 1, "image_id": image_id, "category_id": int(cls)}
                annotations.append(
                    {**ann, "bbox": box.tolist(), "area": float(box[2] * box[3]), "iscrowd": 0}
                )
            scores = 1 / (1 + np.exp(-scores_all[n].astype(np.float64)))
            classes = scores.shape[-1]
            top_k = np.argsort(-scores.ravel())[:MAX_DETECTIONS]
            boxes = to_original(boxes_all[n][top_k // classes], label, canvas)
            for box, k in zip(boxes, top_k, strict=True):
                detections.append(
                    {
                        "image_id": image_id,
                        "category_id": int(k % classes),
                        "bbox": box.tolist(),
                        "score": float(scores.ravel()[k]),
                    }
                )
    n_classes = (
        int(np.asarray(prediction.predictions[0][0]).shape[-1])
        if len(prediction.predictions)
        else 0
    )
    truth_set = COCO()
    truth_set.dataset = {
        "images": images,
        "annotations": annotations,
        "categories": [{"id": c} for c in range(n_classes)],
    }
    truth_set.createIndex()
    if not detections or not annotations:
        return {"map": 0.0, "map_50": 0.0, "map_75": 0.0}
    found = truth_set.loadRes(detections)
    evaluation = COCOeval(truth_set, found, "bbox")
    evaluation.evaluate()
    evaluation.accumulate()
    evaluation.summarize()
    stats = [max(0.0, float(v)) for v in evaluation.stats[:3]]
    return {"map": stats[0], "map_50": stats[1], "map_75": stats[2]}
