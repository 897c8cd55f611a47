"""Reading bytes from a path or a URL: local files, or objects in S3, GCS, Azure or over
HTTP(S) through obstore (the Rust ``object_store``; the server-side extra ``remote``).

    read_bytes("images/1.jpg")                          a local file
    read_bytes("s3://bucket/coco/1.jpg")                an object, whole
    read_bytes("s3://bucket/train-000.tar", 512, 9000)  a byte range of one

Credentials and endpoints come from each cloud's standard environment (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL`` (``http://`` allowed as given),
``GOOGLE_APPLICATION_CREDENTIALS``, ``AZURE_STORAGE_ACCOUNT_NAME``, ...), read by obstore in
each process; they are never sent to clients, and an error names the object's URL only
(the text of a store's error is cut to its first line and any credential value in the
environment blotted out).

Each process has one ``Fetcher`` (``configure`` it first with the server's flags): a GET
is retried on throttling (503/429), timeouts, resets, 5xx and short bodies with capped
exponential backoff and full jitter, within a per-request timeout, at most ``attempts``
times, and only while the process's retry budget (a token bucket refilled by successes)
lasts; then ``FetchError`` naming the URL and the kind of failure. Fetched bytes go
through the fetch cache (``fetchcache``). Where the server's front fetches ahead
(``dataserver/server/front/prefetch.py``: what the sessions' plans ask next), a worker reads the
cache, waits for an object the front is fetching (its mark in ``marks_dir``) and GETs only
what neither has; elsewhere ``prefetch`` starts GETs in a bounded pool of threads
(``--max-fetches`` requests in flight) so that a task's objects arrive together. ``stall``
says why nothing is fetched while a store fails (the front's heartbeat replies).

Over the house's ~500 lines (about 625): the one path for remote bytes (URLs, settings, the
retry budget, the tally, obstore), shared by the server's reads, its fetching ahead and the
index.
"""

from __future__ import annotations

import os
import random
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from dataserver.data.fetchcache import ByteCache, CacheUsage, MemCache, cache_key
from dataserver.protocol.messages import FETCH_ERROR_KINDS, MAX_FETCH_TIMES

REMOTE_PREFIXES = ("s3://", "gs://", "az://", "http://", "https://")
DEFAULT_MAX_FETCHES = 64  # GETs in flight per server (--max-fetches), shared by its workers
DEFAULT_MAX_FETCH_MB = 256  # bytes in flight per server (--max-fetch-mb)
DEFAULT_FETCH_CACHE_GB = 1.0
# The variables whose values never appear in an error (whatever a store's error said).
_SECRET_ENV = re.compile(r"(KEY|SECRET|TOKEN|PASSWORD|CREDENTIAL|SAS)", re.IGNORECASE)
_RETRYABLE = frozenset({"throttled", "timeout", "server", "connection", "short", "other"})
HELD_PER_FETCH = 4  # prefetches kept unread, per request in flight
TALLY_SECONDS = 4096  # at most this many latencies kept between two takes
MARK_POLL_S = 0.002  # how often a worker looks for an object the front is fetching


def is_remote(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a URL of an object store (s3, gs, az) or an HTTP(S) server."""
    return isinstance(path, str) and path.startswith(REMOTE_PREFIXES)


def join(base: str, name: str) -> str:
    """``name`` under ``base`` (a folder path or a URL prefix)."""
    if is_remote(base):
        return base + name if base.endswith("/") else f"{base}/{name}"
    return os.path.join(base, name)


def parent(path: str) -> str:
    """The folder (or URL prefix, ending with ``/``) that holds ``path``."""
    if is_remote(path):
        return path[: path.rstrip("/").rfind("/") + 1]
    return os.path.dirname(path) or "."


class FetchError(OSError):
    """An object that could not be read: ``url``, and ``kind`` (not_found, denied,
    throttled, timeout, server, connection, short, other, missing_library)."""

    def __init__(self, url: str, kind: str, detail: str) -> None:
        super().__init__(f"{url}: {kind}: {detail}")
        self.url = url
        self.kind = kind
        self.strerror = f"{kind}: {detail}"


@dataclass(frozen=True)
class FetchSettings:
    """A process's fetch settings (from ``serve``'s flags, through ``WorkerConfig``)."""

    cache_dir: str | None = None  # the cache directory (None: no cache)
    cache_where: str = "memory"  # "memory" (/dev/shm, the front's) or "disk" (--fetch-cache)
    cache_bytes: int = 0  # this process's share of --fetch-cache-gb
    share: tuple[int, int] = (0, 1)  # (slot, slots) sharing the directory
    max_fetches: int = 16  # this process's requests in flight (prefetches)
    max_bytes_in_flight: int = DEFAULT_MAX_FETCH_MB << 20
    # False: the front fetches ahead (``server/front/prefetch.py``); this process's ``prefetch``
    # does nothing (it would only fetch again what the front has in flight)
    prefetch: bool = True
    # Where the front marks the objects it is fetching (an empty file a cache key, in its
    # private state directory): a worker that misses one waits for it to land rather than
    # GET it a second time (None: no front fetching)
    marks_dir: str | None = None
    # the in-memory cache's memfds (``fetchcache.MemCache``: index, bytes), in place of
    # ``cache_dir``'s files (which then holds only what ``read_shared`` keeps)
    mem_fds: tuple[int, int] | None = None
    timeout_s: float = 20.0  # one request, whole
    connect_timeout_s: float = 5.0
    attempts: int = 8  # tries of one request
    backoff_s: float = 0.05  # the first retry's backoff (then doubled, capped, jittered)
    backoff_cap_s: float = 2.0
    budget_start: float = 50.0  # retry tokens at start; +budget_per_fetch per success
    budget_per_fetch: float = 0.2
    budget_max: float = 200.0
    # A store that cannot be reached (refused, reset before an answer) is waited for, not
    # given up on, this long: it went away and comes back (the client's ``timeout`` is
    # what bounds the wait of a trainer); then the sample's error.
    outage_s: float = 120.0


@dataclass
class FetchTally:
    """What a process fetched since the last ``take_tally`` (a worker sends it to the
    front in its TALLY)."""

    fetches: int = 0
    bytes: int = 0
    retries: int = 0
    errors: int = 0
    kinds: dict[str, int] = field(default_factory=dict)  # errors by ``FetchError.kind``
    seconds: list[float] = field(default_factory=list)  # each successful GET's latency

    def __bool__(self) -> bool:
        return bool(self.fetches or self.retries or self.errors)

    def tally_fields(self) -> dict[str, Any]:
        """These counts as a TALLY's fields (within its bounds): a worker's own, or the
        front's fetcher's, counted as a worker's."""
        return {
            "fetches": self.fetches,
            "fetch_bytes": self.bytes,
            "fetch_retries": self.retries,
            "fetch_errors": self.errors,
            "fetch_error_kinds": dict(list(self.kinds.items())[:FETCH_ERROR_KINDS]),
            "fetch_us": tuple(int(s * 1e6) for s in self.seconds[:MAX_FETCH_TIMES]),
        }


def _scrub(text: str) -> str:
    """A store's error text fit to show: its first line, at most 300 characters, with the
    value of every credential-like variable of the environment blotted out."""
    line = text.strip().splitlines()[0] if text.strip() else ""
    for name, value in os.environ.items():
        if len(value) >= 4 and _SECRET_ENV.search(name) and value in line:
            line = line.replace(value, "***")
    return line[:300]


def _kind(exc: BaseException) -> str:
    """The kind of a failed GET (what decides a retry, and what the error says)."""
    if isinstance(exc, FileNotFoundError):
        return "not_found"
    name = type(exc).__name__
    if name in ("PermissionDeniedError", "UnauthenticatedError"):
        return "denied"
    # (the first line: what follows is the library's debug dump, "retry_timeout: 180s"...)
    text = str(exc).strip().split("\n", 1)[0]
    # (durations are no status: "Error performing GET ... in 572.633µs" is no 5xx)
    text = re.sub(r"\b\d+(\.\d+)?\s*(µs|us|ms|ns|s)\b", "", text)
    if re.search(r"\b(503|429)\b|SlowDown|Too Many Requests|Throttl", text):
        return "throttled"
    if re.search(r"\b(401|403)\b|InvalidAccessKeyId|SignatureDoesNotMatch|AccessDenied", text):
        return "denied"
    if re.search(r"\b404\b|NoSuchKey|NoSuchBucket", text):
        return "not_found"
    if re.search(r"\b5\d\d\b", text):
        return "server"
    if re.search(r"timed out|[Tt]imeout", text):
        return "timeout"
    if re.search(r"[Cc]onnect|reset|refused|broken pipe|[Ee]rror sending request|closed", text):
        return "connection"
    return "other"


def _split(url: str) -> tuple[str, str]:
    """(the store's root URL, the object's path in it): ``s3://b/k`` -> (``s3://b``, ``k``);
    ``https://host:port/a/b`` -> (``https://host:port``, ``a/b``)."""
    scheme, _, rest = url.partition("://")
    root, _, key = rest.partition("/")
    if not root or not key:
        raise FetchError(url, "other", "expected SCHEME://BUCKET/KEY (or https://HOST/PATH)")
    return f"{scheme}://{root}", key


class _Budget:
    """The retry budget: a token bucket, a retry costs one, a success refills a little (so
    a store that fails everything stops being asked again after a while)."""

    def __init__(self, settings: FetchSettings) -> None:
        self._tokens = settings.budget_start
        self._per = settings.budget_per_fetch
        self._max = settings.budget_max
        self._lock = threading.Lock()

    def take(self) -> bool:
        with self._lock:
            if self._tokens < 1.0:
                return False
            self._tokens -= 1.0
            return True

    def refill(self) -> None:
        with self._lock:
            self._tokens = min(self._max, self._tokens + self._per)


class Fetcher:
    """A process's object-store reads: stores by root URL, retries, the cache, prefetches."""

    def __init__(self, settings: FetchSettings) -> None:
        self.settings = settings
        self._stores: dict[str, Any] = {}
        self._lock = threading.Lock()  # stores, pending, the tally
        self._budget = _Budget(settings)
        self._tally = FetchTally()
        # Prefetches, running or done and not yet read (read once, then forgotten; the
        # oldest done ones beyond ``HELD_PER_FETCH`` x max_fetches are dropped unread).
        self._pending: OrderedDict[str, Future[bytes]] = OrderedDict()
        self._pending_bytes = 0  # known bytes of those still running
        self._pool: ThreadPoolExecutor | None = None
        self.cache: ByteCache | MemCache | None = None
        if settings.mem_fds is not None:
            self.cache = MemCache(*settings.mem_fds)
        elif settings.cache_dir is not None and settings.cache_bytes > 0:
            self.cache = ByteCache(
                settings.cache_dir, settings.cache_bytes, settings.share, settings.cache_where
            )
        self._cache_lock = threading.Lock()
        # the store's health: since when its GETs have failed with no success between
        # (0: the last one answered), the last failure's kind and store (``stall``)
        self._failing_since = 0.0
        self._failure = ("", "")

    def _store(self, root: str) -> Any:
        with self._lock:
            store = self._stores.get(root)
        if store is not None:
            return store
        try:
            from obstore.store import from_url
        except ImportError:
            raise FetchError(
                root, "missing_library", 'install the extra: pip install "dataserver[remote]"'
            ) from None
        s = self.settings
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL", "")
        options: dict[str, Any] = {
            "timeout": f"{int(s.timeout_s * 1000)}ms",
            "connect_timeout": f"{int(s.connect_timeout_s * 1000)}ms",
            "allow_http": root.startswith("http://") or endpoint.startswith("http://"),
        }
        try:  # retries are ours (counted, budgeted): the library's are off
            make: Any = from_url  # (its overloads are per scheme; the root's says which)
            store = make(root, client_options=options, retry_config={"max_retries": 0})
        except Exception as exc:
            raise FetchError(root, "other", _scrub(str(exc))) from None
        with self._lock:
            return self._stores.setdefault(root, store)

    def _get(self, url: str, start: int | None, length: int | None) -> bytes:
        """One object (or range), retried as the module's docstring says."""
        import obstore

        root, key = _split(url)
        store = self._store(root)
        s = self.settings
        attempt = 0
        first_failure = 0.0
        while True:
            began = time.perf_counter()
            try:
                if start is None:
                    data = bytes(obstore.get(store, key).bytes())
                else:
                    data = bytes(obstore.get_range(store, key, start=start, length=length or 0))
                if length is not None and len(data) != length:
                    raise ConnectionError(f"short body: {len(data)} of {length} bytes")
            except Exception as exc:
                kind = "short" if "short body" in str(exc) else _kind(exc)
                with self._lock:
                    self._failing_since = self._failing_since or began
                    self._failure = (kind, root)
                attempt += 1
                first_failure = first_failure or began
                if kind == "connection" and began - first_failure < s.outage_s:
                    attempt = min(attempt, s.attempts - 1)  # (gone: waited for, not budgeted)
                elif kind not in _RETRYABLE or attempt >= s.attempts or not self._budget.take():
                    self._count_error(kind)
                    raise FetchError(url, kind, _scrub(str(exc))) from None
                with self._lock:
                    self._tally.retries += 1
                pause = min(s.backoff_cap_s, s.backoff_s * (2 ** (attempt - 1)))
                time.sleep(random.uniform(0.0, pause))  # full jitter
                continue
            seconds = time.perf_counter() - began
            self._budget.refill()
            with self._lock:
                self._failing_since = 0.0
                tally = self._tally
                tally.fetches += 1
                tally.bytes += len(data)
                if len(tally.seconds) < TALLY_SECONDS:
                    tally.seconds.append(seconds)
            return data

    def _count_error(self, kind: str) -> None:
        with self._lock:
            tally = self._tally
            tally.errors += 1
            tally.kinds[kind] = tally.kinds.get(kind, 0) + 1

    def holds(self, key: str) -> bool:
        """Whether the cache holds ``key``'s bytes now (a file there, whoever wrote it)."""
        if self.cache is None:
            return False
        with self._cache_lock:
            return self.cache.holds(key)

    def fetch_to_cache(self, url: str, start: int | None, length: int | None) -> int:
        """Fetch an object (or range) into the cache; its size. Raises ``FetchError``."""
        return len(self._fetch_and_keep(cache_key(url, start, length), url, start, length))

    def fetch_block_to_cache(
        self, url: str, start: int, length: int, parts: Sequence[tuple[int, int]]
    ) -> int:
        """One byte-range GET of ``length`` bytes at ``start`` of ``url``, kept in the cache
        as the ranges ``parts`` (start, length) it holds, those not held already (each
        marked as being fetched meanwhile: a worker that reads one waits for this GET, never
        makes its own). Its size; raises ``FetchError``. Nothing without a cache."""
        if self.cache is None:
            return 0
        keys = [(cache_key(url, s, n), s, n) for s, n in parts]
        keys = [k for k in keys if not self.holds(k[0])]
        with self._marking([key for key, _, _ in keys]):
            data = memoryview(self._get(url, start, length))
            for key, s, n in keys:
                if start <= s and s + n <= start + len(data):
                    self._keep(key, bytes(data[s - start : s - start + n]))
        return len(data)

    def cache_bytes(self) -> int:
        """What the cache may hold (0: no cache)."""
        return 0 if self.cache is None else int(self.cache.budget)

    def marked(self, key: str) -> bool:
        """Whether some process of the server is fetching ``key`` now (its mark is there)."""
        marks = self.settings.marks_dir
        return marks is not None and os.path.exists(os.path.join(marks, key))

    def _landed(self, key: str) -> bytes | None:
        """The bytes of ``key`` once the front's fetch of it (marked) ends, or None: not
        being fetched, failed, or longer than a request may take."""
        if self.settings.marks_dir is None:
            return None
        mark = os.path.join(self.settings.marks_dir, key)
        deadline = time.monotonic() + self.settings.timeout_s * 2
        while os.path.exists(mark) and time.monotonic() < deadline:
            time.sleep(MARK_POLL_S)
            data = self._cached(key)
            if data is not None:
                return data
        return self._cached(key)

    def _cached(self, key: str) -> bytes | None:
        if self.cache is None:
            return None
        with self._cache_lock:
            return self.cache.get(key)

    def _keep(self, key: str, data: bytes) -> None:
        if self.cache is not None:
            with self._cache_lock:
                self.cache.put(key, data)

    def _fetch_and_keep(self, key: str, url: str, start: int | None, length: int | None) -> bytes:
        """GET it and keep it, marked as being fetched meanwhile (``marks_dir``: the front
        and the workers then wait for each other's GET of an object, never make two)."""
        with self._marking([key]):
            data = self._get(url, start, length)
            self._keep(key, data)
        return data

    @contextmanager
    def _marking(self, keys: list[str]) -> Iterator[None]:
        """``keys`` marked as being fetched by this process meanwhile (``marks_dir``)."""
        marks = self.settings.marks_dir
        made: list[str] = []
        for key in keys if marks is not None else ():
            mark = os.path.join(marks or "", key)
            try:
                os.close(os.open(mark, os.O_CREAT | os.O_WRONLY, 0o600))
                made.append(mark)
            except OSError:
                pass
        try:
            yield
        finally:
            for mark in made:
                try:
                    os.unlink(mark)
                except OSError:
                    pass

    def read(self, url: str, start: int | None = None, length: int | None = None) -> bytes:
        """The object's bytes (``length`` of them from ``start``, when given): from the
        cache, a prefetch in flight, or a GET now. Raises ``FetchError``."""
        key = cache_key(url, start, length)
        data = self._cached(key)
        if data is None:
            data = self._landed(key)
        if data is not None:
            return data
        with self._lock:
            pending = self._pending.pop(key, None)
        if pending is not None:
            try:
                return pending.result()
            except FetchError:
                pass  # (a prefetch failed: try once more here, it raises for this sample)
        return self._fetch_and_keep(key, url, start, length)

    def read_uncached(self, url: str) -> bytes:
        """A whole object, fetched now and not kept (a shard read once for its index)."""
        return self._get(url, None, None)

    def prefetch(self, wanted: Iterable[tuple[str, int | None, int | None]]) -> int:
        """Start GETs of the objects (url, start, length) not cached nor in flight, at most
        ``max_fetches`` running and ``max_bytes_in_flight`` of known ranges pending (the
        rest are read when asked for). Returns how many were started."""
        s = self.settings
        started = 0
        if not s.prefetch:
            return 0
        for url, start, length in wanted:
            key = cache_key(url, start, length)
            with self._lock:
                if key in self._pending:
                    continue
                if self._pending_bytes + (length or 0) > s.max_bytes_in_flight:
                    break
            if self.holds(key):
                continue
            with self._lock:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(s.max_fetches, thread_name_prefix="fetch")
                future = self._pool.submit(self._fetch_and_keep, key, url, start, length)
                self._pending[key] = future
                self._pending_bytes += length or 0
                self._trim()
            future.add_done_callback(partial(self._settle, key, length or 0))
            started += 1
        return started

    def _settle(self, key: str, nbytes: int, _done: Future[bytes]) -> None:
        with self._lock:
            self._pending_bytes -= nbytes

    def _trim(self) -> None:
        """Forget the oldest finished prefetches nobody read (a task cancelled, a sample
        the store had after all), beyond what is kept (under ``_lock``)."""
        extra = len(self._pending) - HELD_PER_FETCH * self.settings.max_fetches
        for key in list(self._pending)[: max(0, extra)]:
            if self._pending[key].done():
                del self._pending[key]

    def in_flight(self) -> tuple[int, int]:
        """(prefetches pending, their known bytes)."""
        with self._lock:
            return len(self._pending), self._pending_bytes

    def size(self, url: str) -> int:
        """An object's size in bytes (a HEAD, retried as a GET is)."""
        return int(self._head(url)["size"])

    def read_shared(self, url: str) -> bytes:
        """A whole object every process of the server reads at start (an annotation file,
        ``categories.json``): fetched once, by the first (the front), and kept beside the
        cache (``meta-*``, not evicted; named by the object's size and ETag, so a changed
        object is fetched again), where the workers read it. Without a cache directory,
        each process fetches it."""
        directory = self.settings.cache_dir
        if directory is None:
            return self._get(url, None, None)
        meta = self._head(url)
        tag = f"{url}|{meta['size']}|{meta.get('e_tag')}"
        path = os.path.join(directory, f"meta-{cache_key(tag, None, None)}")
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError:
            pass
        data = self._get(url, None, None)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError:
            pass  # (no room: the others fetch it too)
        return data

    def _head(self, url: str) -> Any:
        """An object's metadata (a HEAD, retried as a GET is)."""
        import obstore

        root, key = _split(url)
        store = self._store(root)
        attempt = 0
        while True:
            try:
                return obstore.head(store, key)
            except Exception as exc:
                kind = _kind(exc)
                attempt += 1
                if kind not in _RETRYABLE or attempt >= self.settings.attempts:
                    raise FetchError(url, kind, _scrub(str(exc))) from None
                time.sleep(random.uniform(0.0, min(2.0, 0.05 * 2**attempt)))

    def identity(self, url: str) -> tuple[int, str]:
        """An object's size and the store's ETag (or its last-modified time where the store
        gives no ETag): what an index built from it is keyed by."""
        meta = self._head(url)
        return int(meta["size"]), str(meta.get("e_tag") or meta.get("last_modified") or "")

    def stall(self, after_s: float = 2.0) -> str:
        """Why nothing has been fetched for ``after_s`` or longer while GETs fail (the
        store's root URL, the failure's kind, for how long), or "": the store answers."""
        with self._lock:
            since, (kind, root) = self._failing_since, self._failure
        waited = time.perf_counter() - since if since else 0.0
        if waited < after_s:
            return ""
        return f"object store {root}: {kind}, nothing fetched for {waited:.0f} s"

    def take_tally(self) -> FetchTally:
        """What was fetched since the last call (and start afresh)."""
        with self._lock:
            tally, self._tally = self._tally, FetchTally()
        return tally

    def cache_usage(self) -> CacheUsage | None:
        return None if self.cache is None else self.cache.usage()


_settings = FetchSettings()
_fetcher: Fetcher | None = None
_fetcher_lock = threading.Lock()


def configure(settings: FetchSettings) -> None:
    """Set this process's fetch settings (before its dataset is built)."""
    global _settings, _fetcher
    with _fetcher_lock:
        _settings = settings
        _fetcher = None


def fetcher() -> Fetcher:
    """This process's ``Fetcher`` (made on first use, with the configured settings)."""
    global _fetcher
    with _fetcher_lock:
        if _fetcher is None:
            _fetcher = Fetcher(_settings)
        return _fetcher


def fetcher_if_used() -> Fetcher | None:
    """The process's ``Fetcher`` if anything has used it (None: nothing fetched here)."""
    return _fetcher


def read_bytes(
    path: str | os.PathLike[str], start: int | None = None, length: int | None = None
) -> bytes:
    """The bytes of a local file or a remote object (``length`` from ``start`` when given).
    Raises ``OSError`` (``FetchError`` for a remote one)."""
    if is_remote(path):
        return fetcher().read(str(path), start, length)
    with open(path, "rb") as f:
        if start is not None:
            f.seek(start)
        data = f.read(-1 if length is None else length)
    if length is not None and len(data) != length:
        raise OSError(f"{path}: short read: {len(data)} of {length} bytes at {start}")
    return data


def read_shared(path: str | os.PathLike[str]) -> bytes:
    """A file every process of a server reads whole at start (``Fetcher.read_shared`` for
    a URL: fetched once per server). Raises ``OSError``."""
    if is_remote(path):
        return fetcher().read_shared(str(path))
    with open(path, "rb") as f:
        return f.read()


def size_of(path: str | os.PathLike[str]) -> int:
    """A local file's or a remote object's size in bytes. Raises ``OSError``."""
    if is_remote(path):
        return fetcher().size(str(path))
    return os.path.getsize(path)


def object_identity(url: str) -> tuple[int, str]:
    """A remote object's size and ETag (``Fetcher.identity``). Raises ``OSError``."""
    return fetcher().identity(url)


def prefetch(wanted: Iterable[tuple[str, int | None, int | None]]) -> None:
    """Start fetching the remote ones of ``wanted`` (url, start, length); local ones are
    left to the page cache."""
    remote = [w for w in wanted if is_remote(w[0])]
    if remote:
        fetcher().prefetch(remote)
