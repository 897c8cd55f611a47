"""Server configuration and endpoint arithmetic."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from dataserver.data.spec import DEFAULT_SPEC
from dataserver.protocol import MAX_IMAGE_SIDE

DEFAULT_BIND = "tcp://127.0.0.1:5555"
DEFAULT_MAX_SESSIONS = 1024
DEFAULT_MAX_IMAGE_SIDE = 4096
DEFAULT_MAX_QUEUED_MB = 256
DEFAULT_CACHE_GB = 1.0
DEFAULT_DRAIN_SECONDS = 30.0
DEFAULT_IDLE_TIMEOUT = 30.0
SESSION_SHARE = 8  # one session may hold at most 1/8 of --max-queued-mb
_HOST = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[0-9A-Fa-f:.]+|[A-Za-z0-9][A-Za-z0-9.-]*)$")
_TCP = re.compile(r"^tcp://(?P<host>\[[^\]]+\]|[^:/]+):(?P<port>\d+|\*)$")


class ConfigError(ValueError):
    """A flag value that cannot work; the message names the flag."""


@dataclass(frozen=True)
class ServerConfig:
    """Everything ``dataserver serve`` is told on its command line."""

    dataset: str = DEFAULT_SPEC
    dataset_args: str | None = None
    workers: int = 0  # 0: the number of CPUs
    bind: str = DEFAULT_BIND
    control_bind: str | None = None  # None: data port + 1 on the same interface
    session_ttl: float = 30.0  # seconds without traffic (clients beat every 0.5 s) before expiry
    cache_gb: float = DEFAULT_CACHE_GB  # the store of prepared sources, shared by all workers
    curve_secret_key: str | None = None
    curve_authorized_keys: str | None = None
    direct_results: bool = True  # workers send results straight to clients that reach them
    local_results: bool = True  # ... over ipc to clients on this host
    # Resource caps: what would exceed one is refused with an ERROR naming its flag.
    max_sessions: int = DEFAULT_MAX_SESSIONS
    max_image_side: int = DEFAULT_MAX_IMAGE_SIDE
    max_queued_mb: int = DEFAULT_MAX_QUEUED_MB
    drain_seconds: float = DEFAULT_DRAIN_SECONDS  # SIGTERM: finish running work within this
    metrics_port: int | None = None  # Prometheus on HOST:PORT (0: any free port; None: off)
    metrics_bind: str | None = None  # HOST for it (None: --bind's interface)
    idle_timeout: float = DEFAULT_IDLE_TIMEOUT  # peer connections silent this long are dropped

    def worker_count(self) -> int:
        return self.workers if self.workers > 0 else (os.cpu_count() or 1)

    def validate(self) -> None:
        if self.workers < 0:
            raise ConfigError(f"--workers must be >= 1, got {self.workers}")
        check_endpoint("--bind", self.bind)
        if self.control_bind is not None:
            check_endpoint("--control-bind", self.control_bind)
        if self.max_sessions < 1:
            raise ConfigError(f"--max-sessions must be >= 1, got {self.max_sessions}")
        if not 1 <= self.max_image_side <= MAX_IMAGE_SIDE:
            raise ConfigError(
                f"--max-image-side must be in 1..{MAX_IMAGE_SIDE}, got {self.max_image_side}"
            )
        if self.max_queued_mb < 1:
            raise ConfigError(f"--max-queued-mb must be >= 1, got {self.max_queued_mb}")
        if not 0 <= self.drain_seconds <= 86400:
            raise ConfigError(f"--drain-seconds must be in 0..86400, got {self.drain_seconds}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"--metrics-port must be in 0..65535, got {self.metrics_port}")
        if self.metrics_bind is not None and not _HOST.match(self.metrics_bind):
            raise ConfigError(
                f"--metrics-bind {self.metrics_bind!r}: expected an address or a host name "
                "(e.g. 0.0.0.0, 10.0.0.5, ::)"
            )
        if not 1 <= self.idle_timeout <= 86400:
            raise ConfigError(f"--idle-timeout must be in 1..86400, got {self.idle_timeout}")
        if self.session_ttl <= 0:
            raise ConfigError(f"--session-ttl must be > 0, got {self.session_ttl}")
        if not 0 <= self.cache_gb <= 1 << 14:
            raise ConfigError(f"--cache-gb must be in 0..16384, got {self.cache_gb}")
        if (self.curve_secret_key is None) != (self.curve_authorized_keys is None):
            raise ConfigError("--curve-secret-key and --curve-authorized-keys go together")

    @property
    def cache_bytes(self) -> int:
        return int(self.cache_gb * (1 << 30))

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
        m = _TCP.match(self.bind)
        if m is None:
            return "127.0.0.1"
        host = m["host"].strip("[]")
        return "0.0.0.0" if host == "*" else host

    def control_endpoint(self) -> str:
        """``--control-bind``, or the data endpoint's port + 1 (a wildcard stays one)."""
        if self.control_bind is not None:
            return self.control_bind
        m = _TCP.match(self.bind)
        if m is None:
            if self.bind.startswith("ipc://"):
                return self.bind + ".control"
            raise ConfigError(f"--bind {self.bind!r}: give --control-bind for this transport")
        port = m["port"]
        next_port = "*" if port in ("*", "0") else str(int(port) + 1)
        return f"tcp://{m['host']}:{next_port}"


def results_bind(data_bind: str, tmpdir: str) -> str:
    """Where a worker binds its direct-result socket: any free port on the data endpoint's
    interface, or an ipc path next to the backend (``{slot}`` is the worker's slot)."""
    m = _TCP.match(data_bind)
    if m is not None:
        return f"tcp://{m['host']}:*"
    return f"ipc://{tmpdir}/results-{{slot}}"


def check_endpoint(flag: str, endpoint: str) -> None:
    """Raise ``ConfigError`` unless ``endpoint`` is tcp://HOST:PORT (PORT may be *) or ipc://."""
    if endpoint.startswith("ipc://") and len(endpoint) > len("ipc://"):
        return
    m = _TCP.match(endpoint)
    if m is None:
        raise ConfigError(f"{flag} {endpoint!r}: expected tcp://HOST:PORT or ipc://PATH")
    if m["port"] != "*" and not 0 <= int(m["port"]) <= 65535:
        raise ConfigError(f"{flag} {endpoint!r}: port out of range")


def bindable(endpoint: str) -> str:
    """ZeroMQ spells "any free port" as ``*``; accept ``:0`` for it too."""
    m = _TCP.match(endpoint)
    if m is not None and m["port"] == "0":
        return f"tcp://{m['host']}:*"
    return endpoint
