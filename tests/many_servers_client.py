"""A client against many servers, in a process of its own (its descriptor limit is its own):
``python many_servers_client.py ADDRESSES_FILE [--limit SOFT,HARD] [--spare N]``.

``--limit``: the RLIMIT_NOFILE to start with (the client raises the soft one to the hard one).
``--spare N``: instead, a hard limit that leaves room for the servers' sockets and N direct
result connections besides (``fds.py``'s budget, from the descriptors open here now).
Runs one epoch and prints one JSON line: the limits before and after, the descriptors the
client opened, its ``stats()``, the indices it got; or the error its constructor raised.
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import sys
import tracemalloc

from clients import make_client

from dataserver_client.errors import DataServerError
from dataserver_client.net.fds import FD_RESERVE, open_fds
from dataserver_client.net.serverlink import ServerLink

# Descriptors the client opens besides its links (its wake pipe, epoll, ZeroMQ's threads,
# its landing buffer): the budget counts them as open already; here they are guessed.
CLIENT_OWN = 16


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("addresses")
    p.add_argument("--limit", default="")
    p.add_argument("--spare", type=int, default=-1)
    p.add_argument("--batches", type=int, default=0, help="0: a whole epoch")
    p.add_argument("--traced", action="store_true", help="report the memory Python holds")
    a = p.parse_args()
    with open(a.addresses) as f:
        addresses = json.load(f)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if a.limit:
        soft, hard = (int(x) for x in a.limit.split(","))
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    elif a.spare >= 0:
        n = open_fds() + CLIENT_OWN + FD_RESERVE + ServerLink.FDS * len(addresses) + a.spare
        resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))
    before = resource.getrlimit(resource.RLIMIT_NOFILE)
    fds_before = open_fds()
    out: dict[str, object] = {"limit_before": before}
    if a.traced:
        tracemalloc.start()
    try:
        client = make_client(addresses, batch_size=16, image_size=(16, 16), timeout=60)
    except DataServerError as exc:
        out["error"] = str(exc)
        print(json.dumps(out), flush=True)
        return 0
    with client:
        out["fds_opened"] = open_fds() - fds_before
        out["limit_after"] = resource.getrlimit(resource.RLIMIT_NOFILE)
        client.set_epoch(0)
        indices: list[int] = []
        for i, batch in enumerate(client):
            indices += [j for image in batch.indices for j in image]
            if a.batches and i + 1 >= a.batches:
                break
        stats = client.stats()
        if a.traced:  # the Python objects alive now, every thread's (not the allocator's)
            out["traced_mib"] = tracemalloc.get_traced_memory()[0] / 2**20
    out["indices"] = indices
    out["fds"] = stats["fds"]
    out["servers"] = stats["servers"]
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
