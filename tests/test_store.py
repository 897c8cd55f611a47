"""The store of prepared sources (shared memory, every worker of a server): exact hits,
bounded bytes with the oldest evicted, what is read kept longer, one maker per source
across processes, and survival of processes killed mid-change or mid-make."""

from __future__ import annotations

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

import numpy as np
import pytest

from dataserver.data.pipeline import Source
from dataserver.server.store import Store, store_key, sweep

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parent.parent


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
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store.create(tmp_path, "dataserver-test", 4 << 20)
    yield s
    s.close()


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
    held = [i for i in range(400) if store._find(*store_key("ds", i)) >= 0]
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
    assert store.stats.refreshes >= 1 and store._find(*hot) >= 0


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
    prefix, capacity, start, n, seconds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
    store = Store(prefix, capacity)
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


def test_processes_share_it_and_each_source_is_made_once(tmp_path: Path) -> None:
    store = Store.create(tmp_path, "dataserver-share", 16 << 20)
    try:
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    WORKER,
                    store.prefix,
                    str(store.capacity),
                    str(s),
                    "60",
                    "0.005",
                ],
                stdout=subprocess.PIPE,
                text=True,
                cwd=ROOT,
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


def test_a_process_killed_mid_change_leaves_a_store_that_still_works(tmp_path: Path) -> None:
    store = Store.create(tmp_path, "dataserver-kill", 4 << 20)
    store.get(store_key("ds", 1), lambda: source(1))
    code = textwrap.dedent(
        f"""
        import os, signal
        from dataserver.server.store import Store
        s = Store({store.prefix!r}, {store.capacity})
        s._lock()
        s._dirty(True)  # ... and dies here, holding the lock, mid-change
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=30)
    assert proc.returncode == -signal.SIGKILL
    start = time.monotonic()
    got, _ = store.get(store_key("ds", 1), lambda: source(1))  # the lock is free again ...
    assert same(got, source(1)) and time.monotonic() - start < 5
    assert store.stats.misses == 2  # ... and the possibly torn index was emptied
    again, pos = store.get(store_key("ds", 1), lambda: source(-1))
    assert same(again, source(1)) and pos >= 0
    store.close()


def test_a_source_whose_maker_died_is_made_by_the_next_one_at_once(tmp_path: Path) -> None:
    store = Store.create(tmp_path, "dataserver-pending", 4 << 20)
    code = textwrap.dedent(
        f"""
        import os, signal
        from dataserver.server.store import Store, store_key
        s = Store({store.prefix!r}, {store.capacity})
        s.get(store_key("ds", 5), lambda: os.kill(os.getpid(), signal.SIGKILL))
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=30)
    assert proc.returncode == -signal.SIGKILL
    start = time.monotonic()
    got, _ = store.get(store_key("ds", 5), lambda: source(5))
    assert same(got, source(5)) and time.monotonic() - start < 2  # not the 30 s wait
    store.close()


def test_stores_of_dead_fronts_are_swept(tmp_path: Path) -> None:
    code = textwrap.dedent(
        f"""
        import os, signal
        from pathlib import Path
        from dataserver.server.store import Store
        Store.create(Path({str(tmp_path)!r}), "dataserver-dead", 1 << 20)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=30)
    assert (tmp_path / "dataserver-dead.arena").exists()
    live = Store.create(tmp_path, "dataserver-live", 1 << 20)
    sweep(tmp_path)
    assert not (tmp_path / "dataserver-dead.arena").exists()
    assert (tmp_path / "dataserver-live.arena").exists()  # its front (this process) lives
    live.close()


def test_a_store_larger_than_its_shared_memory_shrinks_instead_of_crashing(tmp_path: Path) -> None:
    """In a 24 MiB tmpfs (a container's small /dev/shm), a 64 MiB store: writes past the
    memory there is would kill the process (SIGBUS); the ring stops where memory ends."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare to mount a small tmpfs")
    code = textwrap.dedent(
        f"""
        import subprocess, sys
        import numpy as np
        from pathlib import Path
        from dataserver.data.pipeline import Source
        from dataserver.server.store import Store, store_key
        d = Path({str(tmp_path / "shm")!r})
        d.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(d)], check=True)
        s = Store.create(d, "dataserver-small", 64 << 20)
        for i in range(400):
            s.get(store_key(i), lambda i=i: Source(np.full((3, 256, 256), i % 251, np.uint8), np.zeros((0, 4), np.float32), np.zeros(0, np.int64)))
        got, pos = s.get(store_key(399), lambda: None)
        assert (got.image == 399 % 251).all() and pos >= 0
        print(s.usage()["capacity_bytes"] >> 20)
        """
    )
    proc = subprocess.run(
        ["unshare", "-m", sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    if proc.returncode != 0 and "mount" in proc.stderr and "permission" in proc.stderr.lower():
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr[-200:]}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert int(proc.stdout.split()[-1]) <= 24
