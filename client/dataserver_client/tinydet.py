"""A small, real single-stage detector for the demo and the example on CPU.

FCOS-like on one level: a 4-conv backbone of stride 8; every feature cell predicts an
objectness logit and a box as (l, t, r, b) distances from its centre. Each ground-truth box
is assigned to the cell that holds its centre. The per-match regression loss (L1 on log
distances) is what Stitcher's ratio is computed from.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dataserver_client.stitcher import small_object_loss_ratio

STRIDE = 8


class TinyDetector(nn.Module):
    """Input uint8 (N, 3, H, W); ``loss(images, targets)`` returns (loss, small_ratio)."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        chans = [3, width // 2, width, width, width]
        layers: list[nn.Module] = []
        for i in range(4):
            stride = 2 if i < 3 else 1
            layers += [
                nn.Conv2d(chans[i], chans[i + 1], 3, stride, 1),
                nn.BatchNorm2d(chans[i + 1]),
                nn.ReLU(),
            ]
        self.backbone = nn.Sequential(*layers)
        self.head = nn.Conv2d(width, 5, 1)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = images.float().div_(255.0)  # uint8 stays uint8 until it is on the device
        return self.head(self.backbone(x))

    def loss(
        self, images: torch.Tensor, targets: list[dict[str, torch.Tensor]]
    ) -> tuple[torch.Tensor, float]:
        """(loss, Stitcher's small-object ratio) of ``images`` against ``targets``."""
        return self.loss_of(self(images), targets)

    @staticmethod
    def loss_of(
        out: torch.Tensor, targets: list[dict[str, torch.Tensor]]
    ) -> tuple[torch.Tensor, float]:
        """``loss`` from the model's output ``out``: what a step computes when the forward
        ran through a wrapper (``DistributedDataParallel``, whose forward is what makes the
        backward pass average the gradients over ranks)."""
        n, _, fh, fw = out.shape
        obj_target = torch.zeros((n, fh, fw), device=out.device)
        reg_losses, areas = [], []
        for i, t in enumerate(targets):
            boxes = t["boxes"].to(out.device)
            if len(boxes) == 0:
                continue
            cx = ((boxes[:, 0] + boxes[:, 2]) / 2 / STRIDE).long().clamp(0, fw - 1)
            cy = ((boxes[:, 1] + boxes[:, 3]) / 2 / STRIDE).long().clamp(0, fh - 1)
            obj_target[i, cy, cx] = 1.0
            centre_x = (cx.float() + 0.5) * STRIDE
            centre_y = (cy.float() + 0.5) * STRIDE
            ltrb = torch.stack(
                [
                    centre_x - boxes[:, 0],
                    centre_y - boxes[:, 1],
                    boxes[:, 2] - centre_x,
                    boxes[:, 3] - centre_y,
                ],
                dim=1,
            ).clamp(min=1.0)
            pred = out[i, 1:, cy, cx].t()
            reg_losses.append(
                F.l1_loss(pred, torch.log(ltrb / STRIDE), reduction="none").sum(dim=1)
            )
            areas.append((boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1]))
        obj_loss = F.binary_cross_entropy_with_logits(out[:, 0], obj_target)
        if not reg_losses:
            return obj_loss, float("nan")
        per_match = torch.cat(reg_losses)
        ratio = small_object_loss_ratio(per_match, torch.cat(areas))
        return obj_loss + per_match.mean(), ratio
