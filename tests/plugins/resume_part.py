"""Part of the resume test, run as its own process by tests/test_resume.py.

    resume_part.py ADDRESS full OUT.json              one uninterrupted epoch
    resume_part.py ADDRESS first OUT.json STATE K     K batches, then state_dict() -> STATE
    resume_part.py ADDRESS second OUT.json STATE      load STATE in a new process, finish

After every batch the same fixed policy picks the next mode, so the three runs can be
compared batch by batch. Prints nothing; writes the batches it saw (indices, mode, step,
feedback_seq, and a hash of the pixels) to OUT.json.
"""

from __future__ import annotations

import hashlib
import json
import sys

import torch
from clients import make_client

from dataserver_client import Batch


def policy(step: int) -> str:
    return "stitch" if step % 5 in (1, 2) else "regular"


def record(batch: Batch) -> dict[str, object]:
    digest = hashlib.sha1(batch.images.numpy().tobytes()).hexdigest()
    return {
        "indices": batch.indices,
        "mode": batch.mode,
        "step": batch.step,
        "feedback_seq": batch.feedback_seq,
        "pixels": digest,
    }


def main() -> None:
    address, part, out = sys.argv[1], sys.argv[2], sys.argv[3]
    seen = []
    with make_client(address, batch_size=4, image_size=(32, 48), seed=5, prefetch=3) as c:
        if part == "second":
            c.load_state_dict(torch.load(sys.argv[4], weights_only=False))
        else:
            c.set_epoch(1)
        for batch in c:
            seen.append(record(batch))
            c.set_mode(policy(batch.step))
            if part == "first" and len(seen) == int(sys.argv[5]):
                torch.save(c.state_dict(), sys.argv[4])
                break
    with open(out, "w") as f:
        json.dump(seen, f)


if __name__ == "__main__":
    main()
