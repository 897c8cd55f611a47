"""The data tier on a Ray cluster: the actors behind ``dataserver_client.integrations.ray``.

Two actor classes, both import-light (this module imports ray and the standard library only,
never torch nor ``dataserver_client``), so that the processes Ray runs them in stay as small
as the servers they supervise:

- ``TierServer``: one per server, placed by the tier on a node with the requested resources.
  It runs a real ``dataserver serve`` (a fresh interpreter: it never imports torch) bound to
  its node's Ray address on a free port, reads the address back from the ready line,
  restarts the server when it dies (on the same ports when it can have them, so clients
  just reconnect), and drains it on ``drain()`` (SIGTERM, as Kubernetes does). The server
  gets SIGTERM as well when the actor's process dies (``PR_SET_PDEATHSIG``): a killed actor
  leaves no server behind once the drain is over.
- ``TierActor``: the tier's state, a named actor in the ``dataserver`` namespace (found by
  ``ray.get_actor(name, namespace=NAMESPACE)`` from any job of the cluster). It starts the
  servers spread over the nodes (``SPREAD``), watches each through a long poll
  (``TierServer.watch``), replaces a server whose actor died (killed, or its node lost),
  scales up and down (down: the newest drain first) and answers ``addresses()``: the
  servers that are up and not draining, the list client discovery polls for ``ray://NAME``.

``tier_addresses(name)`` is that poll, as the client's discovery thread calls it.

Over the house's ~500 lines (about 530): what Ray runs in its actor processes is this one
import-light module (ray and the standard library only): the two actor classes and their
helpers.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import ray

log = logging.getLogger("dataserver.raytier")

NAMESPACE = "dataserver"  # every tier's named actor lives here, whatever job started it
PREFIX = "ray://"
START_TIMEOUT_S = 120.0  # a server's first ready line (workers started, dataset built)
WATCH_S = 10.0  # longest a watch call is held before it answers "no change"
LOOKUP_TIMEOUT_S = 5.0
RESTART_BACKOFF_S = (0.5, 10.0)

# Runs between fork and the server's exec: SIGTERM when the thread that started it dies
# (the actor's supervisor thread, which lives as long as the actor); exits at once when
# that parent is already gone.
_LAUNCH = (
    "import ctypes, os, signal, sys\n"
    "try:\n"
    "    ctypes.CDLL('libc.so.6', use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)\n"
    "except OSError:\n"
    "    pass\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(1)\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


@dataclass(frozen=True)
class ServerSpec:
    """What every server of a tier runs: ``dataserver serve --dataset DATASET
    [--dataset-args JSON] [--workers N] [extra...]``."""

    dataset: str = "synthetic"
    dataset_args: str | None = None  # JSON
    workers: int | None = None
    extra: tuple[str, ...] = ()
    drain_seconds: float = 30.0  # serve's default; what a drain waits for before SIGKILL

    def command(self, data: str) -> list[str]:
        cmd = [sys.executable, "-m", "dataserver.cli", "serve", "--bind", data]
        cmd += ["--dataset", self.dataset]
        if self.dataset_args is not None:
            cmd += ["--dataset-args", self.dataset_args]
        if self.workers is not None:
            cmd += ["--workers", str(self.workers)]
        if "--drain-seconds" not in self.extra:
            cmd += ["--drain-seconds", f"{self.drain_seconds:g}"]
        return [*cmd, *self.extra]


def _fields(ready: str) -> dict[str, str]:
    """The k=v fields of serve's ready line (``dataserver.server.parse_ready_line``, which
    this module does not import: it would bring the whole server into the actor)."""
    return dict(part.split("=", 1) for part in ready.split()[2:] if "=" in part)


class _Process:
    """One ``dataserver serve`` child: started, its ready line read, its output forwarded
    to this actor's (Ray's log files) and the last lines of its stderr kept for errors."""

    def __init__(self, cmd: list[str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _LAUNCH, str(os.getpid()), *cmd],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.ready_line: str | None = None
        self.tail: collections.deque[str] = collections.deque(maxlen=5)
        self._ready = threading.Event()
        threading.Thread(target=self._read_stdout, daemon=True).start()
        threading.Thread(target=self._read_stderr, daemon=True).start()

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if self.ready_line is None and line.startswith("dataserver ready"):
                self.ready_line = line.strip()
                self._ready.set()
            sys.stdout.write(line)
        self._ready.set()

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            if line.strip():
                self.tail.append(line.rstrip())
            sys.stderr.write(line)

    def wait_ready(self, timeout: float) -> dict[str, str] | None:
        self._ready.wait(timeout)
        return None if self.ready_line is None else _fields(self.ready_line)

    def why(self) -> str:
        rc = self.proc.poll()
        said = self.tail[-1] if self.tail else "no message"
        return f"dataserver serve {'exited ' + str(rc) if rc is not None else 'not ready'}: {said}"

    def stop(self, grace: float) -> int:
        """SIGTERM (a drain), then SIGKILL after ``grace`` seconds."""
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            return self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


class TierServer:
    """One supervised ``dataserver serve`` on this node (a Ray actor: create it with
    ``ray.remote(TierServer)``, ``max_concurrency`` >= 4).

    ``__init__`` returns once the server is ready, or could not start (``watch`` then says
    ``exited``, with serve's own error line in ``error``). ``watch(version)`` answers when the state changed from ``version``
    (address, restarts, exited); ``drain()`` sends SIGTERM and no restart follows; the
    server has exited when ``watch`` says ``exited``."""

    def __init__(self, spec: ServerSpec, host: str | None = None) -> None:
        self.spec = spec
        self.host = host or ray.util.get_node_ip_address()
        self.node_id = ray.get_runtime_context().get_node_id()
        self._cond = threading.Condition()
        self._version = 0
        self._address: str | None = None
        self._exited = False
        self._draining = False
        self._restarts = 0
        self._error: str | None = None
        self._child: _Process | None = None
        self._last_data: str | None = None  # the port a restart asks for again
        self._thread = threading.Thread(target=self._supervise, name="supervisor", daemon=True)
        self._thread.start()
        with self._cond:  # (a server that cannot start says so through watch: exited)
            self._cond.wait_for(lambda: self._version > 0, START_TIMEOUT_S)

    # ------------------------------------------------------------ the supervisor thread

    def _supervise(self) -> None:
        """Start the server, wait for it, restart it unless it was drained. The server is
        this thread's child: it gets SIGTERM when the thread (the actor) goes."""
        failures = 0
        started = False
        while True:
            child, found = self._start()
            if found is None:
                failures += 1
                if not started:
                    self._set(error=child.why(), exited=True)  # never started: give up
                    return
                self._set(error=child.why(), forget_ports=True)  # taken now? free ones next
                if self._wait_backoff(failures):
                    break
                continue
            failures, started = 0, True
            self._set(address=found["data"])
            child.proc.wait()
            with self._cond:
                draining = self._draining
            if draining:
                break
            log.warning("dataserver serve at %s exited: %s; restarting", self.address, child.why())
            self._set(address=None, restarted=True)
        self._set(address=None, exited=True)

    def _start(self) -> tuple[_Process, dict[str, str] | None]:
        data = self._address_to_reuse()
        child = _Process(self.spec.command(data))
        with self._cond:
            self._child = child
            draining = self._draining
        if draining:  # drained while starting
            child.stop(self.spec.drain_seconds)
        found = child.wait_ready(START_TIMEOUT_S)
        if found is None or "data" not in found:
            child.stop(1.0)
            return child, None
        return child, found

    def _address_to_reuse(self) -> str:
        with self._cond:
            last = self._last_data
        return last if last else f"tcp://{self.host}:0"

    def _wait_backoff(self, failures: int) -> bool:
        """Wait before the next start; True when a drain came meanwhile."""
        low, high = RESTART_BACKOFF_S
        delay = min(high, low * 2 ** (failures - 1))
        with self._cond:
            return self._cond.wait_for(lambda: self._draining, delay)

    def _set(
        self,
        *,
        address: str | bool | None = False,
        error: str | None = None,
        restarted: bool = False,
        exited: bool = False,
        forget_ports: bool = False,
    ) -> None:
        with self._cond:
            if forget_ports:
                self._last_data = None
            if address is not False:
                assert address is None or isinstance(address, str)
                self._address = address
                if address is not None:
                    self._last_data, self._error = address, None
            if error is not None:
                self._error = error
            self._restarts += restarted
            self._exited = self._exited or exited
            self._version += 1
            self._cond.notify_all()

    # ------------------------------------------------------------ actor methods

    @property
    def address(self) -> str | None:
        with self._cond:
            return self._address

    def state(self) -> dict[str, Any]:
        with self._cond:
            child = self._child
            return {
                "version": self._version,
                "address": self._address,
                "node_id": self.node_id,
                "pid": None if child is None else child.proc.pid,
                "actor_pid": os.getpid(),
                "restarts": self._restarts,
                "draining": self._draining,
                "exited": self._exited,
                "error": self._error,
            }

    def watch(self, version: int, timeout: float = WATCH_S) -> dict[str, Any]:
        """The state once it differs from ``version`` (or after ``timeout`` seconds)."""
        with self._cond:
            self._cond.wait_for(lambda: self._version != version, timeout)
        return self.state()

    def drain(self) -> None:
        """SIGTERM to the server (it tells its clients, finishes its running work and exits
        within ``--drain-seconds``); it is not restarted."""
        with self._cond:
            self._draining = True
            child = self._child
            self._version += 1
            self._cond.notify_all()
        if child is not None and child.proc.poll() is None:
            child.proc.terminate()

    def stop(self, timeout: float | None = None) -> dict[str, Any]:
        """Drain and wait for the server to exit (SIGKILL after ``timeout``, by default the
        drain's own limit and a margin); the state after."""
        self.drain()
        grace = self.spec.drain_seconds + 5.0 if timeout is None else timeout
        with self._cond:
            child = self._child
        if child is not None:
            child.stop(grace)
        self._thread.join(grace + 2.0)
        return self.state()


@dataclass
class _Entry:
    """The tier's view of one of its servers."""

    serial: int
    handle: Any
    watch_ref: Any = None
    version: int = -1
    address: str | None = None
    node_id: str | None = None
    up_once: bool = False
    draining: bool = False
    info: dict[str, Any] = field(default_factory=dict)


class TierActor:
    """A tier's state and supervision (a named Ray actor: ``max_concurrency`` > 1).

    Servers are wanted ``n`` at a time; one whose actor dies unexpectedly is replaced (a
    server that could never start is not: its error is what ``wait_ready`` raises)."""

    def __init__(self, name: str, spec: ServerSpec, options: dict[str, Any]) -> None:
        self.name = name
        self.spec = spec
        self.options = options  # TierServer's actor options: resources, strategy
        self._server_class = ray.remote(TierServer)
        self._lock = threading.Condition()
        self._entries: dict[int, _Entry] = {}
        self._serial = 0
        self._wanted = 0
        self._errors: list[str] = []
        self._stopping = False
        self._monitor = threading.Thread(target=self._watch_loop, name="tier-monitor", daemon=True)
        self._monitor.start()

    # ------------------------------------------------------------ placing servers

    def _add_one(self) -> None:
        self._serial += 1
        remote = self._server_class.options(max_concurrency=4, **self.options)
        handle: Any = remote.remote(self.spec)  # (ray's types know no .remote on methods)
        entry = _Entry(self._serial, handle)
        entry.watch_ref = handle.watch.remote(-1, 0.0)  # answers once the server is up
        self._entries[entry.serial] = entry

    def _live(self) -> list[_Entry]:
        return [e for e in self._entries.values() if not e.draining]

    def scale(self, n: int) -> None:
        """Want ``n`` servers: start the missing ones (spread over the nodes), drain the
        newest beyond ``n``. Returns at once; ``wait_ready`` waits."""
        if n < 0:
            raise ValueError(f"scale: n must be >= 0, got {n}")
        with self._lock:
            self._wanted = n
            self._errors.clear()
            live = sorted(self._live(), key=lambda e: e.serial)
            for _ in range(n - len(live)):
                self._add_one()
            for entry in live[n:][::-1]:
                self._drain(entry)
            self._lock.notify_all()

    def _drain(self, entry: _Entry) -> None:
        entry.draining = True
        entry.handle.drain.remote()

    def wait_ready(self, timeout: float) -> list[str]:
        """Block until the wanted servers are up; raise with a server's error when one
        cannot start, ``TimeoutError`` naming those still missing after ``timeout``."""
        with self._lock:
            ok = self._lock.wait_for(
                lambda: self._errors or all(e.up_once for e in self._live()), timeout
            )
            if self._errors:
                raise RuntimeError(f"data tier {self.name!r}: {self._errors[0]}")
            if not ok:
                missing = sum(not e.up_once for e in self._live())
                raise TimeoutError(
                    f"data tier {self.name!r}: {missing} server(s) not up after {timeout:g} s "
                    f"(no node with room for {self.options.get('resources') or 'them'}?)"
                )
            return self._addresses()

    def _addresses(self) -> list[str]:
        live = sorted(self._live(), key=lambda e: e.serial)
        return [e.address for e in live if e.address is not None]

    def addresses(self) -> list[str]:
        """The servers that are up and not draining: what clients of ``ray://NAME`` use."""
        with self._lock:
            return self._addresses()

    def servers(self) -> list[dict[str, Any]]:
        with self._lock:
            entries = sorted(self._entries.values(), key=lambda e: e.serial)
            return [
                {
                    **e.info,
                    "serial": e.serial,
                    "address": e.address,
                    "draining": e.draining,
                    "actor": e.handle,
                }
                for e in entries
            ]

    def wanted(self) -> int:
        with self._lock:
            return self._wanted

    # ------------------------------------------------------------ the monitor thread

    def _watch_loop(self) -> None:
        while True:
            with self._lock:
                if self._stopping:
                    return
                refs = {e.watch_ref: e for e in self._entries.values() if e.watch_ref is not None}
            if not refs:
                time.sleep(0.1)
                continue
            ready, _ = ray.wait(list(refs), num_returns=1, timeout=0.5)
            for ref in ready:
                self._on_watch(refs[ref], ref)

    def _on_watch(self, entry: _Entry, ref: Any) -> None:
        try:
            state = ray.get(ref)
        except Exception as exc:  # the actor died (killed, its node lost) or never started
            self._on_death(entry, exc)
            return
        with self._lock:
            if self._stopping:
                return
            entry.info = state
            entry.version = state["version"]
            entry.node_id = state["node_id"]
            entry.address = None if entry.draining else state["address"]
            entry.up_once = entry.up_once or state["address"] is not None
            if state["exited"]:  # drained and gone: the actor goes too
                self._entries.pop(entry.serial, None)
                if state["error"] and not entry.up_once:
                    self._errors.append(state["error"])
                ray.kill(entry.handle)
            else:
                entry.watch_ref = entry.handle.watch.remote(entry.version)
            self._lock.notify_all()

    def _on_death(self, entry: _Entry, exc: BaseException) -> None:
        with self._lock:
            self._entries.pop(entry.serial, None)
            if not entry.up_once:
                self._errors.append(_summary(exc))
            elif not entry.draining and not self._stopping:
                log.warning(
                    "data tier %r: server %s died (%s); replacing it",
                    self.name,
                    entry.address,
                    _summary(exc),
                )
                if len(self._live()) < self._wanted:
                    self._add_one()
            self._lock.notify_all()

    # ------------------------------------------------------------ shutdown

    def shutdown(self, timeout: float | None = None) -> int:
        """Drain every server, wait for them to exit (SIGKILL past ``timeout``), end
        their actors. Returns how many servers were stopped."""
        with self._lock:
            self._stopping = True
            self._wanted = 0
            entries = list(self._entries.values())
            self._entries.clear()
            self._lock.notify_all()
        refs = [e.handle.stop.remote(timeout) for e in entries]
        limit = (timeout if timeout is not None else self.spec.drain_seconds + 5.0) + 15.0
        with contextlib.suppress(Exception):
            ray.wait(refs, num_returns=len(refs), timeout=limit)
        for entry in entries:
            with contextlib.suppress(Exception):
                ray.kill(entry.handle)
        self._monitor.join(2.0)
        return len(entries)


def _summary(exc: BaseException) -> str:
    """The last line of a Ray error (its traceback comes first): the exception itself."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1][:300] if lines else type(exc).__name__


# ------------------------------------------------------------ what client discovery calls

_handles: dict[str, Any] = {}
_handles_lock = threading.Lock()


def connect() -> None:
    """Join the Ray cluster this process runs in, when it has not yet (``address="auto"``)."""
    if not ray.is_initialized():
        ray.init(address="auto", log_to_driver=False)


def tier_actor(name: str) -> Any:
    """The tier's named actor (``ValueError`` when there is no such tier)."""
    connect()
    with _handles_lock:
        handle = _handles.get(name)
    if handle is None:
        handle = ray.get_actor(name, namespace=NAMESPACE)
        with _handles_lock:
            _handles[name] = handle
    return handle


def tier_addresses(name: str, timeout: float = LOOKUP_TIMEOUT_S) -> list[str] | None:
    """The current addresses of the tier ``name`` (``ray://NAME``), or None when it cannot
    be asked now (no such tier, its actor gone, the cluster unreachable): discovery then
    keeps its last answer, as with a DNS lookup that fails."""
    try:
        found = ray.get(tier_actor(name).addresses.remote(), timeout=timeout)
    except Exception as exc:  # ray raises many kinds; every one means "no answer now"
        log.debug("ray://%s: %r", name, exc)
        with _handles_lock:
            _handles.pop(name, None)
        return None
    return [str(a) for a in found]
