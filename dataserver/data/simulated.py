"""A dataset whose samples cost a fixed time and no CPU: for measuring coordination.

    dataserver serve --dataset dataserver.data.simulated:simulated \\
        --dataset-args '{"n": 4096, "ms": 10, "size": 32}'

Each sample sleeps ``ms`` milliseconds, then returns a flat ``size`` x ``size`` image with one
box, so a pool of W workers can deliver at most W x 1000 / ms samples per second whatever
the machine's cores: the gap to that is the system's own overhead.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from dataserver.hashing import MASK64, mix64


class Simulated:
    deterministic = True  # __getitem__ is a pure function of the index

    def __init__(self, n: int, ms: float, size: int) -> None:
        self.n, self.seconds, self.size = n, ms / 1000.0, size

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, Any]:
        if self.seconds > 0:  # (sleep(0) is a system call: "costs nothing" means nothing)
            time.sleep(self.seconds)
        image = np.full((self.size, self.size, 3), index % 256, dtype=np.uint8)
        box = np.array([[1, 1, self.size - 1, self.size - 1]], dtype=np.float32)
        return {"image": image, "boxes": box, "labels": np.array([1 + index % 80])}


def simulated(n: int = 4096, ms: float = 10.0, size: int = 32) -> Simulated:
    """The factory ``--dataset dataserver.data.simulated:simulated`` names."""
    return Simulated(n, ms, size)


class Predecoded:
    """``n`` ready RGB images of ``size`` x ``size`` held in memory: no file, no decode, so
    what is measured is moving pixels, not making them."""

    deterministic = True  # __getitem__ is a pure function of the index

    def __init__(self, n: int, size: int) -> None:
        rng = np.random.default_rng(0)
        self.images = [rng.integers(0, 256, (size, size, 3), dtype=np.uint8) for _ in range(n)]
        self.box = np.array([[0, 0, size / 2, size / 2]], dtype=np.float32)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"image": self.images[index], "boxes": self.box, "labels": np.array([1])}


def predecoded(n: int = 64, size: int = 512) -> Predecoded:
    """The factory ``--dataset dataserver.data.simulated:predecoded`` names."""
    return Predecoded(n, size)


class Held(Simulated):
    """``Simulated``'s samples, some held ``hold_ms`` longer (a share ``share`` of them, by
    a hash of the index; 1.0: every one): a slow but correct server, whose answers are the
    same as a healthy one's (the fingerprint leaves the costs out, so a held server and a
    healthy one serve one session together). An overloaded node, a congested disk."""

    def __init__(self, n: int, ms: float, size: int, hold_ms: float, share: float) -> None:
        super().__init__(n, ms, size)
        if hold_ms < 0 or not 0.0 <= share <= 1.0:
            raise ValueError(
                f"held: hold_ms must be >= 0 and share in [0, 1], got {hold_ms}, {share}"
            )
        self.hold, self.share = hold_ms / 1000.0, share
        self.fingerprint = f"{n}-{size}"

    def __getitem__(self, index: int) -> dict[str, Any]:
        if self.hold > 0 and mix64(index) < self.share * MASK64:
            time.sleep(self.hold)
        return super().__getitem__(index)


def held(
    n: int = 4096, ms: float = 10.0, size: int = 32, hold_ms: float = 0.0, share: float = 1.0
) -> Held:
    """The factory ``--dataset dataserver.data.simulated:held`` names."""
    return Held(n, ms, size, hold_ms, share)
