"""WELCOME's one check (``welcome_problem``): what a server's WELCOME may be wrong about
(``WelcomeRefusal``) against the dataset the session serves (``DatasetInfo``: as its first
accepted WELCOME announced it) and this client's settings, at the handshake and after it.
Pure: no sockets. ``Links.check`` calls it; the handlers decide what a refusal does."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dataserver.protocol import Welcome

if TYPE_CHECKING:
    from dataserver_client.config import ClientConfig  # (torch: the buffers' layer)


class WelcomeRefusal(enum.Enum):
    """What a WELCOME can be wrong about (``welcome_problem``)."""

    TOO_LARGE = "too_large"  # more samples than max_dataset_len: the server is lying or wrong
    OTHER_DATASET = "other_dataset"  # not the dataset the other servers serve
    IMAGE_SIDE = "image_side"  # it cannot compose images as large as this client asks


@dataclass(frozen=True)
class DatasetInfo:
    """The dataset a session serves, as its first accepted WELCOME announced it."""

    dataset_len: int
    fingerprint: str
    address: str  # the server that announced it
    categories: tuple[tuple[int, str], ...] = ()  # its (label, name) pairs
    # How many per-sample (h, w) it announces (0: none; else dataset_len) and their digest:
    # the sizes themselves are asked for when needed (``announce.py``).
    sizes_count: int = 0
    sizes_digest: bytes = b""


@dataclass(frozen=True)
class WelcomeProblem:
    kind: WelcomeRefusal
    why: str


def welcome_problem(
    address: str, msg: Welcome, dataset: DatasetInfo | None, config: ClientConfig
) -> WelcomeProblem | None:
    """What is wrong with ``msg`` from ``address`` for this session, or None: the one check
    of a WELCOME, at the handshake and after it."""
    limit = config.max_dataset_len
    if msg.dataset_len > limit:
        # The epoch's order is built in memory from this number: a server must not be able
        # to make the trainer allocate gigabytes by a claim.
        why = f"it announces {msg.dataset_len} samples, more than max_dataset_len {limit}"
        return WelcomeProblem(WelcomeRefusal.TOO_LARGE, why)
    if dataset is not None and (msg.fingerprint, msg.dataset_len) != (
        dataset.fingerprint,
        dataset.dataset_len,
    ):
        return WelcomeProblem(
            WelcomeRefusal.OTHER_DATASET,
            f"servers disagree on the dataset: {dataset.address} serves "
            f"{dataset.fingerprint} ({dataset.dataset_len} samples), {address} "
            f"serves {msg.fingerprint} ({msg.dataset_len} samples)",
        )
    if dataset is not None and tuple(msg.categories) != dataset.categories:
        return WelcomeProblem(
            WelcomeRefusal.OTHER_DATASET,
            f"servers disagree on the dataset's categories: {dataset.address} announces "
            f"{len(dataset.categories)}, {address} {len(msg.categories)} "
            f"(first difference: {_first_difference(dataset.categories, msg.categories)})",
        )
    if dataset is not None and (msg.sizes_count, msg.sizes_digest) != (
        dataset.sizes_count,
        dataset.sizes_digest,
    ):
        return WelcomeProblem(
            WelcomeRefusal.OTHER_DATASET,
            f"servers disagree on the dataset's sizes: {dataset.address} announces "
            f"{dataset.sizes_count} ({dataset.sizes_digest.hex()}), {address} "
            f"{msg.sizes_count} ({msg.sizes_digest.hex()})",
        )
    if max(config.sizes.stored) > msg.max_image_side:
        return WelcomeProblem(
            WelcomeRefusal.IMAGE_SIDE,
            f"{address} serves images of at most {msg.max_image_side} pixels a side "
            f"(its --max-image-side); this client asks for {config.sizes.stored}",
        )
    one = 3 * config.sizes.stored[0] * config.sizes.stored[1]
    if one > msg.max_task_bytes:
        return WelcomeProblem(
            WelcomeRefusal.IMAGE_SIDE,
            f"{address} takes tasks of at most {msg.max_task_bytes} bytes (its "
            f"--max-task-mb); one image of {config.sizes.stored} takes {one}",
        )
    return None


def _first_difference(ours: Sequence[tuple[int, str]], theirs: Sequence[tuple[int, str]]) -> str:
    for a, b in zip(ours, theirs, strict=False):
        if tuple(a) != tuple(b):
            return f"{tuple(a)!r} against {tuple(b)!r}"
    return f"entry {min(len(ours), len(theirs))}"
