"""File names and original sizes (issue 24, point 5): a sample may carry ``file`` and
``orig_size``; ``batch.files`` and ``batch.orig_sizes`` give the anchor's (first index's)
per output image, in every mode, landed or sent, fresh or from the server's store; the
decoded image's size when the sample gave none; the built-in datasets name their files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pytest
from clients import make_client
from compose_plugins import Meta

from dataserver.data.sample import SampleError, as_sample
from dataserver.data.synthetic import generate
from dataserver_client import Batch, DataServerClient

pytestmark = pytest.mark.timeout(150)

KW: dict[str, Any] = {"timeout": 20.0, "stitch_layout": "mosaic"}


def epochs(client: DataServerClient, n: int) -> list[Batch]:
    """``n`` epochs, the first half of each regular, the rest mosaics."""
    out = []
    for epoch in range(n):
        client.set_epoch(epoch)
        client.set_mode("regular")
        for step, batch in enumerate(client):
            out.append(batch)
            if step == 1:
                client.set_mode("stitch")
    assert {b.mode for b in out} == {"regular", "stitch"}
    return out


@pytest.mark.parametrize("shared_memory", [True, False])
def test_coco_names_its_files_and_sizes(
    start_server: Any, coco_dir: Path, shared_memory: bool
) -> None:
    annotations = coco_dir / "annotations.json"
    doc = json.loads(annotations.read_text())
    by_index = {i: e for i, e in enumerate(doc["images"])}
    server = start_server("--dataset", f"coco:{annotations}", workers=2)
    with make_client(
        server.address, batch_size=4, image_size=(64, 64), shared_memory=shared_memory, **KW
    ) as client:
        for batch in epochs(client, 2):  # (the second epoch from the store)
            assert len(batch.files) == len(batch.orig_sizes) == len(batch)
            for idx, file, size in zip(batch.indices, batch.files, batch.orig_sizes, strict=True):
                entry = by_index[idx[0]]
                assert file == str(coco_dir / entry["file_name"])
                assert size == (entry["height"], entry["width"])
    image = cv2.imread(file)
    assert image is not None and image.shape[:2] == size  # (the JPEG itself)


def test_synthetic_and_a_plugin(start_server: Any) -> None:
    synthetic = start_server("--dataset", "synthetic:images=24,seed=5", workers=1)
    with make_client(synthetic.address, batch_size=4, image_size=(64, 64), **KW) as c:
        for batch in epochs(c, 1):
            for idx, file, size in zip(batch.indices, batch.files, batch.orig_sizes, strict=True):
                assert file == f"{idx[0]:012d}.jpg"
                assert size == generate(5, idx[0]).image.shape[:2]
    plugin = start_server("--dataset", "compose_plugins:meta", workers=2)
    data = Meta(32)
    with make_client(plugin.address, batch_size=4, image_size=(40, 40), **KW) as c:
        for batch in epochs(c, 2):
            for idx, file, size in zip(batch.indices, batch.files, batch.orig_sizes, strict=True):
                h, w = data[idx[0]]["image"].shape[:2]
                assert file == f"flat/{idx[0]}.png"
                assert size == ((2 * h, 2 * w) if idx[0] % 2 == 0 else (h, w))
    flat = start_server("--dataset", "ds_plugins:flat", workers=1)
    with make_client(flat.address, batch_size=4, image_size=(40, 40), **KW) as c:
        batch = next(iter(c))
        assert batch.files == [""] * 4 and all(min(s) > 0 for s in batch.orig_sizes)


@pytest.mark.parametrize(
    ("extra", "problem"),
    [
        ({"file": 7}, "file must be a string"),
        ({"file": "x" * 1025}, "at most 1024"),
        ({"file": "\ud800"}, "UTF-8"),
        ({"orig_size": (0, 5)}, "orig_size"),
        ({"orig_size": (5,)}, "orig_size"),
        ({"orig_size": (5.5, 5)}, "orig_size"),
        ({"orig_size": (True, 5)}, "orig_size"),
    ],
)
def test_bad_file_or_orig_size_is_a_sample_error(extra: dict[str, Any], problem: str) -> None:
    raw = {"image": np.zeros((4, 4, 3), np.uint8), **extra}
    with pytest.raises(SampleError, match=f"sample 3: .*{problem}"):
        as_sample(3, raw)
    ok = as_sample(3, {"image": raw["image"], "file": "a.jpg", "orig_size": np.array([8, 9])})
    assert (ok.file, ok.orig_size) == ("a.jpg", (8, 9))
