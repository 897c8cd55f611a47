"""The front process of ``dataserver serve``: one poll loop over every socket.

Sockets, all created and closed in this process's one thread:

- ``data``    ROUTER, bound to ``--bind``: clients' HELLO / TASK / HEARTBEAT / STATS / BYE.
- ``control`` SUB, bound to ``--control-bind``: clients' PUB sockets publish CONTROL.
- ``backend`` ROUTER, bound to an ipc path: one DEALER per worker process.

The front routes: each idle worker gets the next task of the fair queue, each result goes
back to the session that asked (or goes there straight from the worker, which then tells
the front DONE). It keeps every task a worker holds, so a worker's death puts its task
back at the head of its session's queue (twice fatal: answered as poison). A newer
``plan_version`` (from CONTROL, or from a TASK) cancels the session's queued older tasks
at once, each answered CANCELLED so the client's credits stay exact.

This module has the loop, the clients and the control socket; ``routing.py`` the workers.
Bad messages on any socket are counted and dropped; the loop never raises on input.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from dataserver import protocol
from dataserver.protocol import Message, MsgType, ProtocolError
from dataserver.security import start_server_curve
from dataserver.server.config import ServerConfig, bindable, results_bind
from dataserver.server.pool import WorkerHandle, WorkerPool
from dataserver.server.routing import PIPELINE, WorkerRouting
from dataserver.server.sessions import Scheduler, Session, TaskEntry

log = logging.getLogger("dataserver.front")

POLL_MS = 100
DRAIN = 256  # messages taken from one socket before looking at the others
CLIENT_MAX_MSG = 2 << 20  # clients only send small headers
MONITORED = (
    zmq.EVENT_ACCEPTED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


class Front(WorkerRouting):
    """Routes tasks from client sessions to worker processes and results back."""

    def __init__(self, config: ServerConfig, dataset_len: int, fingerprint: str) -> None:
        self.config = config
        self.dataset_len = dataset_len
        self.fingerprint = fingerprint
        self.server_id = uuid.uuid4().hex[:12]
        self.n_workers = config.worker_count()
        # Credit per client: PIPELINE tasks at each worker plus as many again queued here,
        # so a worker always has its next task at hand.
        self.credit = self.n_workers * PIPELINE * 2
        self.scheduler = Scheduler(max_queue=max(64, self.credit * 8))
        self.counters: Counter[str] = Counter()
        self.rejected: Counter[str] = Counter()
        self.started = time.time()
        self.endpoints: dict[str, str] = {}
        self._stop = False
        self._announced = False
        self._by_identity: dict[bytes, WorkerHandle] = {}
        self._ready: list[WorkerHandle] = []  # live workers that said READY
        self._respawn_at: dict[int, float] = {}
        self._auth: Any = None
        self._tmpdir = tempfile.mkdtemp(prefix="ds-")
        curve = None
        if config.curve_secret_key and config.curve_authorized_keys:
            curve = (config.curve_secret_key, config.curve_authorized_keys)
        self.pool = WorkerPool(
            f"ipc://{self._tmpdir}/backend",
            config.dataset,
            config.dataset_args,
            config.cache_mb,
            results_bind(config.bind, self._tmpdir) if config.direct_results else None,
            curve,
        )

    def stop(self) -> None:
        """Ask the loop to finish (safe from a signal handler)."""
        self._stop = True

    # ------------------------------------------------------------------ run loop

    def run(self, on_ready: Callable[[Front], None]) -> None:
        """Bind, start the workers, serve until ``stop()``, then shut down cleanly."""
        ctx = zmq.Context()
        data = ctx.socket(zmq.ROUTER)
        control = ctx.socket(zmq.SUB)
        backend = ctx.socket(zmq.ROUTER)
        self.data, self.control_sock, self.backend = data, control, backend
        try:
            for sock in (data, control):
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.MAXMSGSIZE, CLIENT_MAX_MSG)
            data.setsockopt(zmq.ROUTER_MANDATORY, 1)
            # Results waiting for a client that does not read: credits bound them for honest
            # clients; this bounds them for everyone (beyond it, sends are dropped, counted).
            data.setsockopt(zmq.SNDHWM, max(64, self.credit * 2))
            backend.setsockopt(zmq.LINGER, 0)
            backend.setsockopt(zmq.ROUTER_MANDATORY, 1)
            control.setsockopt(zmq.SUBSCRIBE, b"")
            if self.config.curve_secret_key and self.config.curve_authorized_keys:
                self._auth = start_server_curve(
                    ctx,
                    self.config.curve_secret_key,
                    self.config.curve_authorized_keys,
                    [data, control],
                )
            data.bind(bindable(self.config.bind))
            control.bind(bindable(self.config.control_endpoint()))
            backend.bind(self.pool.backend)
            self.endpoints = {
                "data": data.getsockopt_string(zmq.LAST_ENDPOINT),
                "control": control.getsockopt_string(zmq.LAST_ENDPOINT),
            }
            self.pool.start(self.n_workers)
            self._loop(on_ready)
        finally:
            self._shutdown(ctx)

    def _loop(self, on_ready: Callable[[Front], None]) -> None:
        poller = zmq.Poller()
        for sock in (self.backend, self.data, self.control_sock):
            poller.register(sock, zmq.POLLIN)
        # Connection-level events on the public sockets: failed handshakes (raw TCP junk,
        # wrong socket types, CURVE refusals) never reach the loop as messages.
        monitors = {
            self.data.get_monitor_socket(MONITORED): "data",
            self.control_sock.get_monitor_socket(MONITORED): "control",
        }
        for mon in monitors:
            poller.register(mon, zmq.POLLIN)
        pidfds: dict[int, WorkerHandle] = {}
        pool_version = -1
        next_housekeeping = 0.0
        while not self._stop:
            if self.pool.version != pool_version:  # workers came or went: watch their pidfds
                pool_version = self.pool.version
                current = self.pool.by_pidfd()
                for fd in pidfds.keys() - current.keys():
                    poller.unregister(fd)
                for fd in current.keys() - pidfds.keys():
                    poller.register(fd, zmq.POLLIN)
                pidfds = current
            try:
                events = poller.poll(POLL_MS)
            except zmq.ZMQError as exc:
                if exc.errno in (zmq.ETERM, zmq.ENOTSOCK):
                    break
                raise
            reap = False
            for sock, _ in events:
                if sock is self.backend:
                    self._drain(self.backend, self._on_backend)
                elif sock is self.data:
                    self._drain(self.data, self._on_data)
                elif sock is self.control_sock:
                    self._drain(self.control_sock, self._on_control)
                elif sock in monitors:
                    self._on_monitor(sock, monitors[sock])
                else:
                    reap = True  # a pidfd: a worker exited
            now = time.monotonic()
            if reap or now >= next_housekeeping:
                self._reap()
            if now >= next_housekeeping:
                next_housekeeping = now + 0.5
                self._housekeeping()
            self._dispatch()
            if not self._announced and len(self._ready) >= self.n_workers:
                self._announced = True
                on_ready(self)

    def _on_monitor(self, monitor: zmq.Socket[Any], name: str) -> None:
        while True:
            try:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            kind = event["event"]
            if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                self.rejected[f"{name}_not_authorized"] += 1
            elif kind in (
                zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
            ):
                self.rejected[f"{name}_bad_handshake"] += 1
            elif kind == zmq.EVENT_DISCONNECTED:
                self.counters[f"{name}_disconnects"] += 1
            elif kind == zmq.EVENT_ACCEPTED:
                self.counters[f"{name}_connections"] += 1

    def _drain(self, sock: zmq.Socket[Any], handler: Callable[[list[Any]], None]) -> None:
        for _ in range(DRAIN):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            handler(frames)

    def _shutdown(self, ctx: zmq.Context[Any]) -> None:
        for w in list(self.pool.workers.values()):
            if w.identity is not None:
                self._send(
                    self.backend, w.identity, protocol.make(MsgType.BYE, {"session": b"front"})
                )
        try:
            self.pool.stop()
        finally:
            if self._auth is not None:
                self._auth.stop()
            ctx.destroy(linger=0)
            shutil.rmtree(self._tmpdir, ignore_errors=True)

    # ------------------------------------------------------------------ sending

    def _send(self, sock: zmq.Socket[Any], identity: bytes, frames: list[Any]) -> bool:
        """Send without blocking; a gone or saturated peer costs a counter, not the loop."""
        try:
            sock.send_multipart([identity, *frames], zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            self.counters["send_dropped_full"] += 1
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            self.counters["send_dropped_gone"] += 1
        return False

    def _reply(self, identity: bytes, mtype: MsgType, header: dict[str, Any]) -> None:
        self._send(self.data, identity, protocol.make(mtype, header))

    def _reject(self, reason: str, identity: bytes | None = None, detail: str = "") -> None:
        self.rejected[reason] += 1
        log.debug("rejected (%s): %s", reason, detail)
        if identity is not None:
            message = f"rejected: {reason}: {detail}" if detail else f"rejected: {reason}"
            self._reply(identity, MsgType.ERROR, {"message": message, "kind": "protocol"})

    # ------------------------------------------------------------------ clients

    def _on_data(self, frames: list[Any]) -> None:
        identity = frames[0].bytes
        try:
            msg = protocol.decode(frames[1:])
        except ProtocolError as exc:
            self._reject("malformed", identity, str(exc))
            return
        match msg.type:
            case MsgType.HELLO:
                self._on_hello(identity, msg)
            case MsgType.TASK:
                self._on_task(identity, msg, frames[1:])
            case MsgType.HEARTBEAT:
                self.scheduler.touch(msg.header.get("session"), identity)
                beat = {"server_id": self.server_id, "results": self._result_endpoints()}
                self._reply(identity, MsgType.HEARTBEAT, beat)
            case MsgType.STATS:
                self._reply(identity, MsgType.STATS, {"stats": self.stats()})
            case MsgType.BYE:
                self._close_session(msg.header["session"])
            case _:
                self._reject(
                    "unexpected_type", identity, f"{msg.type.name} is not sent to a server"
                )

    def _on_hello(self, identity: bytes, msg: Message) -> None:
        sid = msg.header["session"]
        self.scheduler.open(sid, identity)
        self.counters["hellos"] += 1
        welcome = {
            "session": sid,
            "server_id": self.server_id,
            "dataset_len": self.dataset_len,
            "fingerprint": self.fingerprint,
            "workers": self.n_workers,
            "credit": self.credit,
            "control": self.endpoints["control"],
            "results": self._result_endpoints(),
        }
        self._reply(identity, MsgType.WELCOME, welcome)

    def _result_endpoints(self) -> list[str]:
        """Where clients connect to receive results straight from the workers."""
        return sorted(w.results for w in self._ready if w.results)

    def _on_task(self, identity: bytes, msg: Message, frames: list[Any]) -> None:
        h = msg.header
        session = self.scheduler.touch(h["session"], identity)
        reply = {
            "session": h["session"],
            "task_id": h["task_id"],
            "plan_version": h["plan_version"],
        }
        if session is None:
            self.rejected["unknown_session"] += 1
            message = "unknown session: say HELLO first (the server may have restarted)"
            self._reply(
                identity, MsgType.ERROR, {**reply, "message": message, "kind": "unknown_session"}
            )
            return
        version = h["plan_version"]
        self._cancel(session, self.scheduler.cancel_older(session, version))
        if version < session.version:
            self._cancel(session, [TaskEntry(session.sid, h["task_id"], version, [], [])])
            return
        entry = TaskEntry(session.sid, h["task_id"], version, list(h["indices"]), frames)
        if not self.scheduler.push(session, entry):
            self.rejected["queue_full"] += 1
            message = (
                f"queue full ({self.scheduler.max_queue} tasks): the client ignores its credit"
            )
            self._reply(identity, MsgType.ERROR, {**reply, "message": message, "kind": "overload"})
            return
        self.counters["tasks_received"] += 1

    def _cancel(self, session: Session, entries: list[TaskEntry]) -> None:
        if not entries:
            return
        self.counters["tasks_cancelled"] += len(entries)
        header = {
            "session": session.sid,
            "task_ids": [e.task_id for e in entries],
            "plan_version": session.version,
        }
        self._reply(session.identity, MsgType.CANCELLED, header)

    def _on_control(self, frames: list[Any]) -> None:
        try:
            msg = protocol.decode(frames)
        except ProtocolError as exc:
            self._reject("control_malformed", None, str(exc))
            return
        if msg.type is not MsgType.CONTROL:
            self._reject("control_unexpected_type", None, msg.type.name)
            return
        session = self.scheduler.sessions.get(msg.header["session"])
        if session is None:
            self.rejected["control_unknown_session"] += 1
            return
        if msg.header["plan_version"] < session.version:
            self.rejected["control_stale"] += 1  # replayed or overtaken: nothing to do
            return
        self.counters["controls"] += 1
        self._cancel(session, self.scheduler.cancel_older(session, msg.header["plan_version"]))

    def _close_session(self, sid: bytes) -> None:
        session = self.scheduler.close(sid)
        if session is not None:
            self.counters["sessions_closed"] += 1

    def _housekeeping(self) -> None:
        for sid in self.scheduler.expired(self.config.session_ttl):
            log.info("session %s expired", sid.hex())
            self.counters["sessions_expired"] += 1
            self.scheduler.close(sid)

    # ------------------------------------------------------------------ stats

    def stats(self) -> dict[str, Any]:
        """The counters ``dataserver stats`` prints."""
        busy = sum(1 for w in self.pool.workers.values() if w.tasks)
        return {
            "server_id": self.server_id,
            "pid": os.getpid(),
            "uptime_s": round(time.time() - self.started, 1),
            "endpoints": self.endpoints,
            "dataset_len": self.dataset_len,
            "fingerprint": self.fingerprint,
            "workers": self.n_workers,
            "workers_alive": self.pool.alive(),
            "workers_busy": busy,
            "workers_started": self.pool.started_total,
            "worker_pids": sorted(w.pid for w in self.pool.workers.values()),
            "queue_depth": self.scheduler.queued,
            "sessions": len(self.scheduler.sessions),
            "counters": dict(self.counters),
            "rejected": dict(self.rejected),
            "rejected_total": sum(self.rejected.values()),
        }
