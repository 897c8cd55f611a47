"""``dataserver bench --only augment``: a trainer's own Albumentations pipeline run by the
servers' workers vs by the tuned DataLoader's workers.

Both sides run ``dataserver.data.albu:augmented`` over the bench's data (affine, photometric
jitter, blur: an ``A.Compose`` with ``bbox_params``, seeded from (seed, epoch, index)), the
same image code (``dataserver.data.pipeline``: the DataLoader's ``PipelineDataset`` runs
``compose_one``, which calls the dataset's ``augment``), as many workers, alternating
rounds. The server runs without its store, so both sides decode and augment every image;
``stored_*`` is epoch 2 onward with the store on (sources from the store, every image
augmented anew).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from typing import Any

DATASET = "dataserver.data.albu:augmented"


def fig_augment(args: argparse.Namespace, spec: str, progress: Any) -> dict[str, Any]:
    """images/s and CPU per image of the Albumentations pipeline: dataserver (store off,
    and store on from epoch 2) vs the tuned DataLoader(num_workers=W)."""
    from dataserver.bench.common import _per_image_ms, med, rounds, run_side, served, server

    if importlib.util.find_spec("albumentations") is None:
        return {"skipped": 'albumentations is not installed (pip install "dataserver[augment]")'}
    dataset_args = json.dumps({"base": spec})
    flags = ["--dataset", DATASET, "--dataset-args", dataset_args, "--workers", str(args.workers)]
    with (
        server([*flags, "--cache-gb", "0"]) as (address, pids),
        server([*flags, "--cache-gb", "2"]) as (stored_address, stored_pids),
    ):
        runs = rounds(
            args,
            progress,
            {
                "dataserver": lambda: served(args, address, pids),
                "dataloader": lambda: run_side(
                    "dataloader", args, spec=DATASET, spec_args=dataset_args
                ),
                "dataserver_stored": lambda: served(
                    args, stored_address, stored_pids, warm_epochs=1
                ),
            },
        )
    rate = {name: med([r["images_per_s"] for r in runs[name]]) for name in runs}
    cpu = {name: med([_per_image_ms(r) for r in runs[name]]) for name in runs}
    return {
        "dataserver_images_per_s": round(rate["dataserver"], 1),
        "dataloader_images_per_s": round(rate["dataloader"], 1),
        "vs_dataloader": round(rate["dataserver"] / rate["dataloader"], 3),
        "stored_images_per_s": round(rate["dataserver_stored"], 1),
        "stored_vs_dataloader": round(rate["dataserver_stored"] / rate["dataloader"], 3),
        "cpu_ms_per_image_dataserver": round(cpu["dataserver"], 2),
        "cpu_ms_per_image_dataloader": round(cpu["dataloader"], 2),
        "cpu_ms_per_image_stored": round(cpu["dataserver_stored"], 2),
        "rounds_images_per_s": {
            name: [round(r["images_per_s"], 1) for r in outs] for name, outs in runs.items()
        },
        "pipeline": "dataserver.data.albu.detection_pipeline: Affine(scale 0.75-1.25, translate "
        "10%), RandomBrightnessContrast, HueSaturationValue, OneOf(Blur, MedianBlur), ToGray",
    }
