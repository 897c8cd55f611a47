"""A server's ports while its annotation index is first built: bound at once (a busy port
is an error in the first second, not after the parse), ``dataserver stats`` answered with
``indexing N%`` (``--check`` fails readiness, liveness holds), the build itself a one-shot
``dataserver index`` process (its parse's memory goes with it) writing the index cache the
front then maps. The front binds the same endpoint when the build is done."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import replace
from typing import Any

import zmq

from dataserver.data.index import IndexCache
from dataserver.data.spec import DatasetSpec, SpecError
from dataserver.protocol import ProtocolError, decode
from dataserver.protocol.messages import Stats
from dataserver.server.config import ServerConfig, bindable

log = logging.getLogger("dataserver.indexing")

POLL_MS = 100
PROGRESS = "progress "  # the line ``dataserver index --progress-lines`` prints


class IndexingPorts:
    """The data endpoint bound while the index builds; STATS answered there, anything else
    dropped (a client's DEALER sends again to the front that binds after). ``bound()``:
    the configuration with the port actually taken."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.started = time.time()
        self.server_id = uuid.uuid4().hex[:12]
        self.fraction = 0.0
        self._ctx: zmq.Context[Any] = zmq.Context()
        self._data = self._ctx.socket(zmq.ROUTER)
        self._data.setsockopt(zmq.LINGER, 0)
        self._data.setsockopt(zmq.MAXMSGSIZE, 4096)
        try:
            self._data.bind(bindable(config.bind))
        except zmq.ZMQError:
            self.close()
            raise
        self.data_endpoint = self._data.getsockopt_string(zmq.LAST_ENDPOINT)

    def tell(self, fraction: float) -> None:
        """The build's progress, 0..1 (its reader thread's)."""
        self.fraction = fraction

    def bound(self) -> ServerConfig:
        """``config`` with the endpoint this port took (a ``:0`` became a port)."""
        return replace(self.config, bind=self.data_endpoint)

    def stats(self) -> dict[str, Any]:
        """What ``dataserver stats`` gets meanwhile: no worker alive yet."""
        return {
            "server_id": self.server_id,
            "uptime_s": round(time.time() - self.started, 1),
            "indexing": f"{int(100 * self.fraction)}%",
            "dataset": self.config.dataset,
            "workers": self.config.worker_count(),
            "workers_alive": 0,
        }

    def answer(self, timeout_ms: int) -> None:
        """Answer the STATS that came (waiting at most ``timeout_ms`` for one)."""
        if not self._data.poll(timeout_ms):
            return
        for _ in range(64):
            try:
                frames = self._data.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = decode(frames[1:])
            except ProtocolError:
                continue
            if isinstance(msg, Stats) and msg.stats is None:
                reply = Stats(stats=self.stats()).encode()
                try:
                    self._data.send_multipart([frames[0], *reply], zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass

    def close(self) -> None:
        """Unbind (the listeners are closed when this returns: the front binds them)."""
        self._data.close(linger=0)
        self._ctx.term()


def build_ahead(spec: DatasetSpec, cache: IndexCache, ports: IndexingPorts) -> None:
    """Run ``dataserver index SPEC`` into ``cache`` while ``ports`` answer; its progress
    lines move ``ports.fraction``. ``SpecError`` with its one-line error when it fails."""
    cmd = [sys.executable, "-m", "dataserver.cli", "index", spec.text, "--progress-lines"]
    cmd += ["--index-cache", str(cache.dir)]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True
    )
    errors: list[str] = []
    readers = [
        threading.Thread(target=_read_progress, args=(proc, ports), daemon=True),
        threading.Thread(target=_read_errors, args=(proc, errors), daemon=True),
    ]
    for t in readers:
        t.start()
    try:
        while proc.poll() is None:
            ports.answer(POLL_MS)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for t in readers:
            t.join(5)
    if proc.returncode != 0:
        last = next((e for e in reversed(errors) if e.strip()), f"exit status {proc.returncode}")
        raise SpecError(last.split("error: ", 1)[-1])


def _read_progress(proc: subprocess.Popen[str], ports: IndexingPorts) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(PROGRESS):
            try:
                ports.tell(float(line[len(PROGRESS) :]))
            except ValueError:
                pass


def _read_errors(proc: subprocess.Popen[str], errors: list[str]) -> None:
    """Its stderr kept; its warnings (a rebuild, and why) passed on as they come."""
    assert proc.stderr is not None
    for line in proc.stderr:
        errors.append(line.rstrip("\n"))
        if "error:" not in line and "\r" not in line:
            sys.stderr.write(line)
