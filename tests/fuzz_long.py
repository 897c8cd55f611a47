"""The long protocol fuzz run: the targets of ``test_fuzz.py`` with far more messages.

    python tests/fuzz_long.py --messages 200000

Starts its own server (tests/plugins on its path), splits the messages over the data port
(three quarters), the workers' result sockets and a live client behind a hostile fake
server (an eighth each), then checks what ``test_fuzz.py``
checks: nothing died, no handler raised (``internal`` = 0 on both sides), and a whole epoch
is served exactly once. Prints one JSON line with the counts; exit status 0 when all held.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "plugins"))  # clients
sys.path.insert(0, str(Path(__file__).resolve().parent))  # conftest, fuzz_targets

from clients import make_client
from conftest import Server
from fuzz_targets import (
    FakeServer,
    run_data_port,
    run_worker_results,
    welcome_of,
)

from dataserver_client import DataServerClient, DataServerError


def exact_epoch(client: DataServerClient, epoch: int) -> bool:
    client.set_epoch(epoch)
    return sorted(i for b in client for idx in b.indices for i in idx) == list(range(48))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--messages", type=int, default=200_000)
    args = parser.parse_args()
    eighth = args.messages // 8
    server = Server("--dataset", "ds_plugins:flat", "--dataset-args", '{"n": 48}', workers=2)
    sent: dict[str, int] = {}
    start = time.monotonic()
    try:
        welcome = welcome_of(server.address)
        sent["worker_results"] = run_worker_results(list(welcome.results), eighth)
        fake = FakeServer(welcome, eighth)
        fake.start()
        failed_epochs = epochs = 0
        with make_client(
            [server.address, fake.address],
            batch_size=4,
            image_size=(32, 32),
            timeout=60,
        ) as client:
            while not fake.done.is_set():
                try:
                    exact_epoch(client, epochs)
                except DataServerError:
                    failed_epochs += 1
                epochs += 1
            client_ok = fake.error is None and exact_epoch(client, epochs)
            client_stats = client.stats()
        sent["client"] = fake.sent
        sent["data"] = run_data_port(server.address, args.messages - sum(sent.values()))
        stats = server.stats()
        with make_client(server.address, batch_size=8, image_size=(32, 32)) as c:
            server_ok = exact_epoch(c, 0)
        alive = server.proc.poll() is None and stats["workers_started"] == 2
    finally:
        server.stop()
    report = {
        "messages_sent": sum(sent.values()),
        "by_target": sent,
        "seconds": round(time.monotonic() - start, 1),
        "server_rejected": stats["rejected"],
        "server_internal_errors": stats["rejected"].get("internal", 0),
        "client_rejected": client_stats["rejected"],
        "client_internal_errors": client_stats["rejected"].get("internal", 0),
        "client_epochs_failed_by_the_hostile_server": failed_epochs,
        "server_alive_and_no_worker_died": alive,
        "exact_epoch_after": server_ok and client_ok,
    }
    print(json.dumps(report), flush=True)
    ok = (
        alive
        and server_ok
        and client_ok
        and report["server_internal_errors"] == 0
        and report["client_internal_errors"] == 0
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
