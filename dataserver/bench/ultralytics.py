"""``dataserver bench --only ultralytics``: Ultralytics' own training loader against
``DataServerTrainer``'s at the same work.

Ultralytics' side is its own ``build_yolo_dataset`` + ``build_dataloader`` (2 workers: on a
CPU its trainer would force ``workers=0``, which would flatter us), on a YOLO-format copy of
the bench's COCO set (labels written here, images linked), with its default augmentation
(mosaic, RandomPerspective, HSV, flips; Albumentations' blur/gray/CLAHE at p=0.01 where
albumentations is installed), glibc told to keep large blocks (``keep_large_blocks``) as for
the DataLoader baseline. The service's side is a ``DataServerClient`` as
``DataServerTrainer`` builds it (window mosaic, 114 padding, centred letterbox) against
``dataserver.data.yolo_set`` (the same augmentation after composition, ``YoloAugment``),
each batch converted into the dict Ultralytics' collate makes. Mosaic and regular (close
mosaic), first epoch (Ultralytics reads every image; the service a fresh server each round,
default flags, so every source is decoded once and stored as the user's first epoch does)
and epoch 2+ (Ultralytics ``cache="ram"``; the service with its store, warmed by one untimed
epoch). Each run in a fresh process, sides alternating.

Ultralytics is imported only by the side processes of this figure (an optional extra).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dataserver.bench.common import Progress, med, run_side, server
from dataserver.bench.cpu import WARMUP, timed
from dataserver.server.memory import keep_large_blocks


def yolo_layout(annotations: Path, out: Path) -> Path:
    """A YOLO-format copy of a COCO set: ``out/images/train`` (links to its JPEGs) and
    ``out/labels/train/*.txt`` (``class cx cy w h``, normalized; classes are the sorted
    category ids numbered from 0, as ``DataServerTrainer`` maps them). Returns the images
    folder."""
    doc = json.loads(annotations.read_text())
    classes = {c: i for i, c in enumerate(sorted(int(c["id"]) for c in doc["categories"]))}
    images, labels = out / "images" / "train", out / "labels" / "train"
    images.mkdir(parents=True, exist_ok=True)
    labels.mkdir(parents=True, exist_ok=True)
    rows: dict[int, list[str]] = {}
    sizes = {e["id"]: (e["width"], e["height"]) for e in doc["images"]}
    for ann in doc["annotations"]:
        if ann.get("iscrowd", 0):
            continue
        w, h = sizes[ann["image_id"]]
        x, y, bw, bh = ann["bbox"]
        if bw <= 0 or bh <= 0:
            continue
        cls = classes[int(ann["category_id"])]
        line = f"{cls} {(x + bw / 2) / w:.6f} {(y + bh / 2) / h:.6f} {bw / w:.6f} {bh / h:.6f}"
        rows.setdefault(ann["image_id"], []).append(line)
    for entry in doc["images"]:
        name = Path(entry["file_name"])
        link = images / name.name
        if not link.exists():
            link.symlink_to((annotations.parent / name).resolve())
        (labels / f"{name.stem}.txt").write_text("\n".join(rows.get(entry["id"], [])))
    return images


def ultralytics_side(args: argparse.Namespace) -> dict[str, Any]:
    """Ultralytics' own loader: images/s over ``args.batches`` batches after the warm-up,
    with its workers' CPU."""
    os.environ.setdefault("YOLO_OFFLINE", "1")
    # Its strongest form: glibc keeps large freed blocks for reuse, as the tuned DataLoader
    # baseline and the servers do (the forked workers inherit it), so that no side pays
    # fresh-page faults on every image (docs/DESIGN-NOTES.md, "The DataLoader baseline").
    keep_large_blocks()
    from ultralytics.cfg import get_cfg
    from ultralytics.data.build import build_dataloader, build_yolo_dataset
    from ultralytics.utils import DEFAULT_CFG

    overrides = {"imgsz": args.image_size, "cache": "ram" if args.warm_epochs else False}
    cfg = get_cfg(DEFAULT_CFG, overrides)
    nc = int(args.spec_args or 80)
    data = {"names": {i: f"class{i}" for i in range(nc)}, "nc": nc, "channels": 3}
    dataset = build_yolo_dataset(cfg, args.spec, args.batch_size, data, mode="train")  # type: ignore[arg-type]
    if args.mode == "regular":
        dataset.close_mosaic(hyp=cfg)  # type: ignore[attr-defined]  # as the trainer's close_dataloader_mosaic does
    loader = build_dataloader(dataset, args.batch_size, args.workers, shuffle=True, device="cpu")

    def batches() -> Iterator[int]:
        while True:
            for batch in loader:
                yield len(batch["img"])

    it = batches()
    next(it)  # the workers exist from here on
    pids = [w.pid for w in getattr(loader.iterator, "_workers", [])]
    # Each worker holds prefetch_factor (4) batches made before the clock: in the warm-up.
    out = timed(it, args.batches, pids, warmup=WARMUP + 4 * len(pids))
    out["workers"] = len(pids)
    return out


def service_side(args: argparse.Namespace) -> dict[str, Any]:
    """``DataServerTrainer``'s own training loader (``get_dataloader(mode="train")`` of a
    real trainer, with the hyperparameters it sends) against the server at
    ``args.address``: batches in Ultralytics' collate format."""
    os.environ.setdefault("YOLO_OFFLINE", "1")
    from dataserver_client.integrations.ultralytics import DataServerTrainer

    with tempfile.TemporaryDirectory(prefix="dataserver-yolo-run-") as project:
        overrides = {
            "model": "yolov8n.yaml",
            "data": {"train": args.address, "val": args.address},
            "imgsz": args.image_size,
            "batch": args.batch_size,
            "mosaic": 1.0 if args.mode == "mosaic" else 0.0,
            "project": project,
            "plots": False,
            "verbose": False,
        }
        trainer = DataServerTrainer(overrides=overrides)
        loader = trainer.get_dataloader(args.address, args.batch_size, rank=-1, mode="train")
        try:
            for epoch in range(args.warm_epochs):  # untimed: fill the server's store
                loader.sampler.set_epoch(epoch)
                for _ in loader:
                    pass

            def batches() -> Iterator[int]:
                while True:
                    for batch in loader:
                        yield len(batch["img"])

            pids = [int(p) for p in args.server_pids.split(",") if p]
            return timed(batches(), args.batches, pids)
        finally:
            loader.close()


CASES = (
    ("mosaic", "first_epoch"),
    ("regular", "first_epoch"),
    ("mosaic", "epoch2"),
    ("regular", "epoch2"),
)


def fig_ultralytics(args: argparse.Namespace, spec: str, progress: Progress) -> dict[str, Any]:
    """Both loaders in each of ``CASES``, rounds alternating: images/s and CPU ms per
    image (every process of each side).

    First epoch: a fresh server with default flags each round (its store on, empty), the
    timed window inside the epoch (``--batches`` capped to what the epoch holds after the
    warm-up); Ultralytics reads and decodes every image. Epoch 2: one server whose store
    the side warms with an untimed epoch; Ultralytics ``cache="ram"``."""
    import importlib.util

    if importlib.util.find_spec("ultralytics") is None:
        return {"skipped": "ultralytics is not installed (pip install -e '.[ultralytics]')"}
    annotations = Path(spec.split(":")[1])
    doc = json.loads(annotations.read_text())
    nc, count = len(doc["categories"]), len(doc["images"])
    first_batches = max(1, min(args.batches, count // args.batch_size - WARMUP - 1))
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="dataserver-yolo-") as tmp:
        images = yolo_layout(annotations, Path(tmp))
        flags = ["--dataset", "dataserver.data.yolo_set:yolo_set", "--workers", str(args.workers)]
        flags += ["--dataset-args", json.dumps({"annotations": str(annotations)})]
        for mode, when in CASES:
            warm = int(when == "epoch2")
            batches = args.batches if warm else first_batches
            runs: dict[str, list[dict[str, Any]]] = {"ultralytics": [], "dataserver": []}
            with contextlib.ExitStack() as stack:
                shared = stack.enter_context(server([*flags, "--cache-gb", "2"])) if warm else None
                for r in range(args.rounds):
                    out = run_side(
                        "ultralytics", args, spec=str(images), spec_args=str(nc), mode=mode,
                        warm_epochs=warm, batches=batches,
                    )  # fmt: skip
                    runs["ultralytics"].append(out)
                    progress(
                        f"round {r + 1}: {mode} {when} ultralytics {out['images_per_s']:,.0f}/s"
                    )
                    with contextlib.ExitStack() as fresh:
                        address, pids = shared or fresh.enter_context(server(flags))
                        out = run_side(
                            "yolo_service", args, address=address, mode=mode, warm_epochs=warm,
                            server_pids=",".join(map(str, pids)), batches=batches,
                        )  # fmt: skip
                    runs["dataserver"].append(out)
                    progress(
                        f"round {r + 1}: {mode} {when} dataserver {out['images_per_s']:,.0f}/s"
                    )
            ul = med([o["images_per_s"] for o in runs["ultralytics"]])
            ds = med([o["images_per_s"] for o in runs["dataserver"]])
            result[f"{mode}_{when}"] = {
                "ultralytics_images_per_s": round(ul, 1),
                "dataserver_images_per_s": round(ds, 1),
                "vs_ultralytics": round(ds / ul, 3),
                "ultralytics_cpu_ms_per_image": round(
                    med([_ms(o) for o in runs["ultralytics"]]), 2
                ),
                "dataserver_cpu_ms_per_image": round(med([_ms(o) for o in runs["dataserver"]]), 2),
                "timed_batches": batches,
                "others_cpu_share": max(
                    o.get("others_cpu_share") or 0.0
                    for o in runs["ultralytics"] + runs["dataserver"]
                ),
            }
    return result


def _ms(run: dict[str, Any]) -> float:
    return 1000 * (run["cpu_self_s"] + sum(run["cpu_others_s"])) / run["images"]
