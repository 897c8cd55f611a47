"""Guarantee 7 (first part): bad samples, unreachable servers and bad flags give clear
errors, and the server keeps serving."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from clients import make_client
from conftest import free_port, run_epoch_collecting_errors, server_env

from dataserver_client import DataServerError, ServerUnreachable

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def broken_coco(coco_dir: Path, tmp_path: Path) -> Path:
    """The synth set with image 3 corrupt (garbage bytes) and image 10 missing."""
    d = tmp_path / "coco"
    shutil.copytree(coco_dir, d)
    doc = json.loads((d / "annotations.json").read_text())
    (d / doc["images"][3]["file_name"]).write_bytes(b"\xff\xd8\xff\xe0 this is not a jpeg")
    (d / doc["images"][10]["file_name"]).unlink()
    return d


def test_bad_samples_raise_naming_index_and_file_and_the_server_keeps_serving(
    start_server: Any, broken_coco: Path
) -> None:
    server = start_server("--dataset", f"coco:{broken_coco / 'annotations.json'}")
    with make_client(server.address, batch_size=4, image_size=(64, 64)) as client:
        delivered, errors = run_epoch_collecting_errors(client, 0)
    assert len(errors) == 2
    by_index = {e.index: e for e in errors}
    assert set(by_index) == {3, 10}
    assert "000000000003.jpg" in str(by_index[3]) and "not a decodable image" in str(by_index[3])
    assert by_index[3].file is not None and by_index[3].file.endswith("000000000003.jpg")
    assert "000000000010.jpg" in str(by_index[10]) and "cannot read" in str(by_index[10])
    # The batches without a bad sample were all delivered.
    assert len(delivered) + 8 == 48 and not {3, 10} & set(delivered)
    # The same server serves the next client, who skips the bad samples and counts them.
    with make_client(server.address, batch_size=4, image_size=(64, 64), on_error="skip") as client:
        client.set_epoch(0)
        batches = list(client)
    got = sorted(i for b in batches for idx in b.indices for i in idx)
    assert got == sorted(set(range(48)) - {3, 10})
    assert sum(b.skipped for b in batches) == 2
    assert sorted(i for b in batches for i in b.skipped_indices) == [3, 10]
    assert all(len(b) == len(b.targets) == len(b.indices) for b in batches)
    assert server.stats()["workers_alive"] == 2


def test_user_dataset_exception_reaches_the_trainer(start_server: Any) -> None:
    server = start_server(
        "--dataset", "ds_plugins:failing", "--dataset-args", json.dumps({"n": 16, "bad": [5]})
    )
    with make_client(server.address, batch_size=4, image_size=(32, 32), shuffle=False) as client:
        client.set_epoch(0)
        it = iter(client)
        assert next(it).indices == [[0], [1], [2], [3]]
        with pytest.raises(
            DataServerError, match="sample 5: ValueError: sample 5 is broken on purpose"
        ) as info:
            next(it)
        assert info.value.index == 5
        assert next(it).indices == [[8], [9], [10], [11]]  # the iterator goes on after an error


def test_unreachable_server_raises_within_timeout_naming_it() -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    start = time.monotonic()
    with pytest.raises(ServerUnreachable, match=address.replace(".", r"\.")):
        make_client(address, timeout=1.5)
    assert time.monotonic() - start < 10


def test_invalid_client_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="stitch_k must be a square"):
        make_client("tcp://127.0.0.1:1", stitch_k=5)
    with pytest.raises(ValueError, match="on_error"):
        make_client("tcp://127.0.0.1:1", on_error="ignore")
    with pytest.raises(ValueError, match="not tcp://HOST:PORT"):
        make_client("localhost:5555")


def serve_fails(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dataserver.cli", "serve", "--workers", "1", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=server_env(),
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--dataset", "bogus"], "unknown dataset 'bogus'"),
        (["--dataset", "synthetic:images=x"], "images must be an integer"),
        (["--dataset", "synthetic:colour=red"], "unknown option 'colour=red'"),
        (["--dataset", "coco:/nonexistent/annotations.json"], "coco: cannot load"),
        (["--dataset", "no_such_module_xyz:factory"], "cannot import 'no_such_module_xyz'"),
        (["--dataset", "ds_plugins:nothing_here"], "has no callable 'nothing_here'"),
        (["--dataset", "ds_plugins:failing", "--dataset-args", "{bad json"], "not valid JSON"),
        (["--dataset", "ds_plugins:failing", "--dataset-args", '{"nope": 1}'], "raised TypeError"),
        (["--workers", "x"], "invalid int value"),
        (["--workers", "0"], "--workers must be >= 1"),
        (["--bind", "localhost:5555"], "expected tcp://HOST:PORT"),
        (["--frobnicate"], "unrecognized arguments"),
    ],
)
def test_bad_spec_or_flag_exits_nonzero_with_one_clear_line(args: list[str], message: str) -> None:
    proc = serve_fails(*args)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert message in lines[0]
    assert "Traceback" not in proc.stderr


def test_port_in_use_is_one_clear_line(synthetic_server: Any) -> None:
    proc = serve_fails("--bind", synthetic_server.address)
    assert proc.returncode != 0
    assert len(proc.stderr.strip().splitlines()) == 1 and "cannot bind" in proc.stderr
