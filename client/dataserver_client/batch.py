"""The batch a ``DataServerClient`` yields."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


def content_mask(
    content: list[tuple[int, int, int, int]],
    height: int,
    width: int,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """int64 (N, height, width): 1 inside each image's (top, left, h, w) box, 0 outside
    (DETR's ``pixel_mask``)."""
    rows = torch.arange(height, device=device)
    cols = torch.arange(width, device=device)
    boxes = torch.tensor(content, dtype=torch.int64, device=device).reshape(-1, 4)
    top, left, h, w = (boxes[:, i, None] for i in range(4))
    inside_y = (rows[None] >= top) & (rows[None] < top + h)
    inside_x = (cols[None] >= left) & (cols[None] < left + w)
    return (inside_y[:, :, None] & inside_x[:, None, :]).to(torch.int64)


@dataclass
class Batch:
    """One training batch.

    - ``images``: uint8 (N, 3, H, W) RGB on the client's device. Regular mode: one letterboxed
      sample per image. Spatial stitch: each image a sqrt(k) x sqrt(k) grid of samples.
      Batch stitch: (k * N, 3, H / sqrt(k), W / sqrt(k)).
    - ``targets``: one dict per image, ``{"boxes": float32 (M, 4) xyxy output pixels,
      "labels": int64 (M,)}`` (torchvision detection format), on the same device.
    - ``indices``: one list per image of the dataset indices it was made from, in cell order.
    - ``mode``: "regular" or "stitch"; ``epoch``; ``step`` (batch number in the epoch);
      ``feedback_seq``: how many feedback/set_mode/control calls this batch honours.
    - ``skipped``: samples left out under ``on_error="skip"``.
    - ``image_size``: (h, w) the batch was made at (its images' size; with
      ``stitch_layout="batch"``, the size before the stitched images were cut in k).
    - ``manifest``: plain data naming the batch completely (epoch, step, mode, image size,
      indices, control values, seed, ...): ``client.rebuild(manifest)`` makes it again,
      bit-identical, from any client of servers with the same dataset.
    - ``partners``: True for a window mosaic batch (``mosaic_partners="window"``, stitched):
      ``indices[i][0]`` is image i's anchor, the one sample it consumes, and the rest its
      partners (drawn from the samples before it; not consumed); an image of one index
      is its anchor alone (``mosaic_p``), a regular image. ``skipped`` then counts anchors.
    - ``files``: one per image, the file its anchor (first index) was read from, as the
      sample named it ("" when it named none); ``orig_sizes``: one (h, w) per image, the
      anchor's size as read, before any resize (the sample's ``orig_size``, else the
      decoded image's; (0, 0) when the server did not say).
    - ``content``: one ``(top, left, height, width)`` per image: where its picture lies in
      its canvas (a regular image's letterbox; the whole canvas for a stretched image, a
      stitched or mosaic image, or one through the dataset's ``augment_composed``, and when
      the server did not say). Every pixel outside it is ``pad_value``. The padding mask
      (1: picture, 0: padding), as DETR-family models take it: ``mask()`` (or
      ``content_mask(batch.content, h, w)``). The box (top, left, h, w) and the original
      size (``orig_sizes``) map boxes back to original pixels:
      ``x_orig = (x - left) * orig_w / width``, likewise y.
    """

    images: torch.Tensor
    targets: list[dict[str, torch.Tensor]]
    indices: list[list[int]]
    mode: str
    epoch: int
    step: int
    feedback_seq: int
    skipped: int = 0
    skipped_indices: list[int] = field(default_factory=list)
    image_size: tuple[int, int] = (0, 0)
    manifest: dict[str, Any] = field(default_factory=dict)
    partners: bool = False
    files: list[str] = field(default_factory=list)
    orig_sizes: list[tuple[int, int]] = field(default_factory=list)
    content: list[tuple[int, int, int, int]] = field(default_factory=list)

    def mask(self) -> torch.Tensor:
        """The padding mask of ``images``: int64 (N, H, W) on their device, 1 where a
        picture lies (``content``), 0 on padding."""
        height, width = int(self.images.shape[-2]), int(self.images.shape[-1])
        return content_mask(self.content, height, width, self.images.device)

    def __len__(self) -> int:
        return int(self.images.shape[0])

    @property
    def num_samples(self) -> int:
        """Dataset samples this batch consumes: its images' indices (a stitched image holds
        up to k), or, with ``partners``, its anchors (one an image)."""
        if self.partners:
            return len(self.indices)
        return sum(len(i) for i in self.indices)
