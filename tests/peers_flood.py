"""Sessions that only beat, from chosen source addresses, for tests/test_peers.py:

    python tests/peers_flood.py ADDRESS --sources A,B,... [--per N] [--uid U]

From each source address (empty: the kernel's choice) it opens ``--per`` sessions at
ADDRESS (a ``tcp://`` data endpoint), at most 8 on a connection, each connection's answers
awaited before the next; as ``--uid`` (set after its imports: another local user). It
prints the answers' kinds as one JSON list, then keeps its admitted sessions beating
(a HEARTBEAT each every 0.5 s) until killed or its stdin closes."""

from __future__ import annotations

import argparse
import json
import os
import select
import sys
import time
from typing import Any

import zmq

from dataserver.protocol import ErrorMsg, Heartbeat, Hello, decode

PER_CONNECTION = 8


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("address")
    p.add_argument("--sources", default="")
    p.add_argument("--per", type=int, default=1)
    p.add_argument("--uid", type=int, default=None)
    args = p.parse_args()
    if args.uid is not None:
        os.setgroups([])
        os.setgid(args.uid)
        os.setuid(args.uid)
    target = args.address.removeprefix("tcp://")
    ctx: zmq.Context[Any] = zmq.Context()
    held: list[tuple[Any, bytes]] = []
    kinds: list[str] = []
    for n, source in enumerate(args.sources.split(",")):
        for c in range(0, args.per, PER_CONNECTION):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(f"tcp://{source}:0;{target}" if source else f"tcp://{target}")
            sids = [b"flood-%03d-%03d-abc" % (n, c + i) for i in range(min(8, args.per - c))]
            for sid in sids:
                s.send_multipart(Hello(session=sid, auth=sid).encode())
            for sid in sids:
                if not s.poll(20_000):
                    return 2
                answer = decode(s.recv_multipart())
                kinds.append(answer.kind if isinstance(answer, ErrorMsg) else "welcome")
                if not isinstance(answer, ErrorMsg):
                    held.append((s, sid))
            for t, sid in held:  # (alive meanwhile: a session silent 5 s may be replaced)
                t.send_multipart(Heartbeat(session=sid, auth=sid).encode())
    print(json.dumps(kinds), flush=True)
    while True:
        for s, sid in held:
            s.send_multipart(Heartbeat(session=sid, auth=sid).encode())
            while s.poll(0):
                s.recv_multipart()
        ready, _, _ = select.select([sys.stdin], [], [], 0.5)
        if ready and not sys.stdin.read(1):
            return 0
        time.sleep(0)


if __name__ == "__main__":
    sys.exit(main())
