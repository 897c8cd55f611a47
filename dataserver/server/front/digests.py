"""The digests that name a task as the front keeps it: what it computes (``task_digest``: a
task asked again is the same task) and which control state it needs (``control_state``: the
key its worker keeps the dataset's states by). Pure functions of the message and the
session: ``Clients`` computes them as it admits a task."""

from __future__ import annotations

import hashlib
from typing import Any

import msgpack

from dataserver.protocol import Task
from dataserver.server.front.sessions import Session


def task_digest(task: Task) -> bytes:
    """What a task computes (not where it lands): a task asked again is the same task, and
    one that says otherwise under a live id is refused, not taken for a duplicate."""
    what = (
        task.plan_version,
        task.epoch,
        task.seed,
        task.images,
        task.grid,
        task.out_hw,
        task.fit_hw,
        task.on_error,
        task.control_seq,
        task.exclude,
        task.step,
        task.mode,
        task.layout,
        task.source_hw,
        task.control,
    )
    return hashlib.blake2b(repr(what).encode(), digest_size=16).digest()


def control_state(task: Task, session: Session) -> bytes:
    """Which control state ``task`` needs, as its worker keys them (a digest of the values):
    its own inline values (a rebuilt batch), or its session's at ``control_seq`` (the same
    values sent again are the same state); values not here yet: their sequence number."""
    if task.control is not None:
        values: dict[str, Any] = task.control
    elif task.control_seq == 0:
        return b""
    elif task.control_seq == session.control_seq:
        values = session.control
    else:
        return b"s%d" % task.control_seq
    packed = msgpack.packb(values, use_bin_type=True)
    return hashlib.blake2b(packed, digest_size=16).digest()
