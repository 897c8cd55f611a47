"""How finely the client cuts a batch into tasks: this rank's share of the ready servers'
worker slots, the tasks a batch is cut into, the images one task may hold. Pure policy over
numbers it is told: the ready servers' slots and task budget (``servers``, from the plan
book when the servers change), the depth planned and whether tasks are in flight (with each
batch cut). The plan book (book.py) is its only caller.

Each task costs a message each way and wakes the client, the front and a worker, whose
caches the others then refill (2 cores, 512x512, batch 16: two tasks a batch instead of one
cost the client ~180 us an image instead of ~120 and the front ~95 instead of ~55; cut by
every slot, a job of 1,000 ranks made every image a task and its servers' fronts the
bottleneck). So a batch is cut into as few tasks as keep this rank's share of the slots busy
with ``depth`` batches in flight, and no fewer than its images' bytes need.
"""

from __future__ import annotations

from collections.abc import Sequence

from dataserver.protocol import MAX_TASK_IMAGES
from dataserver.protocol.messages import DEFAULT_TASK_BYTES
from dataserver_client.plan.epoch import split_runs


class Pacing:
    """The task-cutting rule for one rank of ``world_size``."""

    def __init__(self, world_size: int) -> None:
        self._world_size = world_size
        self._parallelism = 2  # worker slots over every ready server (none met yet)
        self._task_bytes = DEFAULT_TASK_BYTES  # the most output a task may ask of any of them

    def servers(self, slots: int, task_bytes: int | None) -> None:
        """The ready servers changed: they work on ``slots`` tasks at once, and one task may
        ask at most ``task_bytes`` of output of any of them (the least of their
        ``--max-task-mb``; None: none announced one, the budget stands)."""
        self._parallelism = max(1, slots)
        if task_bytes is not None:
            self._task_bytes = max(1, task_bytes)

    def share(self) -> int:
        """This rank's share of the ready servers' worker slots (the ranks of a job share
        them: 1 / world_size each)."""
        return max(1, self._parallelism // self._world_size)

    def images_per_task(self, out_hw: tuple[int, int]) -> int:
        """The most images of ``out_hw`` one task may hold (at least one: a server that
        cannot take one image of that size is declined at its WELCOME)."""
        return max(1, min(MAX_TASK_IMAGES, self._task_bytes // (3 * out_hw[0] * out_hw[1])))

    def tasks_per_batch(self, images: int, depth: int, busy: bool) -> int:
        """Tasks to cut a batch of ``images`` output images into: enough that this rank's
        share of the slots is full with ``depth`` batches in flight. With nothing in flight
        (not ``busy``: an epoch's first batch, a trainer that let every batch finish), the
        batch is cut for the whole share: every worker works on it."""
        share = self.share()
        want = -(-share // depth) if busy else share
        return max(1, min(images, max(want, -(-images // MAX_TASK_IMAGES))))

    def cut(
        self, servers: Sequence[object], out_hw: tuple[int, int], depth: int, busy: bool
    ) -> list[range]:
        """A batch of ``len(servers)`` images of ``out_hw`` cut into tasks: runs of
        consecutive slots, cut where the server their sources belong to (``servers``, one
        per image; all None with one server) changes, each segment its share of
        ``tasks_per_batch`` and no task over ``images_per_task``."""
        n = len(servers)
        segments: list[tuple[int, int]] = []  # [start, stop) of one preferred server
        for j in range(n):
            if j and servers[j] is servers[j - 1]:
                segments[-1] = (segments[-1][0], j + 1)
            else:
                segments.append((j, j + 1))
        parts = self.tasks_per_batch(n, depth, busy)
        most = self.images_per_task(out_hw)
        runs = []
        for start, stop in segments:
            share = max(1, round(parts * (stop - start) / n), -(-(stop - start) // most))
            runs += [
                range(start + r.start, start + r.stop) for r in split_runs(stop - start, share)
            ]
        return runs
