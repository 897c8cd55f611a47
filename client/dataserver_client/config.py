"""The client's configuration, checked once."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import torch

from dataserver.endpoint import endpoint_problem
from dataserver.protocol import MAX_IMAGE_SIDE, MAX_INT
from dataserver_client.plan.epoch import FITS, LAYOUTS, LETTERBOXES, Layout
from dataserver_client.plan.partners import PARTNER_MODES, WINDOW
from dataserver_client.plan.sizes import SizeSchedule, schedule_of

# The most samples a server may announce (WELCOME's dataset_len) before the client refuses
# it (docs/contract.md: "``max_dataset_len=2**40``"). The epoch order is computed per position
# (order.py), so a claim costs no memory; what the bound still guards is a server announcing
# an absurd size by mistake. A dataset beyond it: raise ``max_dataset_len``, up to what the
# protocol carries at all (WELCOME_MAX_DATASET_LEN; a legacy state's epoch, in the order of
# then, is still built whole: 4 bytes a sample up to 2**31, 8 beyond).
MAX_DATASET_LEN = 1 << 40
WELCOME_MAX_DATASET_LEN = 1 << 48  # what the protocol carries at all


@dataclass(frozen=True)
class ClientConfig:
    """Everything ``DataServerClient(...)`` is given; see its docstring."""

    addresses: tuple[str, ...]
    batch_size: int = 16
    image_size: SizeSchedule | tuple[int, int] = (512, 512)  # a SizeSchedule once built
    shuffle: bool = True
    seed: int = 0
    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    drop_last: bool = False
    stitch_k: int = 4
    stitch_layout: str = "spatial"
    stitch_threshold: float = 0.1
    on_error: str = "raise"
    timeout: float = 30.0
    prefetch: int = 4
    heartbeat_interval: float = 0.5
    heartbeat_timeout: float = 3.0
    shared_memory: bool = True  # workers on this host may write batches straight into memory
    lookahead: bool = True  # prepare the next batch in the other mode too (zero-stall flips)
    discovery_interval: float = 5.0  # seconds between re-resolutions of DNS names (0: once)
    metrics_port: int | None = None  # serve the client's metrics (Prometheus) on this port
    max_dataset_len: int = MAX_DATASET_LEN  # refuse servers announcing more samples
    pad_value: int = 0  # every pixel no sample covers (114 for YOLO)
    letterbox: str = "top-left"  # where a regular image sits in its canvas: or "center"
    fit: str = "letterbox"  # how a source is fitted into its cell: or "stretch"
    augment: bool = True  # False: no flip, no dataset augment (a validation client)
    mosaic_partners: str = "consume"  # "window": YOLO's mosaic, each sample an anchor
    mosaic_p: float = 1.0  # with "window": the probability, per output, of a mosaic
    hedge: bool = True  # a slow server's tasks are hedged to another, outliers set aside

    def __post_init__(self) -> None:
        # (h, w) given as a pair becomes a FixedSize: every reader sees one schedule type
        object.__setattr__(self, "image_size", schedule_of(self.image_size))

    @property
    def sizes(self) -> SizeSchedule:
        """The size schedule the client was built with."""
        return schedule_of(self.image_size)  # (itself: normalised when built)

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first setting that is out of range."""
        problem = (
            self._address_problem()
            or self._image_problem()
            or self._run_problem()
            or self._compose_problem()
        )
        if problem is not None:
            raise ValueError(f"DataServerClient: {problem}")

    def _address_problem(self) -> str | None:
        if not self.addresses:
            return "give at least one server address"
        for addr in self.addresses:
            if addr.startswith("ray://"):  # a Ray data tier: dataserver_client.integrations.ray
                if not re.fullmatch(r"ray://[A-Za-z0-9_.\-]+", addr):
                    return f"server address {addr!r}: a Ray data tier is ray://NAME"
            elif not addr.startswith(("tcp://", "ipc://")):
                return f"server address {addr!r} is not tcp://HOST:PORT, ipc://PATH or ray://NAME"
            elif (problem := endpoint_problem(addr)) is not None:
                return f"server address {addr!r}: {problem}"
        return None

    def _image_problem(self) -> str | None:
        if self.batch_size < 1:
            return f"batch_size must be >= 1, got {self.batch_size}"
        side = math.isqrt(self.stitch_k)
        if self.stitch_k < 1 or side * side != self.stitch_k or side > 4:
            return f"stitch_k must be a square (1, 4, 9 or 16), got {self.stitch_k}"
        if self.stitch_layout not in LAYOUTS:
            return f"stitch_layout must be one of {', '.join(LAYOUTS)}, got {self.stitch_layout!r}"
        if self.stitch_layout == "mosaic" and self.stitch_k != 4:
            return (
                f"stitch_layout='mosaic' takes 4 samples an image: stitch_k=4, got {self.stitch_k}"
            )
        problem = self._partners_problem()
        if problem is not None:
            return problem
        return size_problem(self.sizes, side)

    def _run_problem(self) -> str | None:
        if not 0 <= self.seed <= MAX_INT:
            return f"seed must be in 0..2**63-1, got {self.seed}"
        if self.on_error not in ("raise", "skip"):
            return f"on_error must be 'raise' or 'skip', got {self.on_error!r}"
        if not 0 <= self.rank < self.world_size:
            return f"rank {self.rank} is not in 0..world_size-1 (world_size {self.world_size})"
        if self.timeout <= 0:
            return f"timeout must be > 0, got {self.timeout}"
        if self.prefetch < 1:
            return f"prefetch must be >= 1, got {self.prefetch}"
        if not (self.discovery_interval >= 0 and math.isfinite(self.discovery_interval)):
            return f"discovery_interval must be >= 0 seconds, got {self.discovery_interval}"
        if not 1 <= self.max_dataset_len <= WELCOME_MAX_DATASET_LEN:
            return f"max_dataset_len must be in 1..2**48, got {self.max_dataset_len}"
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            return f"metrics_port must be a TCP port (0..65535), got {self.metrics_port}"
        return None

    def _compose_problem(self) -> str | None:
        pad = self.pad_value
        if isinstance(pad, bool) or not isinstance(pad, int) or not 0 <= pad <= 255:
            return f"pad_value must be an integer in 0..255, got {pad!r}"
        if self.letterbox not in LETTERBOXES:
            return f"letterbox must be one of {', '.join(LETTERBOXES)}, got {self.letterbox!r}"
        if self.fit not in FITS:
            return f"fit must be one of {', '.join(FITS)}, got {self.fit!r}"
        if not isinstance(self.augment, bool):
            return f"augment must be True or False, got {self.augment!r}"
        return None

    def _partners_problem(self) -> str | None:
        partners, p = self.mosaic_partners, self.mosaic_p
        if partners not in PARTNER_MODES:
            return f"mosaic_partners must be 'consume' or 'window', got {partners!r}"
        if partners == WINDOW and self.stitch_layout != "mosaic":
            layout = self.stitch_layout
            return f"mosaic_partners='window' needs stitch_layout='mosaic', got {layout!r}"
        if isinstance(p, bool) or not isinstance(p, int | float) or not 0.0 <= p <= 1.0:
            return f"mosaic_p must be a probability in [0, 1], got {p!r}"
        if p != 1.0 and partners != WINDOW:
            return f"mosaic_p={p!r} needs mosaic_partners='window' (a per-output probability)"
        return None

    def layout(self) -> Layout:
        return Layout(
            self.batch_size,
            self.image_size,
            self.stitch_k,
            self.stitch_layout,
            self.drop_last,
            pad_value=self.pad_value,
            letterbox=self.letterbox,
            fit=self.fit,
            augment=self.augment,
            mosaic_partners=self.mosaic_partners,
            mosaic_p=float(self.mosaic_p),
        )


def size_problem(sizes: SizeSchedule, grid: int) -> str | None:
    """What is wrong with every size of ``sizes`` for a grid of ``grid`` cells a side."""
    for h, w in sizes.sizes:
        if max(h, w) > MAX_IMAGE_SIDE:
            return f"image size {(h, w)} exceeds {MAX_IMAGE_SIDE} pixels a side"
        if min(h, w) < grid:
            return f"image size {(h, w)} is too small for a {grid}x{grid} stitch"
    return None


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The device batches go to: ``device``, or "cuda" when available, else "cpu". A CUDA
    device without an index is pinned to the caller's current device now, because the
    client's I/O thread would otherwise see device 0 (each thread has its own current
    device), which is wrong for every rank but the first."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    resolved = torch.device(device)
    if resolved.type == "cuda" and resolved.index is None:
        resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved
