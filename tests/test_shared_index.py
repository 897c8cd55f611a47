"""A ``package.module:factory`` dataset's shared index (issue 35, point 5): its
``shared_index(**args)`` runs once per server, in the front; the front and every worker
get the arrays mapped read-only as ``index`` (a sealed memfd the workers inherit)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from clients import make_client

pytestmark = pytest.mark.timeout(120)


def test_built_once_per_server_and_read_in_every_worker(start_server: Any, tmp_path: Path) -> None:
    log = tmp_path / "calls.log"
    args = json.dumps({"n": 40, "log": str(log)})
    server = start_server(
        "--dataset", "index_plugins:SharedLabels", "--dataset-args", args, workers=3
    )
    assert server.samples == 40
    calls = [line.split() for line in log.read_text().splitlines()]
    assert [c for c in calls if c[0] == "index"] == [["index", str(server.pid)]]
    inits = {int(pid) for what, pid in calls if what == "init"}
    assert inits == {server.pid, *server.worker_pids()}
    with make_client(server.address, batch_size=8, image_size=(32, 32), timeout=30.0) as client:
        seen = 0
        for batch in client:
            for idx, target in zip(batch.indices, batch.targets, strict=True):
                assert [int(x) for x in target["labels"]] == [idx[0] * 7 % 11]
                seen += 1
        assert seen == 40
