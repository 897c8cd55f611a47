"""Server configuration and endpoint arithmetic."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from dataserver.data.spec import DEFAULT_SPEC

DEFAULT_BIND = "tcp://127.0.0.1:5555"
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
    session_ttl: float = 120.0  # seconds without traffic before a session is forgotten
    cache_mb: int = 64  # per worker: prepared sources kept for re-composition
    curve_secret_key: str | None = None
    curve_authorized_keys: str | None = None
    direct_results: bool = True  # workers send results straight to clients that reach them

    def worker_count(self) -> int:
        return self.workers if self.workers > 0 else (os.cpu_count() or 1)

    def validate(self) -> None:
        if self.workers < 0:
            raise ConfigError(f"--workers must be >= 1, got {self.workers}")
        check_endpoint("--bind", self.bind)
        if self.control_bind is not None:
            check_endpoint("--control-bind", self.control_bind)
        if (self.curve_secret_key is None) != (self.curve_authorized_keys is None):
            raise ConfigError("--curve-secret-key and --curve-authorized-keys go together")

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
