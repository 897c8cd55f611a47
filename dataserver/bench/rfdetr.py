"""``dataserver bench --only rfdetr``: RF-DETR's own training on its own data loading against
``train_rfdetr`` on served data, at the same work.

RF-DETR's side: the bench's COCO set written in RF-DETR's COCO folder layout
(``train/_annotations.coco.json`` beside its JPEGs, ``valid/`` the same), trained as
``RFDETR.train(dataset_dir=...)`` trains: its ``_prepare_run_config``, its
``RFDETRModelModule``, its ``RFDETRDataModule`` (its DataLoader, its decode, square resize
and normalization in its ``num_workers`` workers) and its ``build_trainer`` (the one addition,
on both sides: a Lightning callback that times the training batches). The service's side:
``train_rfdetr`` on a server of the same images (``--cache-gb 0``: it decodes every image
every epoch, as RF-DETR's loader does), as many server workers as RF-DETR's ``num_workers``.

Same work on both: the same random-init model (``RFDETRNano(pretrain_weights=None,
group_detr=1, num_queries=30, num_select=30)``, as tests/test_rfdetr.py trains), on CPU,
``resolution`` the bench's image size (a stretch on both sides), ``batch_size``, epochs,
``aug_config={}`` (no augmentation on either side), ``multi_scale=False``, no EMA,
``grad_accum_steps=1``. ``--batches``: the timed training batches (rounded up to whole
epochs). Epoch 0 is the warm-up (workers started, server connected); the
timed window of each later epoch runs from its start to its last training batch (validation,
which RF-DETR's side runs on its final epoch, is outside it). Each run in a fresh process,
sides alternating, medians; CPU counted over the trainer process and its loader (RF-DETR's
DataLoader workers, or the server's processes), reported split.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dataserver.admin import child_pids
from dataserver.bench.common import Progress, med, rounds, run_side, server
from dataserver.bench.cpu import cpu_seconds

# The model both sides train (tests/test_rfdetr.py's SMALL: a smaller decoder than Nano's).
MODEL: dict[str, Any] = dict(pretrain_weights=None, group_detr=1, num_queries=30, num_select=30)


def train_kwargs(args: argparse.Namespace, out: str) -> dict[str, Any]:
    """RF-DETR's training arguments, the same on both sides."""
    return dict(
        epochs=args.epochs, batch_size=args.batch_size, grad_accum_steps=1,
        resolution=args.image_size, lr=1e-4, multi_scale=False, aug_config={}, seed=0,
        device="cpu", use_ema=False, run_test=False, progress_bar=False, tensorboard=False,
        eval_interval=args.epochs, output_dir=out,
    )  # fmt: skip


def rfdetr_layout(annotations: Path, out: Path, val_images: int) -> Path:
    """The set at ``annotations`` (COCO, its JPEGs beside it) as RF-DETR's COCO folder:
    ``out/train`` (every image, hard links) and ``out/valid`` (the first ``val_images``)."""
    doc = json.loads(annotations.read_text())
    for split, images in (("train", doc["images"]), ("valid", doc["images"][:val_images])):
        folder = out / split
        folder.mkdir(parents=True)
        ids = {im["id"] for im in images}
        for im in images:
            src = annotations.parent / im["file_name"]
            try:
                os.link(src, folder / im["file_name"])
            except OSError:
                shutil.copyfile(src, folder / im["file_name"])
        part = {**doc, "images": images}
        part["annotations"] = [a for a in doc["annotations"] if a["image_id"] in ids]
        (folder / "_annotations.coco.json").write_text(json.dumps(part))
    return out


class Timing:
    """The hooks of ``timer``'s callback: images/s of the training batches of epochs 1..
    and the CPU of the trainer process and of ``loader_pids()`` (the processes that load its
    data) in the same windows."""

    def __init__(self, loader_pids: Callable[[], list[int]]) -> None:
        self.loader_pids = loader_pids
        self.images = 0
        self.seconds = 0.0
        self.cpu_self = 0.0
        self.cpu_loader = 0.0
        self._start: tuple[float, float, dict[int, float]] | None = None
        self._last: tuple[float, float, dict[int, float]] | None = None

    def _now(self) -> tuple[float, float, dict[int, float]]:
        loader = {p: cpu_seconds(p) for p in self.loader_pids()}
        return time.perf_counter(), cpu_seconds(os.getpid()), loader

    def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
        self._start = self._now() if trainer.current_epoch >= 1 else None
        self._last = None

    def on_train_batch_end(
        self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._start is not None:
            self.images += len(batch[1])
            self._last = self._now()

    def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
        self._close()

    def on_validation_start(self, trainer: Any, module: Any) -> None:
        self._close()

    def _close(self) -> None:
        if self._start is None or self._last is None:
            return
        (t0, s0, l0), (t1, s1, l1) = self._start, self._last
        self.seconds += t1 - t0
        self.cpu_self += s1 - s0
        self.cpu_loader += sum(v - l0.get(p, 0.0) for p, v in l1.items())
        self._start = self._last = None

    def result(self) -> dict[str, Any]:
        if not self.images:
            raise RuntimeError("no training batch was timed (too few images for an epoch?)")
        return {
            "images": self.images,
            "seconds": self.seconds,
            "images_per_s": self.images / self.seconds,
            "cpu_trainer_s": self.cpu_self,
            "cpu_loader_s": self.cpu_loader,
        }


def timer(loader_pids: Callable[[], list[int]]) -> Timing:
    """``Timing`` as a Lightning callback (Lightning is imported only by the sides)."""
    import pytorch_lightning as pl

    class Timer(Timing, pl.Callback):
        pass

    return Timer(loader_pids)


def rfdetr_side(args: argparse.Namespace) -> dict[str, Any]:
    """RF-DETR's ``model.train(dataset_dir=args.spec)`` path, its ``num_workers`` =
    ``args.workers``, timed."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from pytorch_lightning import Trainer
    from rfdetr import RFDETRNano
    from rfdetr.detr import _prepare_run_config
    from rfdetr.training import RFDETRDataModule, RFDETRModelModule, build_trainer

    model = RFDETRNano(**MODEL)
    with tempfile.TemporaryDirectory(prefix="ds-rfdetr-") as out:
        kw = train_kwargs(args, out)
        kw.update(num_workers=args.workers, persistent_workers=True)
        config, accelerator, devices = _prepare_run_config(model, dataset_dir=args.spec, **kw)
        model._align_num_classes_from_dataset(args.spec)  # (as model.train() does)
        module = RFDETRModelModule(model.model_config, config)
        datamodule = RFDETRDataModule(model.model_config, config)
        trainer_kwargs: dict[str, Any] = {"accelerator": accelerator}
        if devices is not None:
            trainer_kwargs["devices"] = devices
        trainer: Trainer = build_trainer(config, model.model_config, **trainer_kwargs)
        me = os.getpid()
        timing = timer(lambda: child_pids(me))
        # (Lightning's connector sets ``callbacks`` on the Trainer: a plain list)
        trainer.callbacks.append(timing)  # type: ignore[attr-defined]
        trainer.fit(module, datamodule)
    return {**timing.result(), "workers": args.workers}


def service_side(args: argparse.Namespace) -> dict[str, Any]:
    """``train_rfdetr`` on the server at ``args.address``, timed (its CPU with the
    server's)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from rfdetr import RFDETRNano

    from dataserver_client.integrations.rfdetr import train_rfdetr

    model = RFDETRNano(**MODEL)
    pids = [int(p) for p in args.server_pids.split(",") if p]
    me = os.getpid()
    timing = timer(lambda: [*pids, *child_pids(me)])
    with tempfile.TemporaryDirectory(prefix="ds-rfdetr-") as out:
        train_rfdetr(model, args.address, trainer_callbacks=[timing], **train_kwargs(args, out))
    return timing.result()


def fig_rfdetr(args: argparse.Namespace, spec: str, progress: Progress) -> dict[str, Any]:
    """Both trainings, rounds alternating: training images/s, the ratio, and CPU ms per
    image split into the trainer process and its loader."""
    for name in ("rfdetr", "pytorch_lightning"):
        if importlib.util.find_spec(name) is None:
            return {"skipped": f"{name} is not installed (pip install -e '.[rfdetr]')"}
    annotations = Path(spec.split(":", 1)[1])
    count = len(json.loads(annotations.read_text())["images"])
    if count < 2 * args.batch_size:
        raise ValueError(f"--images {count} is under two batches of {args.batch_size}")
    # Epoch 0 the warm-up, then enough epochs for ``--batches`` timed batches.
    epochs = 1 + -(-args.batches // (count // args.batch_size))
    flags = ["--dataset", spec, "--workers", str(args.workers), "--cache-gb", "0"]
    with tempfile.TemporaryDirectory(prefix="dataserver-rfdetr-") as tmp:
        folder = rfdetr_layout(annotations, Path(tmp), args.batch_size)
        with server(flags) as (address, pids):
            runs = rounds(
                args,
                progress,
                {
                    "rfdetr": lambda: run_side("rfdetr_own", args, spec=str(folder), epochs=epochs),
                    "dataserver": lambda: run_side(
                        "rfdetr_service",
                        args,
                        address=address,
                        epochs=epochs,
                        server_pids=",".join(map(str, pids)),
                    ),
                },
            )
    rate = {name: med([r["images_per_s"] for r in out]) for name, out in runs.items()}

    def ms(name: str, key: str) -> float:
        return round(med([1000 * r[key] / r["images"] for r in runs[name]]), 2)

    return {
        "compared": (
            f"RFDETRNano({', '.join(f'{k}={v}' for k, v in MODEL.items())}) on CPU, "
            f"resolution {args.image_size} (a stretch on both sides), batch {args.batch_size}, "
            f"{epochs} epochs (the first untimed), aug_config={{}} and multi_scale=False on "
            f"both, {count} images; RF-DETR's RFDETRDataModule with num_workers="
            f"{args.workers} vs train_rfdetr on a {args.workers}-worker server (--cache-gb 0)"
        ),
        "rfdetr_images_per_s": round(rate["rfdetr"], 2),
        "dataserver_images_per_s": round(rate["dataserver"], 2),
        "vs_rfdetr": round(rate["dataserver"] / rate["rfdetr"], 3),
        "rfdetr_trainer_cpu_ms_per_image": ms("rfdetr", "cpu_trainer_s"),
        "rfdetr_loader_cpu_ms_per_image": ms("rfdetr", "cpu_loader_s"),
        "dataserver_trainer_cpu_ms_per_image": ms("dataserver", "cpu_trainer_s"),
        "dataserver_loader_cpu_ms_per_image": ms("dataserver", "cpu_loader_s"),
    }
