"""A server that re-handshakes in a loop does not stall the job (issue 39, item 3): a fake
server (``flapping_server.py``) sends its WELCOME, announcing 65,536 sample sizes, 100 times
a second, the same one or each from a new process (a new server id); the job's batches all
come, well within a bound the flood used to blow (200 batches took over 200 s)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from clients import make_client
from conftest import TESTS, server_env

pytestmark = pytest.mark.timeout(180)

BATCHES = 200


@contextmanager
def flapping(*flags: str) -> Iterator[str]:
    cmd = [sys.executable, str(TESTS / "flapping_server.py"), *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=server_env())
    try:
        assert proc.stdout is not None
        yield str(json.loads(proc.stdout.readline())["address"])
    finally:
        proc.terminate()
        proc.wait(20)


@pytest.mark.parametrize("new_id", [False, True])
def test_a_server_re_handshaking_in_a_loop_does_not_stall_the_job(new_id: bool) -> None:
    flags = ["--hz", "100", *(["--new-id"] if new_id else [])]
    with (
        flapping(*flags) as address,
        make_client(address, batch_size=16, image_size=(32, 32), timeout=60) as client,
    ):
        client.set_epoch(0)
        start = time.monotonic()
        got = 0
        for batch in client:
            got += len(batch.indices)
            if got >= BATCHES * 16:
                break
        elapsed = time.monotonic() - start
        stats = client.stats()
    assert got == BATCHES * 16
    assert elapsed < 30, f"{elapsed:.1f} s"  # (before: over 200 s; undisturbed: under 1 s)
    assert stats["servers"][0]["state"] == "ready", stats["servers"]
    if new_id:
        assert stats.get("welcome_held", 0) > 0, stats  # handshakes rate-limited, counted
    else:
        assert stats.get("welcome_unchanged", 0) > 0, stats  # the same one: not redone
