"""Guarantee 5: state_dict() taken mid-epoch (right after a mode switch included) and loaded
in a new process continues with exactly the remaining samples, in order, in the same mode."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
from clients import make_client
from conftest import PLUGINS, server_env

from dataserver_client.plan.resume import STATE_VERSION

pytestmark = pytest.mark.timeout(150)


def run_part(address: str, part: str, out: Path, *extra: str) -> list[dict[str, Any]]:
    proc = subprocess.run(
        [sys.executable, str(PLUGINS / "resume_part.py"), address, part, str(out), *extra],
        capture_output=True,
        text=True,
        timeout=120,
        env=server_env(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return list(json.loads(out.read_text()))


# The state is taken right after set_mode switched regular -> stitch (cut 2) and back (cut 4).
@pytest.mark.parametrize("cut", [2, 4])
def test_resume_in_a_new_process_continues_exactly(
    start_server: Any, tmp_path: Path, cut: int
) -> None:
    server = start_server("--dataset", "ds_plugins:flat", "--dataset-args", json.dumps({"n": 70}))
    full = run_part(server.address, "full", tmp_path / "full.json")
    state = tmp_path / "state.pt"
    first = run_part(server.address, "first", tmp_path / "first.json", str(state), str(cut))
    saved = torch.load(state, weights_only=False)
    second = run_part(server.address, "second", tmp_path / "second.json", str(state))
    assert first + second == full  # same samples, order, modes, feedback_seq and pixels
    assert second[0]["mode"] == saved["mode"] == ("stitch" if cut == 2 else "regular")
    assert second[0]["step"] == cut
    assert sorted(i for b in full for idx in b["indices"] for i in idx) == list(range(70))
    assert {b["mode"] for b in full} == {"regular", "stitch"}


def test_state_is_small_plain_versioned_data(synthetic_server: Any) -> None:
    with make_client(synthetic_server.address, batch_size=8, image_size=(32, 32)) as c:
        c.set_epoch(4)
        it = iter(c)
        next(it)
        c.set_mode("stitch")
        c.control(flag=3)
        state = c.state_dict()
    packed = msgpack.packb(state)
    assert len(packed) < 1024  # no sample lists: position into the (seed, epoch) order
    assert msgpack.unpackb(packed) == state
    assert state["version"] == STATE_VERSION and state["epoch"] == 4 and state["step"] == 1
    assert (
        state["mode"] == "stitch" and state["control"] == {"flag": 3} and state["feedback_seq"] == 2
    )


def test_mismatched_state_is_refused(synthetic_server: Any) -> None:
    with make_client(synthetic_server.address, batch_size=8, image_size=(32, 32)) as c:
        state = c.state_dict()
    with make_client(synthetic_server.address, batch_size=4, image_size=(32, 32)) as c:
        with pytest.raises(ValueError, match="batch_size"):
            c.load_state_dict(state)
        with pytest.raises(ValueError, match="version"):
            c.load_state_dict({**state, "version": 99})
