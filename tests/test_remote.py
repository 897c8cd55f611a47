"""Data in object storage (``coco:s3://...``, ``wds:s3://...``): a real S3 API (moto under
waitress, its own process) behind a proxy that adds 30 ms to what it sends back, answers a
share of requests 503 SlowDown, and refuses a wrong access key (``objstore.py``)."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from batches import Epoch, epoch_by_index
from clients import make_client
from conftest import Server, open_files, run_epoch_collecting_errors, server_env, wait_until

from dataserver.bench.objstore import ACCESS_KEY, SECRET_KEY, ObjectStore
from dataserver.data.coco import write_synthetic_coco
from dataserver.data.shards import ShardDataset
from dataserver.data.spec import parse_spec

pytestmark = pytest.mark.timeout(240)

IMAGES = 16
KW: dict[str, Any] = {"batch_size": 4, "image_size": (64, 64), "seed": 5}


class Sets:
    """One COCO set on local disk, as loose files and as shards, and the same in the store."""

    def __init__(self, root: Path, store: ObjectStore) -> None:
        write_synthetic_coco(root / "coco", images=IMAGES, seed=2)
        ann = str(root / "coco" / "annotations.json")
        cmd = [sys.executable, "-m", "dataserver.cli", "shards", ann, str(root / "wds")]
        proc = subprocess.run([*cmd, "--shard-mb", "0.05"], capture_output=True, text=True)
        assert proc.returncode == 0 and "shard-{000000.." in proc.stdout, proc.stderr
        paths = sorted(root.glob("wds/shard-*.tar"))
        last = len(paths) - 1
        self.local_coco = f"coco:{root}/coco/annotations.json"
        self.local_wds = f"wds:{root}/wds/shard-{{000000..{last:06d}}}.tar"
        coco = store.put_tree(root / "coco", "coco")
        wds = store.put_tree(root / "wds", "wds")
        self.coco = f"coco:{coco}annotations.json:{coco}"
        self.wds = f"wds:{wds}shard-{{000000..{last:06d}}}.tar"
        self.shards = len(paths)
        self.objects = dict(store.objects)  # (for stores of a test's own)


@pytest.fixture(scope="module")
def store() -> Iterator[ObjectStore]:
    with ObjectStore(delay_ms=30) as s:
        yield s


@pytest.fixture(scope="module")
def sets(store: ObjectStore) -> Iterator[Sets]:
    with tempfile.TemporaryDirectory(prefix="ds-remote-") as d:
        yield Sets(Path(d), store)


@pytest.fixture(scope="module")
def local_epoch(sets: Sets) -> Iterator[dict[int, Epoch]]:
    """Epochs 0 and 1 of the local loose files: what every remote form must give."""
    server = Server("--dataset", sets.local_coco, workers=1)
    try:
        with make_client(server.address, **KW) as client:
            yield {e: epoch_by_index(client, e) for e in (0, 1)}
    finally:
        server.stop()


def _same(got: Epoch, want: Epoch) -> None:
    assert sorted(got) == sorted(want) == list(range(IMAGES))
    for i, (pixels, boxes, labels) in want.items():
        assert got[i][0] == pixels, f"index {i}: other pixels"
        np.testing.assert_array_equal(got[i][1], boxes)
        np.testing.assert_array_equal(got[i][2], labels)


def _settled(server: Server, name: str) -> int:
    """A counter once workers have told it (TALLY: at most a second late)."""
    last = -1
    for _ in range(50):
        now = server.stats()["counters"].get(name, 0)
        if now == last:
            return int(now)
        last = now
        time.sleep(1.2)
    return int(last)


def test_spec_splits_a_remote_coco_at_json_colon() -> None:
    spec = parse_spec("coco:s3://b/coco/ann.json:s3://b/coco/")
    assert spec.args == {"annotations": "s3://b/coco/ann.json", "image_dir": "s3://b/coco/"}
    assert parse_spec("wds:s3://b/t-{000..009}.tar").args == {"pattern": "s3://b/t-{000..009}.tar"}


@pytest.mark.parametrize("form", ["coco", "wds"])
@pytest.mark.parametrize("cache", ["none", "memory", "disk"])
def test_epochs_from_the_store_are_those_of_local_disk(
    start_server: Any,
    store: ObjectStore,
    sets: Sets,
    local_epoch: dict[int, Epoch],
    form: str,
    cache: str,
    tmp_path: Path,
) -> None:
    """Loose objects and shards, behind 30 ms, give the epochs of the same set on local
    disk, bit for bit; with a fetch cache (and no store of decoded sources) the second
    epoch fetches nothing again."""
    flags = {
        "none": ["--fetch-cache-gb", "0"],
        "memory": [],
        "disk": ["--fetch-cache", str(tmp_path)],
    }[cache]
    spec = sets.coco if form == "coco" else sets.wds
    server = start_server("--dataset", spec, "--cache-gb", "0", *flags, env=store.env())
    with make_client(server.address, **KW) as client:
        _same(epoch_by_index(client, 0), local_epoch[0])
        first = _settled(server, "fetches")
        if form == "wds" and cache != "none":  # (a shard's block a GET, into the cache)
            assert 0 < first < IMAGES
        else:
            assert first >= IMAGES  # (every image fetched: no store of decoded sources here)
        _same(epoch_by_index(client, 1), local_epoch[1])
    second = _settled(server, "fetches") - first
    if cache == "none":
        assert second >= IMAGES
    else:
        assert second == 0, f"epoch 2 fetched {second} objects again"
        stats = server.stats()
        assert wait_until(lambda: server.stats()["fetch_cache"]["files"] >= IMAGES, 5)
        assert stats["fetch_cache"]["where"] == cache
    if cache == "disk":
        assert len([p for p in tmp_path.iterdir() if len(p.name) == 40]) >= IMAGES
    assert server.stats()["counters"].get("fetch_errors", 0) == 0


def test_throttling_is_retried(
    start_server: Any, sets: Sets, local_epoch: dict[int, Epoch]
) -> None:
    """A store answering every third request 503 SlowDown: the epoch is the same, the
    retries counted (and timed in ``dataserver_fetch_seconds``)."""
    with ObjectStore(delay_ms=5, fail_every=3) as throttled:
        for key, data in sets.objects.items():
            throttled.put(key, data)
        server = start_server(
            "--dataset", sets.wds, "--cache-gb", "0", "--metrics-port", "0", env=throttled.env()
        )
        with make_client(server.address, **KW) as client:
            _same(epoch_by_index(client, 0), local_epoch[0])
        assert _settled(server, "fetch_retries") > 0
        stats = server.stats()
        assert stats["counters"].get("fetch_errors", 0) == 0
        page = _metrics(server)
        assert "dataserver_fetch_seconds_count" in page and "dataserver_fetch_retries_total" in page


def _metrics(server: Server) -> str:
    port = server.stats()["metrics_port"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return str(r.read().decode())


def test_the_store_killed_mid_epoch_and_restarted(
    start_server: Any, tmp_path: Path, local_epoch: dict[int, Epoch], sets: Sets
) -> None:
    """The store goes away after the first batch and comes back 2 s later: the epoch
    completes, every sample exactly once, the same as from local disk."""
    with ObjectStore(delay_ms=30) as own:
        for key, data in sets.objects.items():
            own.put(key, data)
        server = start_server(
            "--dataset", sets.coco, "--cache-gb", "0", "--fetch-cache-gb", "0", env=own.env()
        )
        with make_client(server.address, **KW, prefetch=1) as client:
            client.set_epoch(0)
            got: Epoch = {}
            restarted = threading.Event()

            def comeback() -> None:
                time.sleep(2.0)
                own.restart_store()
                restarted.set()

            back = threading.Thread(target=comeback)
            for n, batch in enumerate(client):
                if n == 0:
                    own.kill_store()
                    back.start()
                for j, (index,) in enumerate(batch.indices):
                    assert index not in got, f"index {index} delivered twice"
                    t = batch.targets[j]
                    got[index] = (
                        batch.images[j].numpy().tobytes(),
                        t["boxes"].numpy().copy(),
                        t["labels"].numpy().copy(),
                    )
            back.join()
        assert restarted.is_set()
        _same(got, local_epoch[0])
        assert _settled(server, "fetch_retries") > 0


def test_a_missing_object_is_a_sample_error_naming_its_url(
    start_server: Any, tmp_path: Path
) -> None:
    """An image the store does not have: an error naming its URL (raise), or the sample
    left out and counted (skip); the server keeps serving."""
    with ObjectStore(delay_ms=5) as own:
        write_synthetic_coco(tmp_path, images=8, seed=4)
        (tmp_path / "000000000003.jpg").unlink()
        prefix = own.put_tree(tmp_path, "set")
        server = start_server(
            "--dataset",
            f"coco:{prefix}annotations.json:{prefix}",
            "--cache-gb",
            "0",
            env=own.env(),
        )
        with make_client(server.address, **KW) as client:
            delivered, errors = run_epoch_collecting_errors(client, 0)
        assert len(errors) == 1 and f"{prefix}000000000003.jpg" in str(errors[0])
        assert 3 not in delivered and len(delivered) == 4
        assert "not_found" in str(errors[0])
        with make_client(server.address, **KW, on_error="skip") as client:
            client.set_epoch(0)
            batches = list(client)
        assert sorted(i for b in batches for i in b.skipped_indices) == [3]
        assert _settled(server, "fetch_errors") >= 2


def test_credentials_appear_nowhere(start_server: Any, store: ObjectStore, sets: Sets) -> None:
    """Neither the access key id nor the secret is in STATS, the metrics, the client's
    stats or the server's debug log."""
    server = start_server(
        "--dataset", sets.wds, "--metrics-port", "0", "--log-level", "debug", env=store.env()
    )
    with make_client(server.address, **KW) as client:
        epoch_by_index(client, 0)
        seen = [json.dumps(client.stats(), default=str)]
    _settled(server, "fetches")
    seen += [json.dumps(server.stats()), _metrics(server)]
    server.stop()
    seen.append(server_log(server))
    for text in seen:
        assert ACCESS_KEY not in text and SECRET_KEY not in text


def server_log(server: Server) -> str:
    try:
        return server.read_stderr()
    except ValueError:  # (closed by stop: read before)
        return ""


def test_a_wrong_credential_is_one_clear_line_at_start(store: ObjectStore, sets: Sets) -> None:
    """A key the store does not know: ``serve`` exits non-zero at once with one line
    naming the object and "denied", and no secret in it."""
    env = server_env(store.env(key="AKIDWRONGWRONGWRONG1", secret="not-the-secret-123456"))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dataserver.cli",
            "serve",
            "--workers",
            "1",
            "--bind",
            "tcp://127.0.0.1:0",
            "--dataset",
            sets.coco,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert "s3://dsbucket/coco/annotations.json" in lines[0] and "denied" in lines[0]
    assert "not-the-secret-123456" not in proc.stderr


def test_yolo_text_shards(tmp_path: Path) -> None:
    """``KEY.txt`` in YOLO form: boxes scaled by the image's own size; samples in tar
    order; other members ignored."""
    write_synthetic_coco(tmp_path / "c", images=2, seed=1)
    shard = tmp_path / "s-0.tar"
    with tarfile.open(shard, "w") as tar:
        for n, name in enumerate(["000000000001.jpg", "000000000000.jpg"]):
            tar.add(tmp_path / "c" / name, f"k{n}.jpg")
            rows = b"3 0.5 0.5 0.5 0.25\n"
            info = tarfile.TarInfo(f"k{n}.txt")
            info.size = len(rows)
            tar.addfile(info, io.BytesIO(rows))
        info = tarfile.TarInfo("README")
        info.size = 0
        tar.addfile(info, io.BytesIO(b""))
    ds = ShardDataset(str(tmp_path / "s-{0..0}.tar"))
    assert len(ds) == 2 and ds.categories == ()
    sample = ds[0]
    h, w = sample.image.shape[:2]
    np.testing.assert_allclose(sample.boxes, [[w / 4, h * 3 / 8, w * 3 / 4, h * 5 / 8]])
    assert sample.labels.tolist() == [3] and sample.file is not None
    assert sample.file.endswith("s-0.tar#k0.jpg")


@pytest.mark.parametrize("form", ["coco", "wds"])
def test_the_front_fetches_ahead_within_its_bounds(
    start_server: Any, store: ObjectStore, sets: Sets, local_epoch: dict[int, Epoch], form: str
) -> None:
    """The client names its plan's next samples (``Task.ahead``) and the front fetches them
    into the cache its workers read: the epochs are those of local disk, bit for bit, and
    what STATS saw in flight never passed ``--max-fetches`` nor ``--max-fetch-mb``."""
    spec = sets.coco if form == "coco" else sets.wds
    server = start_server(
        "--dataset",
        spec,
        "--cache-gb",
        "0",
        "--max-fetches",
        "3",
        "--max-fetch-mb",
        "1",
        env=store.env(),
    )
    peaks: list[tuple[int, int]] = []
    with make_client(server.address, **KW) as client:
        for epoch in (0, 1):
            client.set_epoch(epoch)
            got: Epoch = {}
            for batch in client:
                p = server.stats()["prefetch"]
                peaks.append((p["in_flight"], p["bytes_in_flight"]))
                for j, (index,) in enumerate(batch.indices):
                    t = batch.targets[j]
                    got[index] = (
                        batch.images[j].numpy().tobytes(),
                        t["boxes"].numpy().copy(),
                        t["labels"].numpy().copy(),
                    )
            _same(got, local_epoch[epoch])
    stats = server.stats()["prefetch"]
    assert stats["max_fetches"] == 3 and stats["max_bytes_in_flight"] == 1 << 20
    assert 1 <= stats["peak_in_flight"] <= 3
    assert 0 < stats["peak_bytes_in_flight"] <= 1 << 20
    assert all(n <= 3 and b <= 1 << 20 for n, b in peaks)
    assert stats["ahead_lists"] >= 1  # (the client named what comes next)
    assert stats["fetched"] >= 1 and stats["failed"] == 0
    # epoch 2 found every sample in the cache; each object was fetched once, by the front
    # or by a worker that came first (the other waits for its GET: ``marks_dir``)
    assert stats["found"] >= IMAGES
    # (+ the annotations, and a few races: a worker and the front both finding no mark;
    # without the marks every object was fetched twice)
    assert _settled(server, "fetches") <= IMAGES + 1 + IMAGES // 4


def test_a_session_cannot_take_every_fetch_slot() -> None:
    """The front's fetcher gives each session that wants something its share of the
    requests and bytes in flight (charged to it), whatever the other has queued."""
    from dataserver.data.remote import Fetcher, FetchSettings
    from dataserver.server.front.prefetch import Prefetcher

    def locate(indices: list[int]) -> list[tuple[str, int | None, int | None]]:
        return [(f"s3://b/shard-{i // 100}.tar", (i % 100) * 1000, 1000) for i in indices]

    open_sessions = {b"a", b"b"}
    fetcher = Fetcher(FetchSettings())
    pre = Prefetcher(fetcher, locate, 8, 1 << 20, live=lambda s: s in open_sessions)
    pre.want(b"a", range(500))
    pre.want(b"b", (), ahead=range(1000, 1010))
    jobs = []
    while (job := pre._next()) is not None:  # (what the pool's threads take, none ending)
        jobs.append(job)
    by = {s: sum(1 for j in jobs if j[0] == s) for s in (b"a", b"b")}
    assert by == {b"a": 4, b"b": 4}
    snap = pre.snapshot()
    assert snap.in_flight == 8 and snap.bytes_in_flight == 8000
    # bytes: a tighter bound stops the requests first
    small = Prefetcher(fetcher, locate, 8, 2500, live=lambda s: True)
    small.want(b"a", range(50))
    taken = []
    while (job := small._next()) is not None:
        taken.append(job)
    assert len(taken) == 2 and small.snapshot().peak_bytes_in_flight == 2000
    # a closed session's wants are dropped: the other gets every slot
    open_sessions.discard(b"a")
    pre2 = Prefetcher(fetcher, locate, 8, 1 << 20, live=lambda s: s in open_sessions)
    pre2.want(b"a", range(100))
    pre2.want(b"b", range(200, 300))
    got = []
    while (job := pre2._next()) is not None:
        got.append(job)
    assert {j[0] for j in got} == {b"b"} and len(got) == 8


def test_a_cached_epoch_is_looked_at_once_per_sample() -> None:
    """Every sample cached (a second epoch): the front's fetcher looks each up once per
    epoch, not once per plan list that names it (each list repeats most of the last; a
    session's record of what it took was dropped whenever it had nothing in flight, so
    each list was looked up whole, under the cache's lock, in the front's process)."""
    from dataserver.data.fetchcache import MemCache, cache_key
    from dataserver.data.remote import Fetcher, FetchSettings
    from dataserver.server.front.prefetch import Prefetcher

    def locate(indices: list[int]) -> list[tuple[str, int | None, int | None]]:
        return [(f"s3://b/shard-{i // 100}.tar", (i % 100) * 1000, 1000) for i in indices]

    cache = MemCache.create(1 << 20)
    fetcher = Fetcher(FetchSettings(mem_fds=cache.fds))
    for where in locate(list(range(300))):
        fetcher._keep(cache_key(*where), b"x")
    open_sessions = {b"a"}
    pre = Prefetcher(fetcher, locate, 8, 1 << 20, live=lambda s: s in open_sessions)
    for epoch in (0, 1):
        for t in range(0, 200, 10):  # a task's sources, then the plan's next 100
            pre.want(b"a", range(t, t + 10), ahead=range(t + 10, t + 110), epoch=epoch)
            assert pre._next() is None  # (nothing to fetch: all found)
        assert pre.snapshot().found == 300 * (epoch + 1)
    assert pre.snapshot().fetched == 0 and pre.snapshot().sessions == 0
    open_sessions.clear()  # closed: its record goes
    assert pre._next() is None and not pre._sessions
    cache.close()


def test_an_older_clients_task_has_no_ahead() -> None:
    """A TASK without ``ahead`` (an older client) reads as none; one with it (a newer
    client) is what an older server skips as an unknown key."""
    from dataserver.protocol import Task, decode

    kw: dict[str, Any] = dict(
        session=b"s" * 8,
        task_id=1,
        plan_version=0,
        epoch=0,
        seed=0,
        images=((1,),),
        grid=1,
        out_hw=(8, 8),
        fit_hw=(8, 8),
        on_error="raise",
        control_seq=0,
    )
    old = decode(Task(**kw).encode())
    assert isinstance(old, Task) and old.ahead == ()
    new = decode(Task(**kw, ahead=(5, 6, 7)).encode())
    assert isinstance(new, Task) and new.ahead == (5, 6, 7)


def test_a_timeout_names_the_object_store_that_stalls(
    start_server: Any, sets: Sets, local_epoch: dict[int, Epoch]
) -> None:
    """The store goes away before an epoch: the client's ``timeout`` error says the
    server's object store is the cause (its root URL and why, no credential); when it comes
    back the epoch from the start is that of local disk."""
    with ObjectStore(delay_ms=30) as own:
        for key, data in sets.objects.items():
            own.put(key, data)
        server = start_server("--dataset", sets.coco, "--cache-gb", "0", env=own.env())
        own.kill_store()
        with make_client(server.address, **KW, timeout=6.0) as client:
            client.set_epoch(0)
            with pytest.raises(Exception) as caught:
                for _ in client:
                    pass
        text = str(caught.value)
        assert "no progress" in text and "object store s3://dsbucket" in text, text
        assert "connection" in text and ACCESS_KEY not in text and SECRET_KEY not in text
        own.restart_store()
        with make_client(server.address, **KW) as client:
            _same(epoch_by_index(client, 0), local_epoch[0])


def test_the_memory_cache_has_no_name_on_the_host(
    start_server: Any, store: ObjectStore, sets: Sets, local_epoch: dict[int, Epoch]
) -> None:
    """The in-memory fetch cache is two sealed memfds the front made and its workers map:
    nothing in ``/dev/shm``, and nothing left behind when the server is SIGKILLed."""
    shm = Path("/dev/shm")
    before = {p.name for p in shm.iterdir() if p.name.startswith("dataserver-fetch")}
    server = start_server("--dataset", sets.coco, "--cache-gb", "0", env=store.env())
    with make_client(server.address, **KW) as client:
        _same(epoch_by_index(client, 0), local_epoch[0])
    assert wait_until(lambda: server.stats()["fetch_cache"]["files"] >= IMAGES, 5)
    assert server.stats()["fetch_cache"]["where"] == "memory"
    fds = open_files(server.pid)
    assert any(t.startswith("/memfd:dataserver-fetch") for t in fds), fds
    now = {p.name for p in shm.iterdir() if p.name.startswith("dataserver-fetch")}
    assert now == before
    os.kill(server.pid, signal.SIGKILL)
    server.proc.wait(10)
    assert {p.name for p in shm.iterdir() if p.name.startswith("dataserver-fetch")} == before


def test_two_servers_are_each_told_their_share_of_the_plan(
    start_server: Any, store: ObjectStore, sets: Sets, local_epoch: dict[int, Epoch]
) -> None:
    """With two servers, each is told the plan's next samples whose key routes to it (and
    fetches them): the epoch is that of local disk, bit for bit."""
    servers = [
        start_server("--dataset", sets.wds, "--cache-gb", "0", env=store.env()) for _ in range(2)
    ]
    with make_client([s.address for s in servers], **KW) as client:
        _same(epoch_by_index(client, 0), local_epoch[0])
    told = [s.stats()["prefetch"] for s in servers]
    assert all(t["ahead_lists"] >= 1 for t in told), told
    assert sum(t["fetched"] for t in told) >= 1 and all(t["failed"] == 0 for t in told)
