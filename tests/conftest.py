"""Shared fixtures: real ``dataserver serve`` processes, always stopped; synthetic data."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dataserver.admin import child_pids, fetch_stats
from dataserver.data.coco import write_synthetic_coco
from dataserver.server import parse_ready_line

TESTS = Path(__file__).resolve().parent
PLUGINS = TESTS / "plugins"
sys.path.insert(0, str(PLUGINS))  # the test plugins are importable here too


def free_port() -> int:
    """A port that was free a moment ago (for tests that must restart on the same port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ, **(extra or {}))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PLUGINS), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    return env


class Server:
    """A real ``dataserver serve`` process, started and waited for until its ready line."""

    def __init__(
        self,
        *args: str,
        workers: int = 2,
        bind: str = "tcp://127.0.0.1:0",
        ready_timeout: float = 60.0,
        env: dict[str, str] | None = None,
        nofile: int | None = None,
    ):
        """``nofile``: the server's RLIMIT_NOFILE, soft and hard (it cannot raise it)."""
        self.args = ["serve", "--workers", str(workers), "--bind", bind, *args]
        self.nofile = nofile
        self.stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            self.command(),
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            env=server_env(env),
            text=True,
        )
        self.lines: list[str] = []
        self._ready = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if not self._ready.wait(ready_timeout):
            self.stop()
            raise RuntimeError(f"server did not get ready: {self.read_stderr()}")
        ready = next(line for line in self.lines if line.startswith("dataserver ready"))
        fields = parse_ready_line(ready)
        self.address = fields["data"]
        self.samples = int(fields["samples"])

    def command(self) -> list[str]:
        # (``prlimit`` execs it: the same pid)
        limit = [] if self.nofile is None else ["prlimit", f"--nofile={self.nofile}", "--"]
        return [*limit, sys.executable, "-m", "dataserver.cli", *self.args]

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if line.startswith("dataserver ready"):
                self._ready.set()
        self._ready.set()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stats(self, timeout: float = 5.0) -> dict[str, Any]:
        return fetch_stats(self.address, timeout)

    def worker_pids(self) -> list[int]:
        """The front's children (its workers), from /proc: STATS does not name pids."""
        return child_pids(self.pid)

    def read_stderr(self) -> str:
        self.stderr.seek(0)
        return self.stderr.read().decode(errors="replace")

    def kill(self) -> None:
        """SIGKILL the front (its workers die with it: parent-death signal)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def drain(self) -> None:
        """SIGTERM: the server drains (``--drain-seconds``) and exits by itself."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGINT: stop at once (no drain), as a server that goes away does."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.stderr.close()
        return self.proc.returncode


@pytest.fixture
def start_server() -> Iterator[Any]:
    """Start servers with ``start_server(*args, workers=N)``; all are stopped afterwards."""
    servers: list[Server] = []

    def start(*args: str, **kwargs: Any) -> Server:
        server = Server(*args, **kwargs)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture(scope="module")
def synthetic_server() -> Iterator[Server]:
    """One 2-worker server on 96 synthetic images, shared by a module's tests."""
    server = Server("--dataset", "synthetic:images=96,seed=3", workers=2)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def coco_dir() -> Iterator[Path]:
    """A small COCO-format set written by ``dataserver synth``'s code (48 JPEGs)."""
    with tempfile.TemporaryDirectory(prefix="ds-coco-") as d:
        write_synthetic_coco(d, images=48, seed=1)
        yield Path(d)


def open_files(pid: int) -> list[str]:
    """What each descriptor of process ``pid`` names (``/proc/PID/fd``), skipping those it
    closed while they were being read (a live server opens and closes sockets meanwhile)."""
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            out.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except FileNotFoundError:
            continue
    return out


def wait_until(predicate: Any, timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


def run_epoch_collecting_errors(client: Any, epoch: int) -> tuple[list[int], list[Any]]:
    """Iterate one epoch, going on after DataServerErrors; (indices delivered, errors)."""
    from dataserver_client import DataServerError

    client.set_epoch(epoch)
    it = iter(client)
    delivered: list[int] = []
    errors: list[DataServerError] = []
    while True:
        try:
            batch = next(it)
        except StopIteration:
            return delivered, errors
        except DataServerError as exc:
            errors.append(exc)
            continue
        delivered.extend(i for idx in batch.indices for i in idx)
