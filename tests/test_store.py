"""The store of prepared sources (shared memory, every worker of a server): exact hits,
bounded bytes with the oldest evicted, what is read kept longer, one maker per source
across processes, and survival of processes killed mid-change or mid-make.

And nothing of it on the host's file system: a server's store is a pair of memfds its
workers inherit and check, so nothing in ``/dev/shm`` can stall a server, be swept or be
deleted under one; what a worker is handed that is not a store costs it the store, not
its life."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq
from clients import make_client
from conftest import TESTS, server_env, wait_until

from dataserver import protocol
from dataserver.data.pipeline import Source, fit
from dataserver.data.sample import Sample
from dataserver.protocol import MsgType, Ready, Result, decode
from dataserver.server.store import SEALS, Store, StoreUnusable, store_key
from dataserver.server.store.layout import layout

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parent.parent
SHM = Path("/dev/shm")
STORE_NAMES = ("dataserver-*.index", "dataserver-*.arena")


def source(i: int, side: int = 64) -> Source:
    """A source whose every byte says which it is."""
    image = np.full((3, side, side), i % 251, np.uint8)
    boxes = np.array([[i, i, i + 1, i + 2]], np.float32)
    return Source(image, boxes, np.array([i], np.int64))


def same(a: Source, b: Source) -> bool:
    return (
        np.array_equal(a.image, b.image)
        and np.array_equal(a.boxes, b.boxes)
        and np.array_equal(a.labels, b.labels)
    )


@pytest.fixture
def store() -> Iterator[Store]:
    s = Store.create(4 << 20)
    yield s
    s.close()


def attached(s: Store) -> str:
    """Python source that attaches to ``s`` in a child started with ``pass_fds=s.fds``."""
    index_fd, arena_fd = s.fds
    return f"Store.attach({index_fd}, {arena_fd}, {s.capacity})"


def test_a_source_is_made_once_and_then_read_back_exactly(store: Store) -> None:
    made = []

    def make(i: int) -> Source:
        made.append(i)
        return source(i)

    for i in range(10):
        got, pos = store.get(store_key("ds", i), partial(make, i))
        assert pos == -1 and same(got, source(i))
    for i in range(10):
        got, pos = store.get(store_key("ds", i), partial(make, i))
        assert pos >= 0 and same(got, source(i)) and store.intact(pos)
    assert made == list(range(10))
    assert (store.stats.hits, store.stats.misses) == (10, 10)
    other, _ = store.get(store_key("other", 0), lambda: source(99))
    assert same(other, source(99))  # another key is another source


def test_bytes_are_bounded_and_the_oldest_go_first(store: Store) -> None:
    each = 3 * 128 * 128 + 24  # 48 KiB a source: the 4 MiB store holds about 85
    for i in range(400):
        store.get(store_key("ds", i), partial(source, i, 128))
        assert store.usage()["bytes"] <= store.capacity
    held = [i for i in range(400) if store.index.find(*store_key("ds", i)) >= 0]
    assert held == list(range(400 - len(held), 400))  # a suffix: the newest
    assert len(held) * each > store.capacity * 0.7
    for i in held:  # and they are intact
        got, _ = store.get(store_key("ds", i), partial(source, -1, 128))
        assert same(got, source(i, 128))


def test_what_is_read_is_kept_longer_than_what_is_not(store: Store) -> None:
    hot = store_key("hot")
    store.get(hot, lambda: source(7, 128))
    for i in range(300):  # several turns of the ring, reading the hot one now and then
        store.get(store_key("ds", i), partial(source, i, 128))
        if i % 20 == 0:
            got, _ = store.get(hot, partial(source, -1, 128))
            assert same(got, source(7, 128))
    assert store.stats.refreshes >= 1 and store.index.find(*hot) >= 0


def rss_shmem(pid: int | str = "self") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssShmem:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssShmem")


def test_its_memory_is_committed_up_front_and_a_worker_maps_all_of_it() -> None:
    """The front reserves every page before its workers start (so that no put of a first
    epoch allocates, clears or faults a page), and a worker's handle maps them all at once;
    a put through that mapping reads back exactly, from another handle too."""
    lazy = Store.create(8 << 20, commit=False)
    try:
        assert lazy.committed == 0 and lazy.commit_s == 0.0
    finally:
        lazy.close()
    front = Store.create(8 << 20)
    try:
        assert front.committed == front.capacity and front.commit_s > 0
        assert front.usage()["committed_bytes"] == front.capacity
        before = rss_shmem()
        worker = Store.attach(*front.fds, front.capacity, populate=True)
        try:
            # (in a thread of its own: the whole arena is soon resident in this process)
            assert worker.populated.wait(10)
            assert rss_shmem() - before >= front.capacity * 0.9
            for i in range(40):
                worker.get(store_key("ds", i), partial(source, i, 128))
            other = Store.attach(*front.fds, front.capacity)  # (pwritev, lazily mapped)
            try:
                for i in range(40):
                    got, _ = other.get(store_key("ds", i), partial(source, -1, 128))
                    assert same(got, source(i, 128))
            finally:
                other.close()
        finally:
            worker.close()
    finally:
        front.close()


def test_a_dataset_larger_than_the_store_keeps_a_fixed_subset_and_reads_it_again() -> None:
    """A dataset ~4.7x the store's bytes, read in a new random order each epoch: the store
    admits a fixed subset that fits (the same keys every epoch, in every process), so from
    the second epoch on what it keeps is read, not evicted first: the hit rate is at least
    0.9 x (store bytes / dataset bytes), nothing is evicted and nothing is stored again."""
    n, side = 6400, 64  # (~1,360 fit: the admitted count's spread is small beside the slack)
    each = 3 * side * side + 24
    keys = [store_key("big", i) for i in range(n)]
    rng = np.random.default_rng(0)
    store = Store.create(16 << 20)
    other = Store.attach(*store.fds, store.capacity)
    try:
        stats = []
        for epoch in range(3):
            handle = store if epoch % 2 == 0 else other  # (two workers)
            hits0, skipped0 = handle.stats.hits, handle.stats.skipped
            evictions0 = store.stats.evictions + other.stats.evictions
            for i in map(int, rng.permutation(n)):
                made = partial(lambda _k, i: source(i, side), i=i)
                got, _ = handle.fetch([keys[i]], made, n)
                assert got[0] is not None and same(got[0], source(i, side))
            stats.append(
                (
                    handle.stats.hits - hits0,
                    handle.stats.skipped - skipped0,
                    store.stats.evictions + other.stats.evictions - evictions0,
                )
            )
        usage = store.usage()
        share = store.capacity / (n * each)
        assert 0.7 * share <= usage["admitted"] < share
        assert usage["admission"].startswith(f"a fixed subset ({usage['admitted']:.1%}): {n} ")
        for hits, skipped, evicted in stats[1:]:
            assert hits >= 0.9 * share * n
            assert hits + skipped == n and evicted == 0  # every admitted one was there
        assert stats[1][1] == stats[2][1]  # the same subset, whichever handle asks
    finally:
        other.close()
        store.close()


def test_a_window_mosaics_sources_are_kept_for_its_window_whatever_the_subset() -> None:
    """The same store and dataset, read as window mosaics read it (each position's source
    made, then read again as a partner by the next few positions): with ``fetch_recent``
    every source is kept and none is made twice, though the admitted subset is about a
    fifth; with ``fetch_into`` (the subset), those outside it are made again at each read."""
    n, side = 6400, 64
    keys = [store_key("window", i) for i in range(n)]
    order = [int(i) for i in np.random.default_rng(1).permutation(n)]

    def run(recent: bool) -> int:
        store = Store.create(16 << 20)
        fetch = store.fetch_recent if recent else store.fetch_into
        made = 0

        def make(_k: int, planes_for: Any, i: int = 0) -> Source:
            nonlocal made
            made += 1
            return fitted(i, side, planes_for)

        try:
            for p, i in enumerate(order):  # its source, then 3 partners from 1..24 back
                window = [i] + [order[max(0, p - d)] for d in (1, 9, 24)]
                for j in window:
                    got, _ = fetch([keys[j]], partial(make, i=j), n)
                    assert got[0] is not None and same(got[0], fitted(j, side))
            assert store.usage()["admitted"] < 0.3
        finally:
            store.close()
        return made

    assert run(recent=True) == n  # each source made once, for its own position
    assert run(recent=False) > 2 * n  # (the subset alone: most partners made again)


def fitted(i: int, side: int, planes_for: Any = None) -> Source:
    """Sample ``i`` fitted as a worker fits it (``pipeline.fit``), into ``planes_for``'s
    planes where given."""
    image = np.full((side, side + 8, 3), i % 251, np.uint8)
    boxes = np.array([[1, 2, 10, 12], [3, 3, 3, 9]], np.float32)  # (the second: degenerate)
    sample = Sample(image, boxes, np.array([i, i + 1], np.int64), file=f"img{i}.jpg")
    return fit(sample, (side, side), planes_for=planes_for)


def test_a_source_is_fitted_straight_into_the_store_and_read_back_exactly() -> None:
    """``fetch_into``: a miss is fitted into its place in the store itself (no
    copy), and another handle reads it back whole: planes, boxes, labels, file name."""
    front = Store.create(8 << 20)
    worker = Store.attach(*front.fds, front.capacity, populate=True)
    other = Store.attach(*front.fds, front.capacity)
    try:
        keys = [store_key("into", i) for i in range(20)]
        made, oldest = worker.fetch_into(keys, lambda i, into: fitted(i, 96, into))
        assert oldest >= 0 and worker.intact(oldest)
        for i, got in enumerate(made):
            assert got is not None and np.shares_memory(got.image, worker.index.arena)
            assert same(got, fitted(i, 96))
        for i, key in enumerate(keys):
            back, pos = other.get(key, partial(fitted, -1, 96))
            assert pos >= 0 and same(back, fitted(i, 96)) and back.file == f"img{i}.jpg"
        assert other.stats.hits == 20 and other.stats.misses == 0
    finally:
        for s in (other, worker, front):
            s.close()


def test_a_source_fitted_into_the_store_that_the_ring_overran_is_never_kept() -> None:
    """While a worker fits a source into its reserved bytes, others fill the whole ring:
    the bytes it wrote are gone, so the source is not kept, and the position the fetch
    returns says so (``intact`` False: the worker composes again from scratch)."""
    front = Store.create(4 << 20)
    worker = Store.attach(*front.fds, front.capacity, populate=True)
    other = Store.attach(*front.fds, front.capacity)
    try:

        def make(i: int, into: Any = None) -> Source:
            out = fitted(i, 128, into)
            for j in range(200):  # ~9 MiB through a 4 MiB ring, meanwhile
                other.get(store_key("flood", j), partial(source, j, 128))
            return out

        key = store_key("overrun", 0)
        made, oldest = worker.fetch_into([key], make)
        assert made[0] is not None and not worker.intact(oldest)
        again: list[int] = []

        def remake() -> Source:
            again.append(1)
            return fitted(0, 128)

        other.get(key, remake)
        assert again == [1]  # it was not kept: made again
    finally:
        for s in (other, worker, front):
            s.close()


def test_a_read_written_over_is_caught(store: Store) -> None:
    store.get(store_key("ds", 0), lambda: source(0, 128))
    _, pos = store.get(store_key("ds", 0), lambda: source(0, 128))
    for i in range(1, 200):  # the head laps the entry read above
        store.get(store_key("ds", i), partial(source, i, 128))
    assert not store.intact(pos)


WORKER = textwrap.dedent(
    """
    import sys, time
    from functools import partial
    import numpy as np
    from dataserver.data.pipeline import Source
    from dataserver.server.store import Store, store_key
    index_fd, arena_fd, capacity, start, n = (int(a) for a in sys.argv[1:6])
    seconds = float(sys.argv[6])
    store = Store.attach(index_fd, arena_fd, capacity)
    made = bad = 0
    def make(i):
        global made
        made += 1
        time.sleep(seconds)
        return Source(np.full((3, 32, 32), i % 251, np.uint8), np.array([[i, i, i + 1, i + 2]], np.float32), np.array([i]))
    for k in range(n):
        i = (start + k) % n
        src, pos = store.get(store_key("ds", i), partial(make, i))
        if not (src.image == i % 251).all() or int(src.labels[0]) != i:
            bad += 1
        if not store.intact(pos):
            bad += 1
    print(made, bad, store.stats.waits)
    """
)


def test_processes_share_it_and_each_source_is_made_once() -> None:
    store = Store.create(16 << 20)
    index_fd, arena_fd = store.fds
    try:
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    WORKER,
                    str(index_fd),
                    str(arena_fd),
                    str(store.capacity),
                    str(s),
                    "60",
                    "0.005",
                ],
                stdout=subprocess.PIPE,
                text=True,
                cwd=ROOT,
                pass_fds=store.fds,
            )
            for s in (0, 20, 40, 0)
        ]
        outs = [p.communicate(timeout=60)[0].split() for p in procs]
    finally:
        store.close()
    assert all(p.returncode == 0 for p in procs)
    made = sum(int(o[0]) for o in outs)
    assert sum(int(o[1]) for o in outs) == 0  # every read was the right source, intact
    assert made == 60  # each of the 60 sources made once, by one of the four
    assert sum(int(o[2]) for o in outs) >= 1  # some waited for another's make


def test_each_handle_takes_the_lock_on_its_own(store: Store) -> None:
    """A ``flock`` belongs to an open file description, which inherited descriptors share:
    a handle that locked through them would not exclude the process it inherited them
    from. ``attach`` opens its own."""
    other = Store.attach(*store.fds, store.capacity)
    try:
        store.index.lock()
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(other.fds[0], fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            store.index.unlock()
        other.index.lock()  # free again
        other.index.unlock()
    finally:
        other.close()


def test_a_process_killed_mid_change_leaves_a_store_that_still_works() -> None:
    store = Store.create(4 << 20)
    store.get(store_key("ds", 1), lambda: source(1))
    code = textwrap.dedent(
        f"""
        import os, signal
        from dataserver.server.store import Store
        s = {attached(store)}
        s.index.lock()
        s.index.dirty(True)  # ... and dies here, holding the lock, mid-change
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=30, pass_fds=store.fds)
    assert proc.returncode == -signal.SIGKILL
    start = time.monotonic()
    got, _ = store.get(store_key("ds", 1), lambda: source(1))  # the lock is free again ...
    assert same(got, source(1)) and time.monotonic() - start < 5
    assert store.stats.misses == 2  # ... and the possibly torn index was emptied
    again, pos = store.get(store_key("ds", 1), lambda: source(-1))
    assert same(again, source(1)) and pos >= 0
    store.close()


def test_a_source_whose_maker_died_is_made_by_the_next_one_at_once() -> None:
    store = Store.create(4 << 20)
    code = textwrap.dedent(
        f"""
        import os, signal
        from dataserver.server.store import Store, store_key
        s = {attached(store)}
        s.get(store_key("ds", 5), lambda: os.kill(os.getpid(), signal.SIGKILL))
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=30, pass_fds=store.fds)
    assert proc.returncode == -signal.SIGKILL
    start = time.monotonic()
    got, _ = store.get(store_key("ds", 5), lambda: source(5))
    assert same(got, source(5)) and time.monotonic() - start < 2  # not the 30 s wait
    store.close()


def _memfd(size: int, seals: int = SEALS) -> int:
    fd = os.memfd_create("test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def test_what_a_process_is_handed_is_checked_and_never_blocks_it(tmp_path: Path) -> None:
    """Anything but the store's own sealed memfds is refused with a reason: a pipe, a FIFO
    (checked before it is opened, which would block), a file that can be truncated, a
    memfd without seals or of another size, one without a store's header. The handed
    descriptors are left as they were; a failed attach keeps none of its own."""
    capacity = 1 << 20
    _, index_bytes = layout(capacity)
    good = Store.create(capacity)
    good.get(store_key("seen"), lambda: source(3))
    r, w = os.pipe()
    fifo = tmp_path / "dataserver-x.index"
    os.mkfifo(fifo)
    fifo_fd = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
    plain = os.open(tmp_path / "plain", os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(plain, index_bytes)
    cases = {
        "a pipe": r,
        "a FIFO": fifo_fd,
        "a file that can be truncated": plain,
        "an unsealed memfd": _memfd(index_bytes, seals=0),
        "a memfd of another size": _memfd(index_bytes + 4096),
        "a memfd without a store's header": _memfd(index_bytes),
        "a closed descriptor": 999,
    }
    unsealed_arena = _memfd(capacity, seals=0)
    index, arena = good.fds
    tries = [(what, fd, arena, capacity) for what, fd in cases.items()]
    tries += [
        ("an unsealed arena", index, unsealed_arena, capacity),
        ("a store of another capacity", index, arena, capacity * 2),
    ]
    opened = set(os.listdir("/proc/self/fd"))
    try:
        for what, i, a, c in tries:
            try:
                Store.attach(i, a, c).close()
            except StoreUnusable:
                continue
            pytest.fail(f"{what} was taken for a store")
        assert set(os.listdir("/proc/self/fd")) == opened  # none kept, none closed
        other = Store.attach(*good.fds, capacity)  # the real one still attaches
        got, pos = other.get(store_key("seen"), lambda: source(-1))
        assert same(got, source(3)) and pos >= 0
        other.close()
    finally:
        for fd in (r, w, fifo_fd, plain, unsealed_arena, *cases.values()):
            try:
                os.close(fd)
            except OSError:
                pass
        good.close()


def _memory_cgroup(limit: int) -> Path | None:
    """A child of this process's memory cgroup (v1 or v2) limited to ``limit`` bytes, or
    None where one cannot be made here."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            parent, limit_name = (
                Path("/sys/fs/cgroup/memory") / path.lstrip("/"),
                "memory.limit_in_bytes",
            )
        elif controllers == "":
            parent, limit_name = Path("/sys/fs/cgroup") / path.lstrip("/"), "memory.max"
        else:
            continue
        d = parent / f"ds-test-{os.getpid()}"
        try:
            d.mkdir()
        except OSError:
            continue
        try:
            (d / limit_name).write_text(str(limit))
            return d
        except OSError:
            d.rmdir()
    return None


JOIN = ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"']  # $0: the cgroup


def test_a_store_is_sized_within_its_memory_cgroup_and_filled_without_being_killed() -> None:
    """A memfd's pages count against memory and the memory cgroup, not ``/dev/shm``'s size;
    past a cgroup's limit a reservation meets the OOM killer, not an error. In a 256 MiB
    cgroup, a store sized as the front sizes it (half of ``memory_room``) for a 1 GiB
    ``--cache-gb`` is filled to its end and its owner lives."""
    if os.geteuid() != 0:
        pytest.skip("needs root to make a memory cgroup")
    limit = 256 << 20
    cgroup = _memory_cgroup(limit)
    if cgroup is None:
        pytest.skip("no memory cgroup can be made here")
    code = textwrap.dedent(
        """
        import numpy as np
        from dataserver.data.pipeline import Source
        from dataserver.server.memory import memory_room
        from dataserver.server.store import Store, store_key
        size = min(1 << 30, memory_room() // 2)
        s = Store.create(size)
        image = np.zeros((3, 256, 256), np.uint8)
        none = (np.zeros((0, 4), np.float32), np.zeros(0, np.int64))
        for i in range(size // image.nbytes * 2):  # twice round the ring
            s.get(store_key(i), lambda: Source(image, *none))
        assert s.usage()["capacity_bytes"] == size and int(s.index.header[0]["head"]) > size
        print(size)
        """
    )
    try:
        proc = subprocess.run(
            [*JOIN, str(cgroup), sys.executable, "-c", code],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        cgroup.rmdir()
    assert proc.returncode == 0, f"{proc.returncode}: {proc.stderr[-2000:]}"
    assert 16 << 20 <= int(proc.stdout.split()[-1]) < limit // 2


# ---------------------------------------------------------------- through real servers


def epoch_of(address: str, epoch: int) -> list[Any]:
    with make_client(address, batch_size=8, image_size=(64, 64)) as c:
        c.set_epoch(epoch)
        return list(c)


def indices(batches: list[Any]) -> list[int]:
    return sorted(i for b in batches for idx in b.indices for i in idx)


def store_names() -> set[str]:
    return {p.name for pattern in STORE_NAMES for p in SHM.glob(pattern)}


def maps_the_store(pid: int) -> bool:
    maps = Path(f"/proc/{pid}/maps").read_text()
    return "/memfd:dataserver-store-index" in maps and "/memfd:dataserver-store-arena" in maps


def test_batches_are_bit_identical_with_and_without_the_store_and_later_epochs_hit(
    start_server: Any,
) -> None:
    """Epochs 0 and 1 from a server with a store (the second from its hits) equal those
    from one without, bit for bit; ``dataserver stats`` shows the store's use and no
    path. The server's processes map the store's memfds and no store name appears in
    ``/dev/shm`` while it runs."""
    before = store_names()
    dataset = ("--dataset", "synthetic:images=48,seed=2")
    stored = start_server(*dataset, "--cache-gb", "0.0625", workers=2)
    plain = start_server(*dataset, "--cache-gb", "0", workers=2)
    runs: dict[str, list[Any]] = {}
    for name, server in (("stored", stored), ("plain", plain)):
        runs[name] = [b for e in (0, 1) for b in epoch_of(server.address, e)]
    assert indices(runs["stored"]) == sorted(list(range(48)) * 2)
    assert len(runs["stored"]) == len(runs["plain"])
    for a, b in zip(runs["stored"], runs["plain"], strict=True):
        assert a.indices == b.indices
        assert np.array_equal(a.images.numpy(), b.images.numpy())
    # (the store's usage in stats is at most a few seconds old)
    assert wait_until(lambda: stored.stats()["store"]["entries"] == 48, 10)
    stats = stored.stats()
    info = stats["store"]
    assert set(info) == {
        "entries",
        "bytes",
        "capacity_bytes",
        "committed_bytes",
        "admitted",
        "mean_entry_bytes",
        "admission",
        "hit_rate",
    }
    assert info["hit_rate"] > 0 and 0 < info["bytes"] <= info["capacity_bytes"]
    assert info["capacity_bytes"] == int(0.0625 * (1 << 30))
    # Its memory was committed before the server said it was ready; 48 sources fit: all kept.
    assert info["committed_bytes"] == info["capacity_bytes"]
    assert info["admitted"] == 1.0 and info["mean_entry_bytes"] > 0
    assert info["admission"].startswith("all: 48 sources x "), info["admission"]
    assert stats["counters"].get("workers_without_store", 0) == 0
    assert plain.stats()["store"] is None
    assert all(maps_the_store(pid) for pid in [stored.pid, *stored.worker_pids()])
    assert store_names() <= before  # (names another program left are not ours to judge)


def _private_shm_or_skip() -> list[str]:
    """The command prefix that runs a program with a private, empty ``/dev/shm`` (a mount
    namespace): what these tests plant and delete there touches no other process."""
    if os.geteuid() != 0 or not all(shutil.which(p) for p in ("unshare", "runuser", "mkfifo")):
        pytest.skip("needs root, unshare, runuser and mkfifo")
    mount = 'mount -t tmpfs -o mode=1777,size=512m tmpfs /dev/shm && exec "$@"'
    prefix = ["unshare", "-m", "--propagation", "private", "sh", "-c", mount, "sh"]
    probe = subprocess.run([*prefix, "true"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a private /dev/shm here: {probe.stderr[-300:]}")
    return prefix


DRIVER_HEAD = textwrap.dedent(
    f"""
    import json, os, signal, subprocess, sys, time
    from pathlib import Path
    sys.path.insert(0, {str(TESTS)!r})
    from conftest import Server, wait_until
    from fuzz_targets import welcome_of
    from clients import make_client

    def epoch(address, e):
        with make_client(address, batch_size=8, image_size=(64, 64)) as c:
            c.set_epoch(e)
            return sorted(i for b in c for idx in b.indices for i in idx)
    """
)


def run_driver(body: str) -> dict[str, Any]:
    prefix = _private_shm_or_skip()
    proc = subprocess.run(
        [*prefix, sys.executable, "-c", DRIVER_HEAD + textwrap.dedent(body)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=150,
        env=server_env(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def test_fifos_planted_by_another_user_do_not_stall_a_new_server() -> None:
    """uid 65534 plants FIFOs under store names (opening one blocks until a writer comes):
    a new server prints its ready line (the 60 s allowed only turn a hang into a
    failure), serves an exact epoch, and leaves the FIFOs alone."""
    out = run_driver(
        """
        plant = ["mkfifo", "/dev/shm/dataserver-x.index", "/dev/shm/dataserver-y.arena"]
        subprocess.run(["runuser", "-u", "nobody", "--", *plant], check=True)
        fifos = sorted(p.name for p in Path("/dev/shm").iterdir() if p.is_fifo())
        start = time.monotonic()
        server = Server("--dataset", "synthetic:images=32,seed=1", "--cache-gb", "0.0625", ready_timeout=60)
        try:
            ready_s = time.monotonic() - start
            got = epoch(server.address, 0)
            store = server.stats()["store"]
        finally:
            server.stop()
        left = sorted(p.name for p in Path("/dev/shm").iterdir() if p.is_fifo())
        owners = sorted({p.stat().st_uid for p in Path("/dev/shm").iterdir() if p.is_fifo()})
        print(json.dumps({"fifos": fifos, "left": left, "owners": owners, "got": got, "store": store, "ready_s": ready_s}))
        """
    )
    assert out["fifos"] == ["dataserver-x.index", "dataserver-y.arena"]
    assert out["owners"] == [65534]
    assert out["got"] == list(range(32))
    assert out["store"] is not None and out["store"]["capacity_bytes"] > 0
    assert out["left"] == out["fifos"]  # not swept, not opened
    print(f"\nready {out['ready_s']:.1f} s after start with FIFOs planted")


def test_a_replaced_worker_maps_the_store_whatever_is_deleted_in_dev_shm() -> None:
    """Every ``/dev/shm/dataserver-*`` is removed (as systemd's RemoveIPC would), then a
    worker is SIGKILLed: its replacement maps the same store (it was never a name there)
    and epoch 1 is served exactly, from the store's hits."""
    out = run_driver(
        """
        def remove_all():
            for p in Path("/dev/shm").glob("dataserver-*"):
                p.unlink()
                removed.append(p.name)

        removed = []
        server = Server("--dataset", "synthetic:images=48,seed=2", "--cache-gb", "0.0625", workers=2)
        try:
            first = epoch(server.address, 0)
            remove_all()
            old = server.worker_pids()
            os.kill(old[0], signal.SIGKILL)
            assert wait_until(lambda: len(set(server.worker_pids()) - set(old)) == 1 and len(server.worker_pids()) == 2, 30)
            new = (set(server.worker_pids()) - set(old)).pop()
            # until the replacement is READY (its endpoint is in a WELCOME again)
            assert wait_until(lambda: len(welcome_of(server.address).results) == 2, 60)
            remove_all()
            before = server.stats()["counters"].get("sources_reused", 0)
            second = epoch(server.address, 1)
            stats = server.stats()
            maps = Path(f"/proc/{new}/maps").read_text()
        finally:
            server.stop()
        print(json.dumps({
            "first": first, "second": second, "removed": removed,
            "reused": stats["counters"].get("sources_reused", 0) - before,
            "hit_rate": stats["store"]["hit_rate"],
            "without": stats["counters"].get("workers_without_store", 0),
            "mapped": "/memfd:dataserver-store-arena" in maps,
        }))
        """
    )
    assert out["first"] == out["second"] == list(range(48))
    assert out["mapped"] and out["without"] == 0
    assert out["reused"] > 0 and out["hit_rate"] > 0
    print(f"\nepoch 1 after a worker was replaced: {out['reused']} of 48 sources from the store")


def test_a_worker_handed_an_unusable_store_serves_without_it(tmp_path: Path) -> None:
    """A worker given a pipe for its store's descriptors (as if what it inherited were not
    the store) says so in its READY, logs it once, and serves tasks: it is not a worker
    that cannot start (which the front would replace, in a loop)."""
    r, w = os.pipe()
    ctx = zmq.Context()
    front = ctx.socket(zmq.ROUTER)
    front.setsockopt(zmq.LINGER, 0)
    front.bind(f"ipc://{tmp_path}/backend")
    cmd = [
        sys.executable,
        "-m",
        "dataserver.server.worker.worker",
        "--backend",
        f"ipc://{tmp_path}/backend",
        "--worker-id",
        "0",
        "--parent-pid",
        str(os.getpid()),
        "--dataset",
        "synthetic:images=8,seed=1",
        "--store-fds",
        f"{r},{w}",
        "--store-bytes",
        str(64 << 20),
        "--state-dir",
        str(tmp_path),
    ]
    proc = subprocess.Popen(
        cmd, pass_fds=(r, w), stderr=subprocess.PIPE, text=True, env=server_env(), cwd=ROOT
    )
    try:
        assert front.poll(60_000), "no READY"
        identity, *frames = front.recv_multipart()
        ready = decode(frames)
        assert isinstance(ready, Ready) and ready.store is False
        from fuzzing import task_header

        header = task_header(b"s" * 16, 1, images=[[3]], side=32)
        front.send_multipart([identity, *protocol.pack(MsgType.TASK, header)])
        assert front.poll(60_000), "no answer to the task"
        _, *frames = front.recv_multipart()
        result = decode(frames)
        assert isinstance(result, Result) and result.task_id == 1 and not result.failed
        assert proc.poll() is None
    finally:
        proc.kill()
        _, err = proc.communicate(timeout=10)
        front.close()
        ctx.term()
        os.close(r)
        os.close(w)
    assert err.count("unusable") == 1, err[-2000:]
