"""``BatchSizes``: the three sizes of one batch, as one value from the client's plan to the
server's pipeline.

A batch's images involve three (h, w) sizes, each with one name here:

- ``out``: the size each output image is delivered at (the batch's tensors, the landing
  bytes, the canvas a worker composes into). The batch's image size, except under the
  "batch" stitch layout, where each output image is one grid cell of it.
- ``fit``: the batch's image size (the client's ``image_size`` at that step, ``augment``'s
  ``params["image_size"]``): every source is fitted into it before ``augment``, and an
  augmented sample may be no larger.
- ``stored``: the size every source is fitted to first, as the server's store keeps it
  (the size schedule's largest size; a batch manifest's ``source_size``). Never smaller
  than ``fit``.

The public names stay where they are: ``image_size`` (the client's configuration and
``Batch``), the manifest's ``source_size``, and the TASK's wire fields ``out_hw``,
``fit_hw`` and ``source_hw`` (absent when the stored size is the fit size), which
``wire`` and ``BatchSizes.of`` translate so the bytes on the wire are unchanged. Not to be
mistaken for the client's size *schedules* (``dataserver_client.plan.sizes``: the image size
of each step).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


def _hw(value: Sequence[int]) -> tuple[int, int]:
    return int(value[0]), int(value[1])


@dataclass(frozen=True, slots=True)
class BatchSizes:
    """The output, fit and stored sizes of one batch (each (h, w); see the module)."""

    out: tuple[int, int]
    fit: tuple[int, int]
    stored: tuple[int, int]

    @classmethod
    def of(
        cls,
        out: Sequence[int],
        fit: Sequence[int] | None = None,
        stored: Sequence[int] | None = None,
    ) -> BatchSizes:
        """The sizes as plain int pairs; ``fit`` none: ``out``; ``stored`` none: ``fit``."""
        out_size = _hw(out)
        fit_size = out_size if fit is None else _hw(fit)
        return cls(out_size, fit_size, fit_size if stored is None else _hw(stored))

    @property
    def image_bytes(self) -> int:
        """The bytes of one output image (3 x h x w, uint8)."""
        return 3 * self.out[0] * self.out[1]

    def wire(self) -> dict[str, Any]:
        """The TASK fields that carry these sizes: ``source_hw`` only when the stored size
        is not the fit size (as every client has sent it)."""
        return {
            "out_hw": self.out,
            "fit_hw": self.fit,
            "source_hw": None if self.stored == self.fit else self.stored,
        }
