"""The client side of the soak test, in its own process so its RSS is its own.

    soak_client.py ADDRESS BATCHES WARMUP

Prints one JSON line: RSS (bytes) after WARMUP batches and at the end, and batches seen.
"""

from __future__ import annotations

import json
import sys

from clients import make_client

from dataserver_client import iterate_epochs


def rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    address, total, warmup = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    marks = {}
    with make_client(address, batch_size=8, image_size=(32, 32), prefetch=2) as c:
        batches = iterate_epochs(c)
        for n in range(1, total + 1):
            batch = next(batches)
            if n % 7 == 0:
                c.set_mode("stitch" if batch.mode == "regular" else "regular")
            if n == warmup:
                marks["warm"] = rss()
        marks["end"] = rss()
    print(json.dumps({**marks, "batches": total}))


if __name__ == "__main__":
    main()
