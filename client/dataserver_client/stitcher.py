"""The Stitcher feedback signal (Chen et al. 2020, "Stitcher: Feedback-driven Data Provider
for Object Detection").

At every iteration Stitcher measures how much of the box-regression loss comes from small
objects; when that share is below a threshold tau (0.1 in the paper), the *next* iteration
trains on stitched images, which turns medium and large objects into small ones.

Where to call it in a torchvision-style detector: wherever the regression loss of the
matched (positive) samples is computed per sample, before it is reduced. For example, in a
Faster R-CNN ROI head::

    # box_loss_vec: smooth-L1 per positive proposal, shape (P,) or (P, 4)
    # matched_gt:   the ground-truth box (xyxy, input pixels) each positive is matched to
    areas = (matched_gt[:, 2] - matched_gt[:, 0]) * (matched_gt[:, 3] - matched_gt[:, 1])
    ratio = small_object_loss_ratio(box_loss_vec.detach(), areas)
    ...
    client.feedback(ratio)      # after optimizer.step(): decides the next batch

With torchvision's detection models, ``examples/train_detector.py`` shows one way to get
these tensors out of ``roi_heads`` with a forward hook.
"""

from __future__ import annotations

import torch

SMALL_AREA = 32 * 32  # COCO's "small": area under 32 x 32 input pixels


def small_object_loss_ratio(
    box_losses: torch.Tensor, gt_areas: torch.Tensor, small_area: float = SMALL_AREA
) -> float:
    """Share of the regression loss contributed by matches whose ground truth is small.

    ``box_losses``: the regression loss of each positive match, (P,) or (P, 4) (summed over
    the last dimension). ``gt_areas``: the area, in input pixels, of the ground-truth box
    each one is matched to, (P,). As in the official Stitcher code: ``sum(loss[area <
    small_area]) / sum(loss)``. With no regression loss at all the ratio is NaN, which
    compares false against any threshold, so feedback keeps regular mode (the official
    code's 0/0 does the same).
    """
    losses = box_losses.detach()
    if losses.dim() == 2:
        losses = losses.sum(dim=1)
    if losses.shape != gt_areas.shape:
        raise ValueError(
            f"box_losses {tuple(box_losses.shape)} and gt_areas {tuple(gt_areas.shape)} differ"
        )
    total = losses.sum()
    if total.item() <= 0:
        return float("nan")
    small = losses[gt_areas.detach() < small_area].sum()
    return float((small / total).item())
