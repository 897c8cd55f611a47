"""Your own Albumentations pipeline run by the servers' workers, as a dataset's ``augment``.

    pip install -e ".[augment]"
    python examples/augment_albumentations.py                  # starts its own server
    dataserver serve --dataset augment_albumentations:dataset   # (from examples/), then
    python examples/augment_albumentations.py --address tcp://127.0.0.1:5555

``__getitem__`` reads the sample (deterministic: the server's store may keep it); ``augment``
runs an ``A.Compose`` with ``bbox_params`` on it every epoch anew, seeded from the server's
``rng`` (a function of (seed, epoch, index) only), so batches are bit-identical on any
number of workers and servers. The servers import this module: keep torch (and
``dataserver_client``) out of its top level, and import albumentations with
``import_albumentations`` (without ``albumentations.pytorch``, which loads torch).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from pathlib import Path
from typing import Any

import cv2
import numpy as np

from dataserver.data.albu import import_albumentations
from dataserver.data.synthetic import SyntheticDataset


class AlbumentationsDataset:
    deterministic = True  # __getitem__ is a pure function of the index

    def __init__(self, images: int = 256) -> None:
        self.base = SyntheticDataset(images)  # your data: {"image", "boxes" xyxy, "labels"}
        self.compose: Any = None  # built on first use, in each worker

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int) -> Any:
        return self.base[index]

    def augment(self, sample: dict[str, Any], rng: np.random.Generator, params: dict) -> dict:
        if self.compose is None:
            A = import_albumentations()
            self.compose = A.Compose(
                [
                    A.Affine(  # keeps the image's size: within params["image_size"]
                        scale=(0.75, 1.25),
                        translate_percent=(-0.1, 0.1),
                        border_mode=cv2.BORDER_CONSTANT,
                        fill=0,
                        p=0.8,
                    ),
                    A.RandomBrightnessContrast(p=0.5),
                    A.HueSaturationValue(p=0.5),
                ],
                bbox_params=A.BboxParams(format="pascal_voc", label_fields=["labels"], clip=True),
            )
        # Every transform draws from the server's rng (not Compose(seed=...), which gives
        # each transform its own generator with the same seed).
        self.compose.set_random_state(rng, random.Random(int(rng.integers(1 << 63))))
        out = self.compose(image=sample["image"], bboxes=sample["boxes"], labels=sample["labels"])
        return {"image": out["image"], "boxes": out["bboxes"], "labels": out["labels"]}


def dataset(images: int = 256) -> AlbumentationsDataset:
    return AlbumentationsDataset(images)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--address", default=None, help="a running server (default: start one)")
    parser.add_argument("--workers", type=int, default=2, help="workers of the local server")
    parser.add_argument("--batches", type=int, default=3, help="batches per epoch shown")
    parser.add_argument("--image-size", type=int, default=320)
    args = parser.parse_args()
    from dataserver.demo import start_server, stop_server
    from dataserver_client import DataServerClient  # (torch: the trainer's side only)

    proc = None
    address = args.address
    if address is None:  # the server imports this file as the module augment_albumentations
        here = str(Path(__file__).resolve().parent)
        os.environ["PYTHONPATH"] = os.pathsep.join(
            filter(None, [here, os.environ.get("PYTHONPATH")])
        )
        spec = f"{Path(__file__).stem}:dataset"
        proc, address = start_server(["--dataset", spec, "--workers", str(args.workers)])
    size = (args.image_size, args.image_size)
    try:
        with DataServerClient(address, batch_size=8, image_size=size, device="cpu") as client:
            for epoch in (0, 1):  # a new order, and every sample augmented anew
                client.set_epoch(epoch)
                for _, batch in zip(range(args.batches), client, strict=False):
                    boxes = [len(t["boxes"]) for t in batch.targets]
                    print(
                        f"epoch {epoch} step {batch.step}: images {tuple(batch.images.shape)} "
                        f"{batch.images.dtype}, boxes per image {boxes}, "
                        f"indices {[i for idx in batch.indices for i in idx]}"
                    )
    finally:
        if proc is not None:
            stop_server(proc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
