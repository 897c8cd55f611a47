"""A user's dataset with a shared index (issue 35, point 5): ``shared_index`` runs once
per server (in the front) and returns arrays; every process's ``__init__`` receives them
mapped read-only (``index``), so no worker builds or holds its own copy."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from dataserver.data.index import MappedIndex
from dataserver.data.sample import Sample


class SharedLabels:
    """``n`` samples whose labels and boxes live in the server's shared index; each call
    of ``shared_index`` and ``__init__`` appends a line to ``log`` (pid, what)."""

    deterministic = True

    def __init__(self, n: int, log: str, index: MappedIndex | None = None) -> None:
        if index is None:
            raise ValueError("SharedLabels needs the server's shared index")
        self.labels = index.arrays["labels"]
        self.boxes = index.arrays["boxes"]
        if self.labels.flags.writeable or self.boxes.flags.writeable:
            raise ValueError("the shared index must be read-only")
        with open(log, "a") as f:
            f.write(f"init {os.getpid()}\n")

    @classmethod
    def shared_index(cls, n: int, log: str) -> dict[str, Any]:
        with open(log, "a") as f:
            f.write(f"index {os.getpid()}\n")
        i = np.arange(n)
        boxes = np.stack([i % 8, i % 8, i % 8 + 8, i % 8 + 8], axis=1).astype(np.float32)
        return {"labels": (i * 7 % 11).astype(np.int32), "boxes": boxes}

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> Sample:
        image = np.full((32, 32, 3), index % 251, dtype=np.uint8)
        labels = self.labels[index : index + 1].astype(np.int64)
        return Sample(image, self.boxes[index : index + 1].copy(), labels)
