"""Landing: a worker on the client's host writes results straight into the client's
shared-memory batch buffers. The batches are the same as over the socket, a sealed buffer
can be written by nobody, and a worker writes into no file but a client's landing file."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from dataserver.landing import PREFIX, LandingArea, Landings, sweep
from dataserver_client import DataServerClient

pytestmark = pytest.mark.timeout(120)


def shm_or_skip() -> Path:
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK)):
        pytest.skip("no writable /dev/shm")
    return shm


def test_results_land_in_shared_memory_and_equal_those_over_the_socket(start_server: Any) -> None:
    shm_or_skip()
    server = start_server("--dataset", "ds_plugins:flat", "--dataset-args", json.dumps({"n": 64}))
    kw: dict[str, Any] = {"batch_size": 8, "image_size": (48, 64), "seed": 4, "device": "cpu"}
    with DataServerClient(server.address, shared_memory=False, **kw) as c:
        c.set_epoch(0)
        sent = [(b.indices, b.images.clone(), b.targets) for b in c]
        assert c.stats().get("results_landed", 0) == 0
        assert c._engine.landing is None
    with DataServerClient(server.address, **kw) as c:
        path = c._engine.landing.path if c._engine.landing else ""
        assert Path(path).exists()
        c.set_epoch(0)
        landed = [(b.indices, b.images.clone(), b.targets) for b in c]
        stats = c.stats()
    assert stats["results_landed"] >= 1 and not Path(path).exists()  # removed at close
    for (i1, im1, t1), (i2, im2, t2) in zip(sent, landed, strict=True):
        assert i1 == i2 and torch.equal(im1, im2)
        for a, b in zip(t1, t2, strict=True):
            assert torch.equal(a["boxes"], b["boxes"]) and torch.equal(a["labels"], b["labels"])


def test_letterboxed_and_stitched_batches_land_exactly_in_fresh_and_reused_regions(
    start_server: Any,
) -> None:
    """Letterbox padding must be zero whether a region is fresh (never written: the worker
    does not clear it) or reused (the worker clears it): more batches than regions, both
    modes, compared with the socket path."""
    shm_or_skip()
    server = start_server("--dataset", "synthetic:images=96,seed=2", workers=2)
    kw: dict[str, Any] = {"batch_size": 4, "image_size": (64, 64), "seed": 1, "device": "cpu"}

    def run(shared: bool) -> list[tuple[Any, torch.Tensor]]:
        out = []
        with DataServerClient(server.address, shared_memory=shared, **kw) as c:
            for epoch, mode in ((0, "regular"), (1, "stitch")):
                c.set_mode(mode)
                c.set_epoch(epoch)
                out += [(b.indices, b.images.clone()) for b in c]
            if shared:
                assert c.stats().get("results_landed", 0) > 2 * (c.config.prefetch + 5)
        return out

    for (i1, im1), (i2, im2) in zip(run(False), run(True), strict=True):
        assert i1 == i2 and torch.equal(im1, im2)


def test_a_sealed_region_is_written_by_nobody(tmp_path: Path) -> None:
    area = LandingArea(tmp_path, "seal-test", 2, 3 * 4 * 4 * 2)
    landings = Landings(tmp_path)
    try:
        gen = area.generation(1)
        shape = (2, 3, 4, 4)
        with landings.target(area.path, area.token, 1, gen, area.offset(1), shape) as dest:
            assert dest is not None
            dest[...] = 7
        assert (area.buffer(1) == 7).all()
        assert area.seal(1) and area.generation(1) == gen + 1
        with landings.target(area.path, area.token, 1, gen, area.offset(1), shape) as dest:
            assert dest is None  # a late writer of the old generation: nothing to write into
        # While a writer holds the region, the client cannot seal it (it tries again later).
        with landings.target(area.path, area.token, 1, gen + 1, area.offset(1), shape) as dest:
            assert dest is not None
            pid = os.fork()
            if pid == 0:  # another process (POSIX locks are per process)
                os._exit(0 if not area.seal(1) else 1)
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == 0
    finally:
        landings.close()
        area.close()


def test_a_worker_writes_no_file_but_a_clients_landing_file(tmp_path: Path) -> None:
    area = LandingArea(tmp_path, "guard-test", 1, 64)
    landings = Landings(tmp_path)
    victim = tmp_path / "not-a-landing-file"
    victim.write_bytes(bytes(8192))
    link = tmp_path / (PREFIX + "link")
    link.symlink_to(area.path)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    try:
        shape = (1, 1, 1, 64)
        args = (0, area.generation(0), area.offset(0), shape)
        for path, token in (
            (str(victim), area.token),  # not named as a landing file
            (str(link), area.token),  # a link to one: not followed
            (str(outside / os.path.basename(area.path)), area.token),  # another directory
            (area.path, "0" * 32),  # the wrong token
            (area.path + "/../" + os.path.basename(area.path), area.token),  # not plainly there
        ):
            with landings.target(path, token, *args) as dest:
                assert dest is None, path
        with landings.target(area.path, area.token, 0, area.generation(0), 10**9, shape) as dest:
            assert dest is None  # beyond the file
        with landings.target(area.path, area.token, *args) as dest:
            assert dest is not None
    finally:
        landings.close()
        area.close()
    assert victim.read_bytes() == bytes(8192)


def test_landing_files_of_dead_clients_are_swept(tmp_path: Path) -> None:
    pid = os.fork()
    if pid == 0:
        LandingArea(tmp_path, "dead", 1, 64)
        os._exit(0)  # without closing it
    os.waitpid(pid, 0)
    assert (tmp_path / (PREFIX + "dead")).exists()
    live = LandingArea(tmp_path, "live", 1, 64)
    sweep(tmp_path)
    assert not (tmp_path / (PREFIX + "dead")).exists() and Path(live.path).exists()
    live.close()
