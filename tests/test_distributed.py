"""Two ranks under torch.distributed (gloo, two processes on CPU) with different local
ratios take the same feedback decisions and end the epoch on the same step."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
from conftest import PLUGINS, free_port, server_env

pytestmark = pytest.mark.timeout(180)


def test_ranks_average_their_ratios_and_stay_in_lockstep(start_server: Any) -> None:
    server = start_server("--dataset", "ds_plugins:flat", "--dataset-args", json.dumps({"n": 120}))
    port = free_port()
    procs = []
    for rank in (0, 1):
        env = dict(
            server_env(),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            WORLD_SIZE="2",
        )
        env.pop("CUDA_VISIBLE_DEVICES", None)
        procs.append(
            subprocess.Popen(
                [sys.executable, str(PLUGINS / "dist_rank.py"), server.address],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
        )
    outs = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=150)
        assert p.returncode == 0, stderr[-3000:]
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    r0, r1 = sorted(outs, key=lambda o: o["rank"])
    assert r0["decisions"] == r1["decisions"]
    assert r0["modes"] == r1["modes"] and r0["steps"] == r1["steps"]  # same number of steps
    assert {"regular", "stitch"} <= set(r0["modes"])
    for r in (r0, r1):
        assert r["steps"] == list(range(len(r["steps"])))
        # At step t the mean of the ranks' ratios is (0.0 + 0.15) / 2 = 0.075 < 0.1 (stitch)
        # when t % 3 == 0, else (0.0 + 0.3) / 2 = 0.15 (regular): every decision is that...
        assert r["decisions"] == ["stitch" if t % 3 == 0 else "regular" for t in r["steps"]]
        # ... and every batch, on every rank, is in the mode decided after the one before.
        assert r["modes"] == ["regular", *r["decisions"][:-1]]
    assert not set(r0["indices"]) & set(r1["indices"])
    assert sorted(r0["indices"] + r1["indices"]) == list(range(120))
