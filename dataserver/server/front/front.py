"""The front process of ``dataserver serve``: one poll loop over every socket.

Sockets, all created and closed in this process's one thread:

- ``data``    ROUTER, bound to ``--bind``: clients' HELLO / TASK / CONTROL / HEARTBEAT /
  STATS / BYE (a session's CONTROL comes on its data connection, like the rest).
- ``backend`` ROUTER, bound to an ipc path: one DEALER per worker process.

The front routes: each idle worker gets the next task of the fair queue, each result goes
back to the session that asked (or goes there straight from the worker, which then tells
the front DONE). A newer ``plan_version`` (from CONTROL, or from a TASK) cancels the
session's queued older tasks at once, each answered CANCELLED so the client's credits stay
exact. ``clients.py`` decides what each client message does, ``routing.py`` has the
workers' side; the front keeps the sockets, the loop, housekeeping, the drain and the views.

Nothing a peer sends can stop this loop: input is decoded by ``dataserver.protocol`` (which
raises only ``ProtocolError``, counted under a reason and answered when there is someone to
answer), and every handler runs under a ``MessageGuard`` (anything else it raises is counted
as ``internal``, logged once, and costs that one message). What the front holds for clients
is capped: sessions (``--max-sessions``), queued bytes per session and in total and
results waiting to be read (``--max-queued-mb``), image size (``--max-image-side``).

Over the house's ~500 lines (about 760): the ``Front`` owns every socket and the one loop
over them, and what that loop does with its own state stays with it (monitors, drain, admin,
WELCOME, housekeeping, the view); the messages went out to ``clients`` and ``routing``, the
worker processes to ``pool``, the caps to ``conns`` and ``capacity``. Building its parts at
start (``_worker_config``, ``_make_store``, ``_make_prefetcher``) is the next piece that
could go.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import parse_monitor_message

from dataserver import adminsock
from dataserver.counting import Counts
from dataserver.data.fetchcache import MemCache
from dataserver.data.remote import Fetcher, FetchSettings
from dataserver.loop import MessageGuard, StopFlag, serve
from dataserver.protocol import Bye, ProtocolError, Stats, Tally, Task, Welcome, decode
from dataserver.ratelimit import TokenBucket
from dataserver.security import claim_tag, host_proof, proof_ends, reply_id, start_server_curve
from dataserver.server.beats import BeatRule
from dataserver.server.config import ServerConfig, WorkerConfig, bindable, results_bind
from dataserver.server.conns import (
    ConnTracker,
    Gate,
    fd_budget,
    fd_limit,
    peer_socket_options,
    read_message,
)
from dataserver.server.counts import (
    Count,
    Reject,
    Watched,
    bad_handshake,
    connections,
    disconnects,
    dropped,
    not_authorized,
)
from dataserver.server.front.announce import Announced
from dataserver.server.front.capacity import session_cap
from dataserver.server.front.clients import Clients, FrontSide
from dataserver.server.front.metrics import ServerMetrics
from dataserver.server.front.outlet import Outlet
from dataserver.server.front.pool import WorkerHandle, WorkerPool
from dataserver.server.front.prefetch import Block, Prefetcher, Where
from dataserver.server.front.routing import PIPELINE, WorkerRouter
from dataserver.server.front.sessions import Scheduler
from dataserver.server.front.statsview import StatsView
from dataserver.server.front.view import Limits, ServerView
from dataserver.server.memory import memory_room
from dataserver.server.outbox import Outbox
from dataserver.server.store import Store

log = logging.getLogger("dataserver.front")
# The fetch cache's share the workers keep where the front fetches ahead (what a worker
# had to fetch itself, first); the front keeps the rest
WORKERS_SHARE = 0.125

POLL_MS = 100
DRAIN = 256  # messages taken from one socket before looking at the others
CLIENT_MAX_MSG = 2 << 20  # clients only send small headers
CLIENT_HWM = 64  # messages per client pipe; the Outbox bounds the bytes
# What one connection may hold of messages not complete (or not read yet): 16 of the
# largest frame a client sends (libzmq bounds a frame, not the frames of a message).
MAX_UNFINISHED = 16 * CLIENT_MAX_MSG
ADMIN_RATE = 20  # STATS a second on the admin socket (bursts of twice that): its own bucket
MONITORED = (
    zmq.EVENT_ACCEPTED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


class _Poller:
    """The loop's poller: its sockets (with their handlers), their monitors, and the
    pidfds of the workers, re-read whenever the pool's version changes."""

    def __init__(
        self,
        handlers: dict[Any, tuple[str, Callable[[list[Any]], None]]],
        monitors: dict[Any, Watched],
    ) -> None:
        self.handlers = handlers
        self.monitors = monitors
        self._poller = zmq.Poller()
        # Monitors first: zmq.Poller answers in this order, so a connection's ACCEPTED is
        # handled before the first message read on it in the same turn (the caps that
        # charge a peer look the connection up by its fd).
        for sock in (*monitors, *handlers):
            self._poller.register(sock, zmq.POLLIN)
        self._pidfds: set[int] = set()
        self._membership = -1

    def watch(self, membership: int, pidfds: dict[int, WorkerHandle]) -> None:
        """Workers came or went (the pool's ``membership`` moved): watch their pidfds."""
        if membership == self._membership:
            return
        self._membership = membership
        current = set(pidfds)
        for fd in self._pidfds - current:
            self._poller.unregister(fd)
        for fd in current - self._pidfds:
            self._poller.register(fd, zmq.POLLIN)
        self._pidfds = current

    def poll(self, timeout_ms: int) -> list[Any]:
        """What is readable (sockets, monitors, pidfds), waiting at most ``timeout_ms``."""
        return [sock for sock, _ in self._poller.poll(timeout_ms)]


class WorkerStartError(RuntimeError):
    """No worker could start (its dataset fails to build in the worker, say); one line."""


class Front:
    """Routes tasks from client sessions to worker processes and results back."""

    # Its sockets: made by ``run`` with the ZeroMQ context it makes (and closes with them
    # when the loop ends); none before it runs.
    data: zmq.Socket[Any]  # clients
    backend: zmq.Socket[Any]  # the workers
    admin: zmq.Socket[Any]  # the operator's STATS (``adminsock``)

    def __init__(
        self,
        config: ServerConfig,
        dataset_len: int,
        fingerprint: str,
        deterministic: bool = True,
        categories: tuple[tuple[int, str], ...] = (),
        sizes: np.ndarray | None = None,
        index: tuple[int, int] | None = None,
        locate: Callable[[list[int]], list[Where]] | None = None,
        blocks: Callable[[int], Block] | None = None,
    ) -> None:
        """``deterministic``: the dataset says its ``__getitem__`` is a pure function of
        the index (``deterministic = True``); only then may the store keep its output.
        ``categories``: the dataset's (label, name) pairs, checked (announced in WELCOME);
        ``sizes``: its per-sample (h, w), checked (``spec.dataset_sizes``): their count and
        digest announced in WELCOME, the table answered on request (``announce.py``);
        ``index``: the (memfd, size) of the shared annotation index its workers inherit and
        map; ``locate``: where a dataset in object storage keeps its samples' bytes (its
        ``locations``): the front then fetches them ahead of its workers (``prefetch.py``),
        a shard's samples by the block when the dataset says which (``blocks``)."""
        self.config = config
        self.dataset_len = dataset_len
        self.fingerprint = fingerprint
        self.deterministic = deterministic
        self.categories = categories
        self.announced = Announced(sizes)
        self.index = index
        self.server_id = uuid.uuid4().hex[:12]
        self.n_workers = config.worker_count()
        # Credit per client: PIPELINE tasks at each worker plus as many again queued here,
        # so a worker always has its next task at hand.
        self.credit = self.n_workers * PIPELINE * 2
        # Sessions: as many as the fds allow (or --max-sessions, within that); how often
        # their clients beat: set by their number (``beats``).
        self.cap = session_cap(fd_limit(), self.n_workers, config.max_sessions)
        self.beats = BeatRule(config.heartbeat_rate, config.session_ttl, config.idle_timeout)
        self.scheduler = Scheduler(
            self.cap.max_sessions,
            max(64, self.credit * 8),
            config.session_queued_bytes,
            config.max_queued_bytes,
            evict_after=self.beats.evict_after(),
            limit_why=self.cap.why,
        )
        self.outbox = Outbox(config.max_queued_bytes)
        self.counters = Counts(Count)
        self.rejected = Counts(Reject)
        self.guard = MessageGuard(log, partial(self.rejected.count, Reject.INTERNAL))
        self.started = time.time()
        self.endpoints: dict[str, str] = {}
        self._stop = StopFlag()  # set from a signal handler, too
        self._terminate = False  # SIGTERM came: drain (see ``_drain_step``)
        self.draining_since: float | None = None
        self._announced = False
        self._auth: ThreadAuthenticator | None = None
        self._gates: dict[Watched, Gate] = {}  # the public sockets' monitors (``_start``)
        self._admin_entry: Path | None = None
        self._admin_rate = TokenBucket(ADMIN_RATE, 2 * ADMIN_RATE)
        self._tmpdir = tempfile.mkdtemp(prefix="ds-")
        # A client that can read this token beside the workers' ipc sockets is on this host
        # (and sees this file system): it takes their results over ipc.
        self.local_token = uuid.uuid4().hex
        Path(self._tmpdir, "host-token").write_text(self.local_token)
        self.store = self._make_store()
        # the in-memory fetch cache (memfds its workers inherit; ``fetchcache.MemCache``)
        fetch = config.fetch_dir()
        self.fetch_mem = (
            MemCache.create(int(config.fetch_cache_gb * (1 << 30)))
            if fetch is not None and fetch[1] == "memory"
            else None
        )
        self.prefetcher = self._make_prefetcher(locate, blocks)
        self.pool = WorkerPool(self._worker_config())
        self.outlet = Outlet(self.scheduler, self.outbox, self.counters)
        self.workers = WorkerRouter(
            self.pool,
            self.scheduler,
            self.outlet,
            self.counters,
            self.rejected,
            self._observe,
            self._observe_fetch,
        )
        self.metrics: ServerMetrics | None = None  # --metrics-port: started by run()
        fetch = config.fetch_dir()
        budget = int(config.fetch_cache_gb * (1 << 30))
        self.statsview = StatsView(
            self.rejected, self.store, None if fetch is None else (*fetch, budget), self.fetch_mem
        )
        self.conns = ConnTracker(
            config.idle_timeout,
            fd_budget(fd_limit(), self.n_workers, self.cap.max_sessions),
            self.rejected,
            MAX_UNFINISHED,
            live=lambda session: session in self.scheduler.sessions,
            curve=config.curve is not None,
        )
        self.clients = Clients(
            config,
            self.scheduler,
            self.outlet,
            self.workers,
            self.statsview,
            self.counters,
            self.rejected,
            FrontSide(
                self.server_id,
                welcome=self._welcome,
                stats=self.stats,
                draining=lambda: self.draining_since is not None,
                beat_ms=lambda: self.beats.interval_ms,
                store_stall=lambda: (
                    "" if self.prefetcher is None else self.prefetcher.fetcher.stall()
                ),
                fetch=None if self.prefetcher is None else self._fetch_ahead,
            ),
            conns=self.conns,
            announced=self.announced,
        )
        # What the metrics' HTTP thread reads: the view housekeeping last published (one
        # reference, replaced whole; the view itself never changes).
        self._published: ServerView | None = None
        self._poller: _Poller | None = None  # the loop's, made in its thread (``_start``)
        self._on_ready: Callable[[Front], None] = lambda front: None
        self._next_housekeeping = 0.0

    def _worker_config(self) -> WorkerConfig:
        config = self.config
        direct = results_bind(config.bind, self._tmpdir) if config.direct_results else None
        fetch = config.fetch_dir()
        share = WORKERS_SHARE if self.prefetcher is not None else 1.0
        return WorkerConfig(
            backend=f"ipc://{self._tmpdir}/backend",
            state_dir=self._tmpdir,
            dataset=config.dataset,
            dataset_args=config.dataset_args,
            fingerprint=self.fingerprint,
            max_queued_mb=config.max_queued_mb,
            store_fds=self.store.fds if self.store is not None else None,
            store_bytes=self.store.capacity if self.store is not None else 0,
            index_fd=None if self.index is None else self.index[0],
            index_bytes=0 if self.index is None else self.index[1],
            results_bind=direct,
            local_results=config.local_results,
            curve=config.curve,
            idle_timeout=config.idle_timeout,
            max_sessions=self.cap.max_sessions,
            fetch_cache=fetch[0] if fetch else None,
            fetch_where=fetch[1] if fetch else "memory",
            # (the front fetching ahead keeps most of the cache, as one more share: its
            # workers keep what they fetched first, ``WORKERS_SHARE`` of it together)
            fetch_cache_bytes=int(config.fetch_cache_gb * (1 << 30) * share) // self.n_workers,
            fetch_slots=self.n_workers + (self.prefetcher is not None),
            max_fetches=max(1, config.max_fetches // self.n_workers),
            front_fetches=self.prefetcher is not None,
            fetch_mem_fds=None if self.fetch_mem is None else self.fetch_mem.fds,
        )

    def _make_prefetcher(
        self,
        locate: Callable[[list[int]], list[Where]] | None,
        blocks: Callable[[int], Block] | None = None,
    ) -> Prefetcher | None:
        """The front's fetcher (``prefetch.py``) for a dataset in object storage that says
        where its bytes are, with a fetch cache to fetch into; else None."""
        config = self.config
        fetch = config.fetch_dir()
        if locate is None or fetch is None:
            return None
        settings = FetchSettings(
            cache_dir=fetch[0],
            cache_where=fetch[1],
            cache_bytes=int(config.fetch_cache_gb * (1 << 30) * (1.0 - WORKERS_SHARE)),
            share=(self.n_workers, self.n_workers + 1),
            max_fetches=config.max_fetches,
            max_bytes_in_flight=config.max_fetch_mb << 20,
            marks_dir=os.path.join(self._tmpdir, "fetching"),
            mem_fds=None if self.fetch_mem is None else self.fetch_mem.fds,
        )
        os.makedirs(settings.marks_dir or "", exist_ok=True)
        sessions = self.scheduler.sessions
        return Prefetcher(
            Fetcher(settings),
            locate,
            config.max_fetches,
            config.max_fetch_mb << 20,
            live=lambda session: session in sessions,
            blocks=blocks,
        )

    def _fetch_ahead(self, session: bytes, task: Task) -> None:
        """A task admitted: its sources, then its plan's next samples, to fetch ahead."""
        assert self.prefetcher is not None
        n = self.dataset_len
        excluded = set(task.exclude)
        now = dict.fromkeys(i for run in task.images for i in run if i not in excluded and i < n)
        self.prefetcher.want(session, now, [i for i in task.ahead if i < n], task.epoch)

    def _tally_fetches(self) -> None:
        """What the front's fetcher fetched since the last call, counted as a worker's."""
        if self.prefetcher is None:
            return
        fetched = self.prefetcher.fetcher.take_tally()
        if fetched:
            self.workers.on_tally(
                Tally(
                    worker=0,
                    **fetched.tally_fields(),
                )
            )

    def _observe(self, task_us: int, decode_us: tuple[int, ...] | None) -> None:
        """A worker's timings of a task, for the metrics' histograms (when they are on)."""
        if self.metrics is not None:
            self.metrics.observe_task(task_us, decode_us)

    def _observe_fetch(self, fetch_us: tuple[int, ...]) -> None:
        """Workers' GET latencies, for the metrics' histogram (when they are on)."""
        if self.metrics is not None:
            self.metrics.observe_fetches(fetch_us)

    def _make_store(self) -> Store | None:
        """The store of prepared sources: memfds that this process holds for the workers
        it starts (no name on the host), at most half the memory free here (its pages
        count against memory and the memory cgroup, where running out means the OOM
        killer: the other half is left to the workers and whatever else runs here)."""
        want = self.config.cache_bytes
        if want <= 0:
            return None
        if not self.deterministic:
            log.warning(
                "dataset %s is not marked deterministic (a class attribute deterministic = "
                "True says __getitem__ is a pure function of the index): its samples are "
                "read fresh for every task and never stored; augment belongs in its augment()",
                self.config.dataset,
            )
            return None
        room = memory_room()
        size = want if room is None else min(want, room // 2)
        if size < want:
            log.warning(
                "--cache-gb %g: %.1f GiB of memory free; the store gets %.1f GiB",
                self.config.cache_gb,
                (room or 0) / (1 << 30),
                size / (1 << 30),
            )
        if size < 16 << 20:
            log.warning("no room for a store of prepared sources; serving without")
            return None
        store = Store.create(size)
        log.info(
            "store: %d of %d MiB of memory committed in %.0f ms",
            store.committed >> 20,
            size >> 20,
            store.commit_s * 1000,
        )
        return store

    def stop(self) -> None:
        """Ask the loop to finish (safe from a signal handler)."""
        self._stop.set()

    def terminate(self) -> None:
        """SIGTERM: drain, then finish (safe from a signal handler). A second one, or a
        drain of 0 seconds, stops at once."""
        if self._terminate or self.config.drain_seconds <= 0:
            self._stop.set()
        self._terminate = True

    def _drain_step(self, now: float) -> None:
        """Draining: the first time, tell every client (BYE: send nothing more) and answer
        every queued task CANCELLED (the clients send them elsewhere); then wait until the
        workers have finished what they hold and its results are out, or the grace period
        (``--drain-seconds``) is over."""
        if self.draining_since is None:
            self.draining_since = now
            sessions = list(self.scheduler.sessions.values())
            queued = 0
            for session in sessions:
                self.outlet.reply(session, Bye(session=session.sid))
                gone = self.scheduler.take(session, lambda e: e.held_by is None)
                queued += len(gone)
                self.outlet.cancel(session, gone)
            log.log(
                logging.WARNING if sessions else logging.INFO,
                "SIGTERM: draining (%d session(s) told, %d queued task(s) handed back; "
                "at most %g s)",
                len(sessions),
                queued,
                self.config.drain_seconds,
            )
            self.counters.count(Count.DRAINS)
        done = self.workers.busy() == 0 and self.scheduler.queued == 0 and not self.outbox.nbytes
        if done or now - self.draining_since > self.config.drain_seconds:
            if not done:
                log.warning(
                    "drain: %g s passed with work still held; stopping", self.config.drain_seconds
                )
            log.info("drained in %.2f s", now - self.draining_since)
            self._stop.set()

    # ------------------------------------------------------------------ run loop

    def run(self, on_ready: Callable[[Front], None]) -> None:
        """Bind, start the workers, serve until ``stop()``, then shut down cleanly."""
        ctx = zmq.Context()
        self.data = ctx.socket(zmq.ROUTER)
        self.backend = ctx.socket(zmq.ROUTER)
        self.admin = ctx.socket(zmq.ROUTER)
        self.outlet.attach(self.data, self.backend)
        self._on_ready = on_ready
        serve(lambda: self._start(ctx), self._turn, self._stop, lambda: self._close(ctx))

    def _start(self, ctx: zmq.Context[Any]) -> None:
        self._bind(ctx)
        if self.config.metrics_port is not None:  # a taken port fails before any worker
            self.metrics = ServerMetrics(
                lambda: self._published, self.config.metrics_port, self.config.metrics_host()
            )
        self.pool.start(self.n_workers)
        watched: dict[Watched, zmq.Socket[Any]] = {"data": self.data}
        for name, sock in watched.items():
            monitor = sock.get_monitor_socket(MONITORED)
            self._gates[name] = Gate(ctx, monitor, self.conns.barred)
        if self.prefetcher is not None:
            self.prefetcher.start()
        self._poller = _Poller(
            {
                self.backend: ("front.backend", self.workers.on_message),
                self.data: ("front.data", self.clients.on_data),
                self.admin: ("front.admin", self._on_admin),
            },
            # Connection-level events on the public socket: failed handshakes (raw TCP
            # junk, wrong socket types, CURVE refusals) never reach the loop as messages.
            # Each read by a ``Gate`` of its own first (a barred peer's connection shut
            # down at once, whatever the loop is doing), its events passed on in order.
            {gate.events: name for name, gate in self._gates.items()},
        )

    def _close(self, ctx: zmq.Context[Any]) -> None:
        try:
            self._shutdown(ctx)
        finally:
            if self.metrics is not None:  # scrapes are answered until the very end
                self.metrics.stop()

    def _turn(self) -> None:
        """One turn of the loop: wait at most ``POLL_MS`` for input, handle it, then the
        periodic work, then give queued tasks to idle workers."""
        poller = self._poller
        if poller is None:  # (_start sets it before the first turn)
            return
        poller.watch(self.pool.membership, self.pool.by_pidfd())
        reap = False
        for sock in poller.poll(POLL_MS):
            if sock in poller.handlers:
                site, handler = poller.handlers[sock]
                self._drain(sock, site, handler)
            elif sock in poller.monitors:
                self._on_monitor(sock, poller.monitors[sock])
            else:
                reap = True  # a pidfd: a worker exited
        now = time.monotonic()
        if self._terminate:
            self._drain_step(now)
        if reap or now >= self._next_housekeeping:
            self.workers.reap()
        if now >= self._next_housekeeping:
            self._next_housekeeping = now + 0.5
            self._housekeeping()
        self.workers.dispatch()
        if not self._announced and len(self.workers.ready) >= self.n_workers:
            self._announced = True
            self._published = self.view()  # a scrape after the ready line sees them ready
            self._on_ready(self)

    def _bind(self, ctx: zmq.Context[Any]) -> None:
        data, backend = self.data, self.backend
        data.setsockopt(zmq.LINGER, 0)
        data.setsockopt(zmq.MAXMSGSIZE, CLIENT_MAX_MSG)
        peer_socket_options(data)
        data.setsockopt(zmq.ROUTER_MANDATORY, 1)
        data.setsockopt(zmq.SNDHWM, CLIENT_HWM)
        backend.setsockopt(zmq.LINGER, 0)
        backend.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if self.config.curve is not None:
            secret, authorized = self.config.curve
            self._auth = start_server_curve(ctx, secret, authorized, [data])
        data.bind(bindable(self.config.bind))
        backend.bind(self.pool.backend)
        self.endpoints = {"data": data.getsockopt_string(zmq.LAST_ENDPOINT)}
        # The operator's STATS: an ipc socket in the 0700 state dir (other users cannot
        # reach it), with a rate of its own, registered for ``dataserver stats ADDR``.
        self.admin.setsockopt(zmq.LINGER, 0)
        self.admin.setsockopt(zmq.MAXMSGSIZE, 4096)
        self.admin.bind(f"ipc://{self._tmpdir}/{adminsock.ADMIN_NAME}")
        self.endpoints["admin"] = self.admin.getsockopt_string(zmq.LAST_ENDPOINT)
        self._admin_entry = adminsock.register(
            self.endpoints["data"], self.endpoints["admin"], self.server_id
        )

    def _drain(
        self, sock: zmq.Socket[Any], site: str, handler: Callable[[list[Any]], None]
    ) -> None:
        # The data socket's messages a frame at a time, never more than MAX_FRAMES of
        # them (``conns.read_message``: a peer's message of 500,000 empty frames took the
        # whole core); the workers' and the admin socket's (ipc, this user's) whole.
        public = sock is self.data
        for _ in range(DRAIN):
            try:
                if public:
                    frames = read_message(sock, 1, partial(self.conns.flooded, "data"))
                    if frames is None:
                        continue
                else:
                    frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self.guard.run(site, handler, frames)

    def _on_monitor(self, monitor: zmq.Socket[Any], name: Watched) -> None:
        for _ in range(DRAIN):  # a flood of connects must not keep the loop from the rest
            try:
                frames = monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            event = parse_monitor_message(frames[:2])
            kind = event["event"]
            if frames[2:] == [Gate.BARRED]:  # (its Gate shut it down: a barred peer's)
                self.counters.count(connections(name))
                self.rejected.count(dropped(name, "barred_dropped"))
                continue
            if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                self.rejected.count(not_authorized(name))
            elif kind in (
                zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
            ):
                self.rejected.count(bad_handshake(name))
            elif kind == zmq.EVENT_DISCONNECTED:
                self.counters.count(disconnects(name))
                self.conns.disconnected(event["value"])
            elif kind == zmq.EVENT_ACCEPTED:
                self.counters.count(connections(name))
                self.conns.accepted(name, event["value"])

    def _shutdown(self, ctx: zmq.Context[Any]) -> None:
        if self.prefetcher is not None:
            self.prefetcher.stop()
        self.workers.stop()
        for w in list(self.pool.workers.values()):
            if w.identity is not None:
                self.outlet.send_worker(w.identity, Bye(session=None).encode())
        try:
            self.pool.stop()
        finally:
            for gate in self._gates.values():
                gate.close()
            if self._auth is not None:
                self._auth.stop()
            # After a drain, give the last results the front forwards a moment to leave.
            ctx.destroy(linger=500 if self.draining_since is not None else 0)
            if self.store is not None:
                self.store.close()
            if self.fetch_mem is not None:
                self.fetch_mem.close()
            adminsock.unregister(self._admin_entry, self.endpoints.get("admin", ""))
            shutil.rmtree(self._tmpdir, ignore_errors=True)

    # ------------------------------------------------------------------ clients, housekeeping

    def _on_admin(self, frames: list[Any]) -> None:
        """A message on the admin socket: STATS answered at its own rate; nothing else."""
        identity = frames[0].bytes
        try:
            msg = decode(frames[1:])
        except ProtocolError:
            self.rejected.count(Reject.ADMIN_MALFORMED)
            return
        if not isinstance(msg, Stats):
            self.rejected.count(Reject.ADMIN_UNEXPECTED_TYPE)
            return
        if not self._admin_rate.take():
            self.rejected.count(Reject.ADMIN_RATE)
            return
        self.admin.send_multipart([identity, *Stats(stats=self.stats()).encode()], zmq.NOBLOCK)

    def _welcome(self, session: bytes, nonce: bytes = b"", fd: int = -1) -> Welcome:
        """What this server tells a client it greets: itself, its credit, where to send,
        how often to beat (for the sessions it has with this one), and, for a HELLO with a
        nonce, the proof of its host bound to the connection ``fd`` the HELLO came by."""
        self._pace_beats()
        results, local = self.workers.result_endpoints()
        ends = proof_ends(fd, server=True) if nonce and local else None
        # The tag its claims on the workers' result ports carry: the front admitted it.
        opened = self.scheduler.sessions.get(session)
        claim = b""
        if opened is not None and results:
            claim = claim_tag(self.pool.claim_key, session, reply_id(opened.secret))
        return Welcome(
            session=session,
            server_id=self.server_id,
            dataset_len=self.dataset_len,
            fingerprint=self.fingerprint,
            workers=self.n_workers,
            credit=self.credit,
            results=results,
            max_image_side=self.config.max_image_side,
            max_task_bytes=self.config.max_task_bytes,
            local=local,
            local_proof=b"" if ends is None else host_proof(self.local_token, nonce, session, ends),
            claim=claim,
            store_bytes=self.store.capacity if self.store is not None else 0,
            categories=self.categories,
            sizes_count=self.announced.count,
            sizes_digest=self.announced.digest,
            heartbeat_ms=self.beats.interval_ms,
            fetch_ahead=int(self.prefetcher is not None),
        )

    def _housekeeping(self) -> None:
        for sid in self.scheduler.expired(self.config.session_ttl):
            log.info("session %s expired", sid.hex())
            self.counters.count(Count.SESSIONS_EXPIRED)
            self.scheduler.close(sid)
        self._pace_beats()
        why = self.pool.startup_failure()
        if why is not None:
            raise WorkerStartError(why)
        now = time.monotonic()
        self.statsview.refresh(now)
        self._tally_fetches()
        self.conns.check(now)
        self._published = self.view()  # for the metrics' thread

    def _pace_beats(self) -> None:
        """The sessions' number moved the interval their clients beat at (``beats``):
        new clients learn it in their WELCOME, the others in their next heartbeat reply."""
        sessions = len(self.scheduler.sessions)
        if self.beats.update(sessions, time.monotonic()):
            self.scheduler.beat_every(self.beats.interval_s, self.beats.evict_after())
            log.info(
                "%d sessions: clients are told to beat every %g s", sessions, self.beats.interval_s
            )

    # ------------------------------------------------------------------ stats

    def view(self) -> ServerView:
        """The server's figures now, read from its collaborators (in the loop's thread)."""
        if self.scheduler.paced:
            self.counters.record(Count.TASKS_PACED, self.scheduler.paced)
        if self.metrics is not None and self.metrics.rate_refused:
            self.rejected.record(Reject.SCRAPE_RATE, self.metrics.rate_refused)
        if self.metrics is not None and self.metrics.total_refused:
            self.rejected.record(Reject.SCRAPE_TOTAL, self.metrics.total_refused)
        config, scheduler, pool = self.config, self.scheduler, self.pool
        draining = self.draining_since
        return ServerView(
            server_id=self.server_id,
            started=self.started,
            taken=time.time(),
            metrics_port=self.metrics.port if self.metrics is not None else None,
            dataset_len=self.dataset_len,
            fingerprint=self.fingerprint,
            workers=self.n_workers,
            workers_alive=pool.alive(),
            workers_ready=len(self.workers.ready),
            workers_busy=self.workers.busy(),
            workers_started=pool.started_total,
            worker_spawn_failures=pool.spawn_failures,
            queue_depth=scheduler.queued,
            queued_bytes=scheduler.queued_bytes,
            results_unread_bytes=self.outbox.nbytes,
            sessions=len(scheduler.sessions),
            sessions_evicted=scheduler.evicted,
            connections=len(self.conns.conns),
            heartbeat_interval_s=self.beats.interval_s,
            draining_for_s=None if draining is None else round(time.monotonic() - draining, 2),
            limits=Limits(
                max_sessions=scheduler.max_sessions,
                max_sessions_why=scheduler.limit_why,
                max_image_side=config.max_image_side,
                max_queued_mb=config.max_queued_mb,
                max_connections=self.conns.limit,
                max_task_mb=config.max_task_mb,
                idle_timeout_s=config.idle_timeout,
            ),
            store=self.statsview.usage,
            fetch_cache=self.statsview.fetch_usage,
            prefetch=None if self.prefetcher is None else self.prefetcher.snapshot(),
            sources=self.sources(),
            counters=ServerView.frozen(self.counters),
            rejected=ServerView.frozen(self.rejected),
        )

    def sources(self) -> str:
        """How sources are served: "stored" (kept in the store), "fresh:not-deterministic"
        (the dataset does not say it is a pure function of the index) or "fresh:no-store"."""
        if self.store is not None:
            return "stored"
        return "fresh:no-store" if self.deterministic else "fresh:not-deterministic"

    def stats(self) -> dict[str, Any]:
        """The counters ``dataserver stats`` prints (``view.py``: nothing in them a peer
        should not know). The view they come from is published for the metrics too: what
        a STATS answer showed, a scrape after it shows at least."""
        view = self._published = self.view()
        return view.as_stats()
