"""A fake server that re-handshakes in a loop (a flapping link, a crash-looping pod): the
scale bench's fake (``dataserver.bench.scale``: every TASK answered at once), announcing
``--samples`` samples with their sizes (their count and digest, as servers announce them),
that sends its WELCOME again to every session it greeted ``--hz`` times a second; ``--new-id`` gives each WELCOME a new ``server_id`` (a
process that restarts each time). ``python flapping_server.py [--hz N] [--new-id]``:
prints ``{"address": ...}``, serves until SIGTERM."""

from __future__ import annotations

import argparse
import json
import signal
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from dataserver.bench.scale import _Fake
from dataserver.protocol import Hello, Welcome, decode, sizes_digest


@dataclass(eq=False)
class Flapping(_Fake):
    samples: int = 65_536
    new_id: bool = False
    greeted: dict[bytes, bytes] = field(default_factory=dict)  # front identity -> session

    def welcome(self, sid: bytes) -> Welcome:
        base = super().welcome(sid)
        return Welcome(
            session=base.session,
            server_id=self.server_id,
            dataset_len=self.samples,
            fingerprint=base.fingerprint,
            workers=base.workers,
            credit=base.credit,
            results=base.results,
            sizes_count=self.samples,
            sizes_digest=sizes_digest(np.full((self.samples, 2), (48, 64), dtype=np.int32)),
        )

    def on_front(self, frames: list[Any]) -> None:
        try:
            msg = decode(frames[1:])
        except Exception:
            msg = None
        if isinstance(msg, Hello):
            self.greeted[frames[0].bytes] = msg.session
        super().on_front(frames)

    def flap(self) -> None:
        """Every session greeted gets the WELCOME again (a new server id with ``new_id``)."""
        if self.new_id:
            self.server_id = uuid.uuid4().hex[:12]
        for ident, sid in self.greeted.items():
            self.front.send_multipart([ident, *self.welcome(sid).encode()])
            self.counts["flaps"] += 1


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--hz", type=float, default=100.0, help="WELCOMEs a second (0: none)")
    p.add_argument("--samples", type=int, default=65_536)
    p.add_argument("--new-id", action="store_true")
    a = p.parse_args()
    ctx: zmq.Context[Any] = zmq.Context()
    base = _Fake.bind(ctx, 2)
    fake = Flapping(base.front, base.results, 2, samples=a.samples, new_id=a.new_id)
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    print(json.dumps({"address": fake.address}), flush=True)
    poller = zmq.Poller()
    for sock in (fake.front, fake.results):
        poller.register(sock, zmq.POLLIN)
    period = 1.0 / a.hz if a.hz > 0 else float("inf")
    next_flap = time.monotonic() + period
    while not stop["now"]:
        wait = max(0.0, min(0.05, next_flap - time.monotonic()))
        for sock, _ in poller.poll(int(wait * 1000)):
            for _ in range(256):
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                if sock is fake.front:
                    fake.on_front(frames)
        if time.monotonic() >= next_flap:
            fake.flap()
            next_flap += period
            next_flap = max(next_flap, time.monotonic())
    ctx.destroy(linger=0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
