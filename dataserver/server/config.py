"""Server configuration and endpoint arithmetic."""

from __future__ import annotations

import argparse
import json
import os
import re
from collections.abc import Callable
from dataclasses import MISSING, asdict, dataclass, fields, replace
from functools import partial
from typing import Any

from dataserver.data.remote import (
    DEFAULT_FETCH_CACHE_GB,
    DEFAULT_MAX_FETCH_MB,
    DEFAULT_MAX_FETCHES,
)
from dataserver.data.spec import DEFAULT_SPEC
from dataserver.endpoint import endpoint_problem, tcp_endpoint
from dataserver.protocol import MAX_IMAGE_SIDE
from dataserver.server.beats import DEFAULT_RATE as DEFAULT_HEARTBEAT_RATE

DEFAULT_BIND = "tcp://127.0.0.1:5555"
DEFAULT_MAX_SESSIONS = 1024  # a worker told no cap (the front always tells it its own)
DEFAULT_MAX_IMAGE_SIDE = 4096
DEFAULT_MAX_QUEUED_MB = 256
# The most output one TASK may ask for (images x 3 x H x W bytes): a worker allocates it before
# it composes. 64 MiB: a 16 x 1024^2 batch (48 MiB) in one task, and one image at the default
# --max-image-side (4096^2 x 3: 48 MiB); a client cuts its batches into tasks that fit.
DEFAULT_MAX_TASK_MB = 64
DEFAULT_CACHE_GB = 1.0
DEFAULT_DRAIN_SECONDS = 30.0
DEFAULT_IDLE_TIMEOUT = 30.0
SESSION_SHARE = 8  # one session may hold at most 1/8 of --max-queued-mb
_HOST = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[0-9A-Fa-f:.]+|[A-Za-z0-9][A-Za-z0-9.-]*)$")


class ConfigError(ValueError):
    """A flag value that cannot work; the message names the flag."""


@dataclass(frozen=True)
class ServerConfig:
    """Everything ``dataserver serve`` is told on its command line."""

    dataset: str = DEFAULT_SPEC
    dataset_args: str | None = None
    workers: int = 0  # 0: the number of CPUs
    bind: str = DEFAULT_BIND
    session_ttl: float = (
        30.0  # seconds without traffic (clients beat every 0.5-10 s: ``beats``) before expiry
    )
    cache_gb: float = DEFAULT_CACHE_GB  # the store of prepared sources, shared by all workers
    curve_secret_key: str | None = None
    curve_authorized_keys: str | None = None
    direct_results: bool = True  # workers send results straight to clients that reach them
    local_results: bool = True  # ... over ipc to clients on this host
    # Resource caps: what would exceed one is refused with an ERROR naming its flag.
    # None: as many as the fd limit allows (``capacity.session_cap``); a number: at most that
    max_sessions: int | None = None
    max_image_side: int = DEFAULT_MAX_IMAGE_SIDE
    max_queued_mb: int = DEFAULT_MAX_QUEUED_MB
    max_task_mb: int = DEFAULT_MAX_TASK_MB
    drain_seconds: float = DEFAULT_DRAIN_SECONDS  # SIGTERM: finish running work within this
    metrics_port: int | None = None  # Prometheus on HOST:PORT (0: any free port; None: off)
    metrics_bind: str | None = None  # HOST for it (None: --bind's interface)
    idle_timeout: float = DEFAULT_IDLE_TIMEOUT  # peer connections silent this long are dropped
    # Heartbeats a second the front asks of all its sessions together (``beats.BeatRule``)
    heartbeat_rate: float = DEFAULT_HEARTBEAT_RATE
    # Objects fetched from object stores (``dataserver.data.remote``): the cache of their
    # bytes (--fetch-cache DIR on disk; else in memory, a directory ``serve`` makes and sets
    # as ``fetch_memory_dir``), its size, and GETs in flight (the server's: each worker
    # has its share).
    fetch_cache: str | None = None
    fetch_cache_gb: float = DEFAULT_FETCH_CACHE_GB
    max_fetches: int = DEFAULT_MAX_FETCHES
    max_fetch_mb: int = DEFAULT_MAX_FETCH_MB  # bytes in flight per server (the front's fetcher)
    fetch_memory_dir: str | None = None

    def fetch_dir(self) -> tuple[str, str] | None:
        """(the fetch cache's directory, "disk" or "memory"), or None (no cache)."""
        if self.fetch_cache_gb <= 0:
            return None
        if self.fetch_cache is not None:
            return self.fetch_cache, "disk"
        return None if self.fetch_memory_dir is None else (self.fetch_memory_dir, "memory")

    # Where annotation indexes are cached (None: the per-user default, ``index.IndexCache``)
    index_cache: str | None = None

    def worker_count(self) -> int:
        return self.workers if self.workers > 0 else (os.cpu_count() or 1)

    def validate(self) -> None:
        """Raise ``ConfigError`` naming the first flag whose value cannot work."""
        if self.workers < 0:
            raise ConfigError(f"--workers must be >= 1, got {self.workers}")
        check_endpoint("--bind", self.bind)
        for flag, least in (
            ("--max-sessions", 1 if self.max_sessions is None else self.max_sessions),
            ("--max-queued-mb", self.max_queued_mb),
            ("--max-task-mb", self.max_task_mb),
            ("--max-fetches", self.max_fetches),
            ("--max-fetch-mb", self.max_fetch_mb),
        ):
            if least < 1:
                raise ConfigError(f"{flag} must be >= 1, got {least}")
        self._check_task_budget()
        ranges: list[tuple[str, float | None, float, float]] = [
            ("--max-image-side", self.max_image_side, 1, MAX_IMAGE_SIDE),
            ("--drain-seconds", self.drain_seconds, 0, 86400),
            ("--metrics-port", self.metrics_port, 0, 65535),
            ("--idle-timeout", self.idle_timeout, 1, 86400),
            ("--cache-gb", self.cache_gb, 0, 1 << 14),
            ("--fetch-cache-gb", self.fetch_cache_gb, 0, 1 << 14),
            ("--heartbeat-rate", self.heartbeat_rate, 0.01, 1_000_000),
        ]
        for flag, value, lo, hi in ranges:
            if value is not None and not lo <= value <= hi:
                raise ConfigError(f"{flag} must be in {lo}..{hi}, got {value}")
        if self.metrics_bind is not None and not _HOST.match(self.metrics_bind):
            raise ConfigError(
                f"--metrics-bind {self.metrics_bind!r}: expected an address or a host name "
                "(e.g. 0.0.0.0, 10.0.0.5, ::)"
            )
        if self.session_ttl <= 0:
            raise ConfigError(f"--session-ttl must be > 0, got {self.session_ttl}")
        if (self.curve_secret_key is None) != (self.curve_authorized_keys is None):
            raise ConfigError("--curve-secret-key and --curve-authorized-keys go together")
        self._check_fetch_cache()

    def _check_fetch_cache(self) -> None:
        if self.fetch_cache is not None and not os.path.isdir(self.fetch_cache):
            raise ConfigError(f"--fetch-cache {self.fetch_cache!r}: not a directory")

    @property
    def cache_bytes(self) -> int:
        return int(self.cache_gb * (1 << 30))

    def _check_task_budget(self) -> None:
        """A task of one image at the largest side served must fit ``--max-task-mb``."""
        one = 3 * self.max_image_side**2
        if self.max_task_bytes < one:
            raise ConfigError(
                f"--max-task-mb {self.max_task_mb} is less than one image at --max-image-side "
                f"{self.max_image_side} ({-(-one >> 20)} MiB): raise it, or lower the side"
            )

    @property
    def max_task_bytes(self) -> int:
        return self.max_task_mb << 20

    @property
    def max_queued_bytes(self) -> int:
        return self.max_queued_mb << 20

    @property
    def session_queued_bytes(self) -> int:
        return max(1 << 20, self.max_queued_bytes // SESSION_SHARE)

    @property
    def curve(self) -> tuple[str, str] | None:
        if self.curve_secret_key and self.curve_authorized_keys:
            return self.curve_secret_key, self.curve_authorized_keys
        return None

    def metrics_host(self) -> str:
        """Where ``--metrics-port`` listens: ``--metrics-bind``, else the interface of
        ``--bind`` (its wildcard ``*`` is 0.0.0.0; an ipc data endpoint means loopback)."""
        if self.metrics_bind is not None:
            return self.metrics_bind.strip("[]")
        m = tcp_endpoint(self.bind, bind=True)
        if m is None:
            return "127.0.0.1"
        host = m.address
        return "0.0.0.0" if host == "*" else host


def results_bind(data_bind: str, tmpdir: str) -> str:
    """Where a worker binds its direct-result socket: any free port on the data endpoint's
    interface, or an ipc path next to the backend (``{slot}`` is the worker's slot)."""
    m = tcp_endpoint(data_bind, bind=True)
    if m is not None:
        return f"tcp://{m.host}:*"
    return f"ipc://{tmpdir}/results-{{slot}}"


def check_endpoint(flag: str, endpoint: str) -> None:
    """Raise ``ConfigError`` unless ``endpoint`` is tcp://HOST:PORT (PORT may be *) or ipc://."""
    problem = endpoint_problem(endpoint, bind=True)
    if problem is not None:
        raise ConfigError(f"{flag} {endpoint!r}: {problem}")


def bindable(endpoint: str) -> str:
    """ZeroMQ spells "any free port" as ``*``; accept ``:0`` for it too."""
    m = tcp_endpoint(endpoint, bind=True)
    if m is not None and m.port == "0":
        return f"tcp://{m.host}:*"
    return endpoint


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a worker process is told, written once: the pool fills it in for each
    slot (``for_slot``), passes it as the one argument of ``python -m
    dataserver.server.worker.worker`` (``to_json``), and the worker reads it back (``from_json``)
    and builds its ``Worker`` from it."""

    backend: str  # the front's backend ROUTER (ipc)
    state_dir: str  # the front's private directory: running slots, start errors, ipc paths
    dataset: str
    dataset_args: str | None = None
    fingerprint: str = ""
    max_queued_mb: int = DEFAULT_MAX_QUEUED_MB
    # (index fd, arena fd) of the store's memfds the worker inherits, and its size
    store_fds: tuple[int, int] | None = None
    store_bytes: int = 0
    # The shared annotation index's memfd the worker inherits (``data.index``), and its size
    index_fd: int | None = None
    index_bytes: int = 0
    results_bind: str | None = None  # its direct-result socket (may hold "{slot}" until for_slot)
    local_results: bool = False  # ... also on ipc, for clients on this host
    curve: tuple[str, str] | None = None  # (secret key, authorized keys)
    idle_timeout: float = DEFAULT_IDLE_TIMEOUT  # result connections silent this long go
    max_sessions: int = DEFAULT_MAX_SESSIONS  # (the result connections kept: one a session)
    # the fetch cache (``ServerConfig.fetch_dir``), this worker's share of its budget, the
    # number of workers sharing it, and GETs in flight (``dataserver.data.remote``)
    fetch_cache: str | None = None
    fetch_where: str = "memory"
    fetch_cache_bytes: int = 0
    fetch_slots: int = 1
    max_fetches: int = DEFAULT_MAX_FETCHES  # (this worker's share of --max-fetches)
    # the front fetches ahead (``server/front/prefetch.py``): this worker only reads the cache
    # (and GETs what is not there yet), it neither prefetches nor keeps
    front_fetches: bool = False
    fetch_mem_fds: tuple[int, int] | None = None  # the in-memory fetch cache (``MemCache``)
    worker_id: int = 0  # its slot
    parent_pid: int = 0  # the front: the worker dies with it

    def for_slot(self, slot: int, parent_pid: int) -> WorkerConfig:
        """This configuration for the worker of ``slot``, started by ``parent_pid``."""
        bind = None if self.results_bind is None else self.results_bind.format(slot=slot)
        return replace(self, worker_id=slot, parent_pid=parent_pid, results_bind=bind)

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_argv(cls, argv: list[str]) -> WorkerConfig:
        """A worker's command line: one argument, the JSON ``to_json`` writes (what the
        pool passes), or flags named after the fields, for running a worker by hand
        (``--worker-id 0 --store-fds 3,4 ...``; pairs are written ``A,B``). Bad flags exit
        2 with argparse's message."""
        if len(argv) == 1 and argv[0].startswith("{"):
            return cls.from_json(argv[0])
        parser = argparse.ArgumentParser(prog="dataserver-worker")
        for f in fields(cls):
            flag = "--" + f.name.replace("_", "-")
            kind = str(f.type)
            if kind == "bool":
                parser.add_argument(flag, action="store_true", dest=f.name)
                continue
            parse: Any = str
            if kind.startswith("tuple[int"):
                parse = partial(_pair, int)
            elif kind.startswith("tuple[str"):
                parse = partial(_pair, str)
            elif kind in ("int", "int | None"):
                parse = int
            elif kind == "float":
                parse = float
            required = f.default is MISSING
            default = None if required else f.default
            parser.add_argument(flag, type=parse, required=required, default=default, dest=f.name)
        return cls(**vars(parser.parse_args(argv)))

    @classmethod
    def from_json(cls, text: str) -> WorkerConfig:
        """Raises ``ValueError`` (or ``TypeError``) on anything but what ``to_json`` wrote."""
        raw = json.loads(text)
        if not isinstance(raw, dict):
            raise ValueError("a worker's configuration is a JSON object")
        for pair in ("store_fds", "curve", "fetch_mem_fds"):
            if raw.get(pair) is not None:
                raw[pair] = tuple(raw[pair])
        return cls(**raw)


def _pair(kind: Callable[[str], Any], text: str) -> tuple[Any, Any]:
    """``A,B`` as a pair of ``kind``."""
    a, sep, b = text.partition(",")
    if not sep:
        raise ValueError(f"{text!r}: expected A,B")
    return kind(a), kind(b)
