"""``dataserver bench --only transformers``: the Hugging Face object-detection guide's
DataLoader against ``DataServerTrainer``'s training loader at the same work.

The guide's side: a torch ``Dataset`` over the bench's COCO set (decoded by the same reader
the servers use), its Albumentations pipeline (``A.Perspective(p=0.1)``,
``A.HorizontalFlip(p=0.5)``, ``A.RandomBrightnessContrast(p=0.5)``,
``A.HueSaturationValue(p=0.1)``, COCO boxes clipped, ``min_area=25``) and the RT-DETR image
processor (``size`` the bench's image size, a stretch, rescaled to floats) in each of its
``num_workers`` workers, the guide's collate (``pixel_values`` stacked, ``labels`` a list).
The service's side: a server of the same set with the same Albumentations transforms as its
dataset's ``augment`` (``GuideAugmented``; the flip is the servers' own), ``fit="stretch"``,
as many workers, and ``DataServerTrainer``'s loader (``ServedLoader`` + ``Prepare``: the
processor's rescale on the trainer, its labels), both yielding what the model takes. The
servers resize before augmenting where the guide augments the original: the same transforms
on images of about the same size. Each run in a fresh process, sides alternating, three
rounds, medians; CPU counted over every process of each side.

transformers is imported only by the side processes (an optional extra).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from collections.abc import Iterator
from typing import Any

from dataserver.bench.common import Progress, med, rounds, run_side, server
from dataserver.bench.cpu import WARMUP, timed
from dataserver.data.albu import AugmentedDataset, import_albumentations

DATASET = "dataserver.bench.transformers:guide_augmented"


def guide_transforms(flip: bool, box_format: str, labels: str) -> Any:
    """The guide's ``A.Compose`` (``flip``: with its ``HorizontalFlip``)."""
    A = import_albumentations()
    steps = [A.Perspective(p=0.1)]
    if flip:
        steps.append(A.HorizontalFlip(p=0.5))
    steps += [A.RandomBrightnessContrast(p=0.5), A.HueSaturationValue(p=0.1)]
    params = A.BboxParams(format=box_format, label_fields=[labels], clip=True, min_area=25)
    return A.Compose(steps, bbox_params=params)


class GuideAugmented(AugmentedDataset):
    """The guide's transforms as a dataset's ``augment`` (xyxy boxes; no flip: the servers
    mirror about half of the images themselves)."""

    def pipeline(self) -> Any:
        if self._compose is None:
            self._compose = guide_transforms(False, "pascal_voc", "labels")
        return self._compose


def guide_augmented(base: str = "synthetic") -> GuideAugmented:
    """``--dataset dataserver.bench.transformers:guide_augmented --dataset-args '{"base":
    SPEC}'``."""
    return GuideAugmented(base)


def guide_side(args: argparse.Namespace) -> dict[str, Any]:
    """The guide's DataLoader: images/s over ``args.batches`` batches after the warm-up, with
    its workers' CPU."""
    import numpy as np
    import torch
    from transformers import RTDetrImageProcessor

    from dataserver.data.spec import build_dataset, parse_spec
    from dataserver.server.memory import keep_large_blocks

    keep_large_blocks()  # (as for the DataLoader baseline: its strongest form)
    base = build_dataset(parse_spec(args.spec, None))
    size = int(args.image_size)
    processor = RTDetrImageProcessor(size={"height": size, "width": size})
    transforms = guide_transforms(True, "coco", "category")

    class GuideDataset(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return len(base)

        def __getitem__(self, index: int) -> dict[str, Any]:
            sample = base[index]
            boxes = np.asarray(sample.boxes, np.float32).reshape(-1, 4).copy()
            boxes[:, 2:] -= boxes[:, :2]  # (COCO's xywh, as the guide's data has them)
            out = transforms(image=sample.image, bboxes=boxes, category=sample.labels)
            annotations = [
                {"image_id": index, "category_id": int(c), "bbox": list(map(float, b)),
                 "iscrowd": 0, "area": float(b[2] * b[3])}
                for b, c in zip(out["bboxes"], out["category"], strict=True)
            ]  # fmt: skip
            result = processor(
                images=out["image"],
                annotations={"image_id": index, "annotations": annotations},  # type: ignore[call-arg]
                return_tensors="pt",
            )
            return {"pixel_values": result["pixel_values"][0], "labels": result["labels"][0]}

    def collate(batch: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "pixel_values": torch.stack([x["pixel_values"] for x in batch]),
            "labels": [x["labels"] for x in batch],
        }

    loader = torch.utils.data.DataLoader(
        GuideDataset(),
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.workers,
        collate_fn=collate,
        persistent_workers=True,
    )

    def batches() -> Iterator[int]:
        while True:
            for batch in loader:
                yield len(batch["pixel_values"])

    it = batches()
    next(it)  # the workers exist from here on
    pids = [w.pid for w in getattr(loader._iterator, "_workers", [])]
    out = timed(it, args.batches, pids, warmup=WARMUP + 2 * len(pids))
    out["workers"] = len(pids)
    return out


def service_side(args: argparse.Namespace) -> dict[str, Any]:
    """``DataServerTrainer``'s training loader (its client and ``Prepare``) against the
    server at ``args.address``: the model's inputs, as the guide's collate makes them."""
    from transformers import RTDetrImageProcessor

    from dataserver_client import DataServerClient
    from dataserver_client.integrations.transformers import Prepare, ServedLoader

    size = int(args.image_size)
    processor = RTDetrImageProcessor(size={"height": size, "width": size})
    client = DataServerClient(
        args.address, batch_size=args.batch_size, image_size=(size, size), fit="stretch"
    )
    loader = ServedLoader(client, Prepare(processor, client.categories, "stretch"), train=True)
    try:

        def batches() -> Iterator[int]:
            epoch = 0
            while True:
                loader.set_epoch(epoch)
                for batch in loader:
                    yield len(batch["pixel_values"])
                epoch += 1

        pids = [int(p) for p in args.server_pids.split(",") if p]
        return timed(batches(), args.batches, pids)
    finally:
        client.close()


def fig_transformers(args: argparse.Namespace, spec: str, progress: Progress) -> dict[str, Any]:
    """Both loaders, rounds alternating: images/s and CPU ms per image (every process of
    each side). The server runs without its store (``--cache-gb 0``), so both sides decode
    every image, as the guide's loader does in every epoch."""
    for name in ("transformers", "albumentations"):
        if importlib.util.find_spec(name) is None:
            return {
                "skipped": f"{name} is not installed (pip install -e '.[transformers,augment]')"
            }
    flags = ["--dataset", DATASET, "--dataset-args", json.dumps({"base": spec})]
    flags += ["--workers", str(args.workers), "--cache-gb", "0"]
    with server(flags) as (address, pids):
        runs = rounds(
            args,
            progress,
            {
                "guide": lambda: run_side("hf_guide", args, spec=spec),
                "dataserver": lambda: run_side(
                    "hf_service", args, address=address, server_pids=",".join(map(str, pids))
                ),
            },
        )
    rate = {name: med([r["images_per_s"] for r in out]) for name, out in runs.items()}
    cpu = {name: med([_ms(r) for r in out]) for name, out in runs.items()}
    return {
        "guide_images_per_s": round(rate["guide"], 1),
        "dataserver_images_per_s": round(rate["dataserver"], 1),
        "vs_guide": round(rate["dataserver"] / rate["guide"], 3),
        "guide_cpu_ms_per_image": round(cpu["guide"], 2),
        "dataserver_cpu_ms_per_image": round(cpu["dataserver"], 2),
        "others_cpu_share": max(
            r.get("others_cpu_share") or 0.0 for out in runs.values() for r in out
        ),
    }


def _ms(run: dict[str, Any]) -> float:
    return 1000 * (run["cpu_self_s"] + sum(run["cpu_others_s"])) / run["images"]
