"""Guarantee 1: nothing is pickled, and server processes never load torch or CUDA."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import pytest
from clients import make_client

pytestmark = pytest.mark.timeout(90)

FORBIDDEN = ("torch", "libcuda", "libcudart", "libnvidia", "libcublas", "libnccl")


def mapped_files(pid: int) -> set[str]:
    files = set()
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5].startswith("/"):
            files.add(parts[5])
    return files


def test_unpicklable_dataset_is_served(start_server: Any) -> None:
    import ds_plugins

    with pytest.raises(RuntimeError, match="never be pickled"):
        pickle.dumps(ds_plugins.no_pickle(4))
    server = start_server(
        "--dataset", "ds_plugins:no_pickle", "--dataset-args", json.dumps({"n": 24})
    )
    with make_client(server.address, batch_size=8, image_size=(64, 64)) as client:
        client.set_epoch(0)
        indices = sorted(i for b in client for idx in b.indices for i in idx)
    assert indices == list(range(24))


def test_server_processes_map_no_torch_and_no_cuda(synthetic_server: Any) -> None:
    with make_client(synthetic_server.address, batch_size=8, image_size=(64, 64)) as client:
        client.set_epoch(0)
        assert sum(len(b) for b in client) == 96  # the workers have run real tasks
    pids = [synthetic_server.pid, *synthetic_server.worker_pids()]
    assert len(pids) == 3
    for pid in pids:
        files = mapped_files(pid)
        assert any("cv2" in f or "opencv" in f for f in files) or pid == synthetic_server.pid
        bad = sorted(
            f for f in files if any(word in Path(f).name or "/torch/" in f for word in FORBIDDEN)
        )
        assert not bad, f"process {pid} maps {bad}"
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        assert b"CUDA_VISIBLE_DEVICES=" in environ or pid == synthetic_server.pid


def test_this_test_process_does_map_torch() -> None:
    """The check above can fail: a process that imported torch shows it in its maps."""
    import os

    import torch  # noqa: F401

    assert any("torch" in f for f in mapped_files(os.getpid()))
