"""The in-memory fetch cache (``fetchcache.MemCache``): two sealed memfds, a ring of bytes
and an index; what one process keeps another reads, the oldest go first."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dataserver.data.fetchcache import MemCache, cache_key

pytestmark = pytest.mark.timeout(60)


def key(i: int) -> str:
    return cache_key(f"s3://b/{i}.jpg", None, None)


def test_the_ring_keeps_the_newest_and_another_process_reads_them() -> None:
    cache = MemCache.create(1 << 20)
    for i in range(100):
        cache.put(key(i), bytes([i]) * 20_000)
    usage = cache.usage()
    assert usage.where == "memory" and usage.budget == 1 << 20
    assert usage.bytes <= usage.budget and usage.files == usage.bytes // 20_000
    assert cache.get(key(99)) == bytes([99]) * 20_000
    assert cache.get(key(0)) is None and not cache.holds(key(0))  # (gone round over)
    cache.put(key(1000), b"x" * ((1 << 20) // 4 + 1))  # (over a quarter: not kept)
    assert not cache.holds(key(1000))
    index_fd, arena_fd = cache.fds
    code = (
        "import sys; from dataserver.data.fetchcache import MemCache, cache_key;"
        f"c = MemCache({index_fd}, {arena_fd});"
        "print(c.get(cache_key('s3://b/99.jpg', None, None))[:3]);"
        "c.put(cache_key('s3://b/child.jpg', None, None), b'from the child')"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        pass_fds=cache.fds,
        capture_output=True,
        text=True,
        env=dict(os.environ),
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == repr(bytes([99]) * 3)
    assert cache.get(cache_key("s3://b/child.jpg", None, None)) == b"from the child"
    # no name on the host: the memfds' links say so
    assert os.readlink(f"/proc/self/fd/{arena_fd}").startswith("/memfd:dataserver-fetch")
