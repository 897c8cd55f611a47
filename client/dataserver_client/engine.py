"""The client's I/O thread: the poll loop, the command queue, and the routing of each
message and connection event to the collaborator that owns what it changes.

The trainer's thread talks to it only through ``call()`` (synchronous commands, answered
before the caller goes on, which is what makes feedback zero-stale) and the ``Handoff``
(finished batches, by step). ZeroMQ and the big copies release the GIL, so one thread
keeps up with many workers.

Collaborators, each the only writer of its state: ``PlanBook`` (book.py: plans, batches,
mode, steering), ``TaskLedger`` (ledger.py: wanted tasks, the send queue), ``Affinity``
(affinity.py: which server a key's sources went to), ``Links`` (links.py: one
``ServerLink`` per server, connection events, heartbeats, the PUB socket), ``Sender``
(dispatch.py: tasks, cancels, controls out). This loop decides and passes ids and values
between them; it never writes their fields.

No message can stop this thread: a message that does not decode is counted and dropped,
and every handler runs under a ``MessageGuard`` (an exception costs that message, counted as
``rejected["internal"]`` in ``client.stats()``). A task whose answer never comes (a direct
result lost with its connection, a dropped message) is asked again after a deadline drawn
from the latencies seen, so nothing waits for ``timeout`` unless a server is really gone.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np
import zmq

from dataserver.landing import LandingArea
from dataserver.loop import MessageGuard, inject, is_shutdown
from dataserver.protocol import (
    Bye,
    Cancelled,
    ErrorMsg,
    Heartbeat,
    Message,
    ProtocolError,
    Result,
    Welcome,
)
from dataserver.security import session_id
from dataserver_client.answers import Deadlines, left_out, result_problem, task_error
from dataserver_client.assembly import Delivery, DeviceMover, HostBuffers
from dataserver_client.book import PlanBook, Position
from dataserver_client.config import ClientConfig
from dataserver_client.dispatch import Sender
from dataserver_client.errors import DataServerError, NotAuthorized, ServerUnreachable
from dataserver_client.handoff import Handoff
from dataserver_client.ledger import TaskRecord
from dataserver_client.links import (
    DatasetInfo,
    Discovery,
    EventKind,
    LinkEvent,
    Links,
    LinkState,
    Problem,
    ServerLink,
    WelcomeProblem,
)
from dataserver_client.receive import WrongAnswer, receive
from dataserver_client.resume import Deal

log = logging.getLogger("dataserver_client")

POLL_MS = 50
PIPELINE = 2  # tasks each worker holds at once (the server's own setting)
TICK_S = 0.02  # liveness timers, not per message: 20 ms is plenty
DRAIN = 256
JOIN_S = 5.0  # how long close() waits for the thread


class Phase(enum.Enum):
    """The I/O thread's lifecycle: NEW -> HANDSHAKE -> RUNNING -> STOPPED (from any, once
    the loop ends: closed, or a fatal error)."""

    NEW = "new"
    HANDSHAKE = "handshake"  # waiting for every server's WELCOME
    RUNNING = "running"
    STOPPED = "stopped"


def _landing(config: ClientConfig) -> LandingArea | None:
    """The shared-memory buffers workers on this host may write results into (a sealed
    memfd: no name on the file system), unless ``shared_memory`` is off."""
    if not config.shared_memory:
        return None
    h, w = config.image_size
    try:
        return LandingArea(config.prefetch + 5, config.batch_size * 3 * h * w, config.batch_size)
    except (OSError, ValueError) as exc:
        log.info("no landing buffers (%s): results come over the socket", exc)
        return None


class Engine(threading.Thread):
    """The I/O thread of one ``DataServerClient``. Its sockets (``links``, ``sender``) are
    created in the thread itself, before the loop starts."""

    links: Links
    sender: Sender

    def __init__(
        self, config: ClientConfig, handoff: Handoff[Delivery], curve: dict[str, bytes] | None
    ) -> None:
        super().__init__(name="dataserver-client-io", daemon=True)
        self.config = config
        self.handoff = handoff
        self.curve = curve
        self.session = session_id(curve["public"] if curve else None)
        self.mover = DeviceMover(config.device)
        self.landing = _landing(config)
        self.buffers = HostBuffers(config.device, keep=config.prefetch + 4, landing=self.landing)
        self.book = PlanBook(config, handoff, self.mover, self.buffers)
        self.ledger = self.book.ledger
        self.handshake: Future[DatasetInfo] = Future()
        self.counters: Counter[str] = Counter(
            late=0,
            cancelled=0,
            results=0,
            reissued=0,
            servers_joined=0,
            servers_left=0,
            servers_drained=0,
            servers_lost=0,
        )
        self.rejected: Counter[str] = Counter()
        self.guard = MessageGuard(log, self.rejected)
        self.deadlines = Deadlines(floor=1.0, initial=max(1.0, config.timeout / 3))
        self.dataset_len = 0
        self.last_progress = time.monotonic()
        self.phase = Phase.NEW
        self._commands: deque[tuple[Callable[..., Any], tuple[Any, ...], Future[Any]]] = deque()
        self._lock = threading.Lock()  # guards _stopped, the command queue's closing, the pipe
        self._stopped = False
        self._halt = threading.Event()  # close() or a failed handshake: the loop ends
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poller = zmq.Poller()
        self._sockets: dict[Any, tuple[ServerLink, str]] = {}

    # ------------------------------------------------------------ any thread

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` in the I/O thread and return its result (or raise its error).
        Once the thread has stopped, raises at once with the reason it stopped."""
        fut: Future[Any] = Future()
        with self._lock:
            if self._stopped:
                raise self.dead_error()
            self._commands.append((fn, args, fut))
        self.wake()
        deadline = time.monotonic() + self.config.timeout + 10.0
        while True:
            try:
                return fut.result(0.25)
            except TimeoutError:
                if not self.is_alive() and not fut.done():
                    raise self.dead_error() from None
                if time.monotonic() > deadline:
                    raise DataServerError("the client's I/O thread did not answer") from None

    def dead_error(self) -> DataServerError:
        return self.handoff.dead_error()

    def wake(self) -> None:
        with self._lock:
            if self._wake_w < 0:
                return
            try:
                os.write(self._wake_w, b"\0")
            except BlockingIOError:
                pass  # the pipe is full, so the thread is awake anyway

    def close(self) -> None:
        """Stop the thread (idempotent). Descriptors it polls are closed by the thread
        itself as it ends, never from here while it might still be polling them; a thread
        that does not end within ``JOIN_S`` (stuck in a command) is logged and left to
        close them when it does."""
        self._halt.set()
        if self.is_alive():
            self.wake()
            self.join(timeout=JOIN_S)
            if self.is_alive():
                log.warning(
                    "the client's I/O thread did not end within %g s (stuck in a command?); "
                    "it closes its sockets when it ends",
                    JOIN_S,
                )
        elif self.ident is None:  # never ran: nobody else will close them
            self._close_pipe()

    def _close_pipe(self) -> None:
        with self._lock:
            for fd in (self._wake_r, self._wake_w):
                if fd >= 0:
                    os.close(fd)
            self._wake_r = self._wake_w = -1

    # ------------------------------------------------------------ the thread

    def run(self) -> None:
        ctx: zmq.Context[Any] = zmq.Context(io_threads=1)
        links: Links | None = None
        discovery: Discovery | None = None
        try:
            standing = lambda: (self.book.plan_version, self.book.control_seq)  # noqa: E731
            links = Links(ctx, self.config, self.session, self.curve, standing, self.landing)
            self.links = links
            self.sender = Sender(
                self.config, self.session, self.book, links, self.buffers, self.landing
            )
            discovery = Discovery(self.config.addresses, self.config.discovery_interval, self.wake)
            discovery.start()
            self._loop(discovery)
        except zmq.ZMQError as exc:
            if not is_shutdown(exc):
                self._die(exc)
        except BaseException as exc:  # surface anything to the trainer instead of dying mute
            self._die(exc)
        finally:
            self._teardown(ctx, links, discovery)

    def _teardown(
        self, ctx: zmq.Context[Any], links: Links | None, found: Discovery | None
    ) -> None:
        if found is not None:
            found.close()
        if links is not None:
            links.close()
        ctx.term()
        with self._lock:
            self._stopped = True
            left = list(self._commands)
            self._commands.clear()
        for _, _, fut in left:
            if not fut.done():
                fut.set_exception(self.dead_error())
        self._close_pipe()
        self.buffers.close()
        if self.landing is not None:
            self.landing.close()
        self.phase = Phase.STOPPED
        self.handoff.fail(DataServerError("the client is closed"))

    def _die(self, exc: BaseException) -> None:
        log.exception("I/O thread failed")
        err = (
            exc
            if isinstance(exc, DataServerError)
            else DataServerError(f"I/O thread failed: {exc!r}")
        )
        if err is not exc:
            err.__cause__ = exc
        self._fail(err)

    def _watch(self, link: ServerLink) -> None:
        for sock, role in link.sockets():
            self._poller.register(sock, zmq.POLLIN)
            self._sockets[sock] = (link, role)

    def _unwatch(self, link: ServerLink) -> None:
        for sock, _ in link.sockets():
            self._poller.unregister(sock)
            self._sockets.pop(sock, None)

    def _loop(self, discovery: Discovery) -> None:
        self._poller.register(self._wake_r, zmq.POLLIN)
        for link in self.links:
            self._watch(link)
        started = time.monotonic()
        next_tick = 0.0
        self.phase = Phase.HANDSHAKE
        while not self._halt.is_set():
            events = dict(self._poller.poll(POLL_MS))
            if self._wake_r in events:
                self._drain_pipe()
            self._run_commands()
            inject("client.loop")  # a test's stand-in for a bug no guard catches
            found = discovery.take()
            if found is not None:
                self._discovered(found)
            for sock in events:
                if sock in self._sockets:
                    self._on_socket(sock, *self._sockets[sock])
            if self.phase is Phase.HANDSHAKE:
                self._check_handshake(started)
                continue
            self._turn()
            now = time.monotonic()
            if now >= next_tick:
                next_tick = now + TICK_S
                self._on_events(self.links.tick(now))
                self._deadlines(now)
                self._check_progress(now)

    def _drain_pipe(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def _turn(self) -> None:
        """What every pass of the loop does once running: deliver, plan, send."""
        self.book.retry_seals()
        self.book.fill()
        if self.ledger.cancels:
            self.sender.cancel()
        self.sender.dispatch()

    def _run_commands(self) -> None:
        while True:
            with self._lock:
                if not self._commands:
                    return
                fn, args, fut = self._commands.popleft()
            try:
                fut.set_result(fn(*args))
            except BaseException as exc:
                fut.set_exception(exc)

    def _on_socket(self, sock: zmq.Socket[Any], link: ServerLink, role: str) -> None:
        if role == "monitor":
            self._on_events(self.links.on_monitor(link))
        elif role == "results_monitor":
            self._on_events(self.links.on_results_monitor(link))
        else:
            self._drain(link, sock, direct=role == "results")

    def _drain(self, link: ServerLink, sock: zmq.Socket[Any], direct: bool) -> None:
        site = "client.results" if direct else "client.data"
        for _ in range(DRAIN):
            try:
                msg = receive(sock, lambda result: self._destinations(link, result))
            except zmq.Again:
                return
            except WrongAnswer as exc:  # well-formed, for a task we want, and wrong
                link.heard()
                self.rejected["wrong_answer"] += 1
                self._bad_server(link, str(exc))
                continue
            except ProtocolError as exc:
                link.heard()
                self.rejected["malformed"] += 1
                # The first few are worth a warning; a flood is counted (client.stats()).
                level = logging.WARNING if self.rejected["malformed"] <= 5 else logging.DEBUG
                log.log(level, "dropped a bad message from %s: %s", link.address, exc)
                continue
            link.heard()
            self.guard.run(site, self._on_message, link, msg, direct)

    def _destinations(self, link: ServerLink, result: Result) -> np.ndarray | None:
        """Where the images of ``result`` from ``link`` go (``PlanBook.destination``), if its
        task is still wanted and was sent to that server; None otherwise (the pixels are
        read off and dropped: a server reaches only the slots of tasks it was given)."""
        if result.session != link.session or link.state is LinkState.BANNED:
            return None
        rec = self.ledger.wanted(result.task_id, result.plan_version)
        if rec is None or rec.link is not link:
            return None
        if len(result.images) != len(rec.slots):
            raise WrongAnswer(
                f"{len(result.images)} images for task {rec.task_id} of {len(rec.slots)}"
            )
        return self.book.destination(rec)

    # ------------------------------------------------------------ messages

    def _on_message(self, link: ServerLink, msg: Message, direct: bool) -> None:
        if link.state is LinkState.BANNED:
            self.rejected["from_banned_server"] += 1
        elif direct and not isinstance(msg, Result):
            self.rejected["unexpected_type"] += 1  # workers send nothing else
        elif getattr(msg, "session", link.session) not in (link.session, None):
            self.rejected["other_session"] += 1
        else:
            self._route(link, msg)

    def _route(self, link: ServerLink, msg: Message) -> None:
        match msg:
            case Result():
                inject("client.result")
                self._on_result(link, msg)
            case ErrorMsg():
                self._on_error(link, msg)
            case Cancelled():
                self._on_cancelled(link, msg)
            case Welcome():
                self._on_welcome(link, msg)
            case Heartbeat():
                if msg.results is not None:
                    link.sync_results(msg.results, msg.local or ())
            case Bye():
                self._on_bye(link)
            case _:
                self.rejected["unexpected_type"] += 1

    def _answered(self, link: ServerLink, task_id: int) -> None:
        sent = link.release(task_id)
        if sent is not None:
            self.deadlines.observe(time.monotonic() - sent)

    def _on_result(self, link: ServerLink, msg: Result) -> None:
        self._answered(link, msg.task_id)
        link.answered()
        rec = self.ledger.wanted(msg.task_id, msg.plan_version)
        if rec is None:
            self.counters["late"] += 1  # superseded plan, or a second answer after asking again
            return
        # Nothing counts as progress before the answer is checked: a server answering
        # what it was not asked must not keep an epoch that goes nowhere alive.
        problem = result_problem(rec, msg, lambda: self._sealed(rec))
        if problem is not None:
            self.rejected[problem[0]] += 1
            self._refuse(link, rec, problem[1])
            return
        self.last_progress = time.monotonic()
        if msg.failed and self.config.on_error == "raise":
            self.book.on_failure(rec, "sample", left_out(link.address, msg))
            return
        self.counters["results"] += 1
        if msg.landed:
            self.counters["results_landed"] += 1
        self.book.on_result(rec, msg)

    def _sealed(self, rec: TaskRecord) -> bool:
        """Whether every image of ``rec`` carries the seal record (generation, task id) a
        worker writes after composing it into our landing buffer: two words an image."""
        batch = self.book.batch_of(rec)
        where = self.buffers.landing_of(batch.host) if batch is not None else None
        if where is None or rec.land_gen is None or self.landing is None:
            return False
        return self.landing.sealed(where[0], rec.slots, rec.land_gen, rec.task_id)

    def _refuse(self, link: ServerLink, rec: TaskRecord, why: str) -> None:
        """``link`` answered ``rec`` wrongly: it is dropped (``_bad_server``) and ``rec``
        asked again elsewhere, unless it is out with another server or waiting to be sent
        (a forged answer to a task sent elsewhere, or asked again already)."""
        self._bad_server(link, why)
        if rec.link is link:
            self.ledger.ask_again([rec])

    def _on_error(self, link: ServerLink, msg: ErrorMsg) -> None:
        if msg.task_id is None:
            self._on_session_error(link, msg)
            return
        self._answered(link, msg.task_id)
        rec = self.ledger.wanted(msg.task_id, msg.plan_version)
        if rec is None or rec.link is not link:
            self.counters["late"] += 1  # (or about a task it was not given: not its to fail)
            return
        if msg.kind in ("maybe_lost", "dropped"):
            # A result that may never arrive (its worker died right after sending it), or
            # one the server would not hold for us: ask again (a late copy is dropped).
            self.counters[f"asked_again_{msg.kind}"] += 1
            self.ledger.ask_again([rec])
        elif msg.kind == "control_missing":  # it never had our control values: send them
            self.sender.send_control(link)
            self.ledger.ask_again([rec])
        elif msg.kind == "unknown_session":  # the server restarted or forgot us: handshake again
            self.ledger.ask_again([rec])
            link.forget_session()
        elif msg.kind in ("sample", "poison") and msg.index not in (None, *rec.indices):
            self.rejected["wrong_answer"] += 1  # it blamed a sample the task lacks
            self._refuse(link, rec, f"blamed sample {msg.index} for task {msg.task_id}")
        else:
            self.last_progress = time.monotonic()
            self.book.on_failure(rec, msg.kind, task_error(link.address, msg), msg.image)

    def _on_session_error(self, link: ServerLink, msg: ErrorMsg) -> None:
        """An ERROR about this session and no task: the server forgot the session (say
        HELLO again), or refuses it (limits, a key that does not own it, a message it cannot
        read). A refusal is final for this client when no other server can go on without
        that one (waiting would not help, and the server's words say why); with others
        ready, that server alone is dropped, so one server cannot end a job by saying so."""
        if msg.kind == "unknown_session":
            link.forget_session()
            return
        if msg.kind == "not_authorized":
            error: DataServerError = NotAuthorized(
                f"not authorized by {link.address}: {msg.message}"
            )
        else:
            error = DataServerError(f"{link.address}: {msg.message}")
        if self.links.any_ready(besides=link) and self.handshake.done():
            self._bad_server(link, f"it refused this session: {msg.message}")
        else:
            self._fail(error)

    def _on_cancelled(self, link: ServerLink, msg: Cancelled) -> None:
        for tid in msg.task_ids:
            if link.release(tid) is not None:
                self.counters["cancelled"] += 1
            rec = self.ledger.get(tid)
            if rec is not None and rec.link is link:
                self.ledger.ask_again([rec])  # cancelled though still wanted: send it again

    def _on_bye(self, link: ServerLink) -> None:
        """The server is draining (SIGTERM: a scale-down, a rolling update): send it nothing
        more. What it had queued for us comes back CANCELLED and goes to the others; what
        it runs, it finishes."""
        self.counters["servers_drained"] += link.state is not LinkState.DRAINING
        link.drain()
        self._servers_changed(lookahead=False)

    def _on_welcome(self, link: ServerLink, msg: Welcome) -> None:
        problem = self.links.check(link, msg)
        if problem is not None:
            self._unfit(link, msg, problem)
            return
        was_lost = link.was_lost
        restarted = link.welcome(msg)
        if self.book.control_seq or self.book.plan_version:
            self.sender.send_control(link)  # a server met anew learns the session's values first
        self._servers_changed()
        self.links.joined(link)
        if restarted or was_lost:
            # A restarted server lost what it held; after a lost connection, answers in
            # flight may be gone. Send again; an answer that comes twice is dropped by id.
            moved = self._move_tasks(link)
            log.warning("%s is back: asking again for its %d task(s)", link.address, moved)
        for other in self.links:  # servers still gone: their tasks come to those back
            if other.state is LinkState.LOST and other.owed():
                self._move_tasks(other)

    def _unfit(self, link: ServerLink, msg: Welcome, problem: WelcomeProblem) -> None:
        """A WELCOME that fails the check. A server that cannot compose our image size is
        only declined when others serve the session; anything else stops it."""
        if problem.kind is Problem.TOO_LARGE:
            self._bad_server(link, problem.why)
            self._fail(
                DataServerError(
                    f"{link.address}: {problem.why} (a dataset that large needs "
                    "DataServerClient(max_dataset_len=...))"
                )
            )
        elif (
            problem.kind is Problem.IMAGE_SIDE
            and self.handshake.done()
            and self.links.any_ready(link)
        ):
            link.decline(msg, problem.why)
            self._servers_changed()
        else:
            link.decline(msg, problem.why)  # (it holds a session for us: BYE frees it at close)
            self._fail(DataServerError(problem.why))

    # ------------------------------------------------------------ links and tasks

    def _discovered(self, addresses: list[str]) -> None:
        """DNS says the servers are now ``addresses``: greet the new ones (they get tasks once
        they answer), let go of those that left (their tasks move at once)."""
        known = {link.address: link for link in self.links}
        for address in addresses:
            if address not in known:
                log.info("%s joined (discovery)", address)
                self.counters["servers_joined"] += 1
                self._watch(self.links.add(address))
        for address, link in known.items():
            if address in addresses:
                continue
            log.info("%s left (discovery): moving its %d task(s)", address, len(link.owed()))
            self.counters["servers_left"] += 1
            self._unwatch(link)
            self.links.remove(link)
            self._servers_changed(lookahead=False)
            self._move_tasks(link)
        self._servers_changed()

    def _on_events(self, events: list[LinkEvent]) -> None:
        for event in events:
            if event.kind is EventKind.NOT_AUTHORIZED:
                self._fail(NotAuthorized(event.why))
            elif event.kind is EventKind.LOST:
                self.counters["servers_lost"] += 1
                self._servers_changed(lookahead=False)
                if self.links.any_ready():
                    self._move_tasks(event.link)
            elif event.kind is EventKind.RESULTS_BROKEN:
                # Results on their way in that connection are gone; which tasks they were
                # for, only the server knew. Ask again for what this server still owes.
                n = self._move_tasks(event.link)
                if n:
                    self.counters["asked_again_results_broken"] += n
                    log.info(
                        "%s: a result connection dropped (%s); asked again for %d task(s)",
                        event.link.address,
                        event.why,
                        n,
                    )

    def _bad_server(self, link: ServerLink, why: str) -> None:
        """``link`` answered what it was not asked or claimed what it did not do: a faulty
        or hostile server. It is dropped for good (``LinkState.BANNED``), counted in
        ``rejected["bad_server"]``, and what it held moves to the other servers (with none
        left, the epoch stops at ``timeout`` with this reason)."""
        if link.state is LinkState.BANNED:
            return
        self.rejected["bad_server"] += 1
        link.ban(why)
        self._servers_changed()
        self._move_tasks(link)

    def _servers_changed(self, lookahead: bool = True) -> None:
        """The ready servers changed: how many tasks they can work on at once (the book
        cuts batches into enough tasks to keep them all busy), where keys route; and
        (``lookahead``) whether the lookahead is still worth it."""
        ready = self.links.ready()
        self.book.set_parallelism(max(1, sum(lk.workers for lk in ready)) * PIPELINE)
        self.book.affinity.set_ready(ready)
        self.ledger.unprefer(set(self.book.affinity.live()))
        if lookahead and self.config.lookahead:
            # Lookahead composes the next batch in both modes from the same sources: worth
            # it only where every server keeps the sources it decoded (a store); without
            # one, it would decode them twice. Off, flips replan (zero stale either way).
            stores = self.links.stores()
            if self.book.lookahead.enabled and not stores:
                log.info("a server keeps no store of sources (--cache-gb 0): lookahead is off")
                self.book.set_lookahead(False)
            elif not self.book.lookahead.enabled and stores and self.config.stitch_k > 1:
                self.book.set_lookahead(True)

    def _move_tasks(self, link: ServerLink) -> int:
        n = self.ledger.ask_again(self.ledger.records(link.take_outstanding()))
        self.counters["reissued"] += n
        return n

    def _deadlines(self, now: float) -> None:
        """Tasks unanswered past the deadline are asked again (their credit is let go: the
        server either lost the answer, or will answer twice and the copy is dropped)."""
        limit = self.deadlines.value
        for link in self.links:
            if link.state is not LinkState.READY:
                continue
            n = self.ledger.ask_again(self.ledger.records(link.expire(now, limit)))
            if n:
                self.counters["asked_again_deadline"] += n
                log.info(
                    "%s: %d task(s) unanswered for %.1f s; asked again", link.address, n, limit
                )

    def _check_handshake(self, started: float) -> None:
        info = self.links.handshake()
        if info is not None:
            self.dataset_len = info.dataset_len
            self.handshake.set_result(info)
            self.last_progress = time.monotonic()
            self.phase = Phase.RUNNING
            return
        self.links.tick(time.monotonic())
        if time.monotonic() - started > self.config.timeout:
            self._fail(
                ServerUnreachable(
                    f"no answer from {self.links.waiting_names()} within "
                    f"{self.config.timeout:g} s (is `dataserver serve` running there, and reachable?)"
                )
            )

    def _check_progress(self, now: float) -> None:
        ledger = self.ledger
        waiting = bool(ledger.pending) or any(link.owed() for link in self.links)
        if not (waiting and len(ledger)):
            self.last_progress = now
            return
        if now - self.last_progress <= self.config.timeout:
            return
        parts = []
        for link in self.links:
            mine = sum(1 for t in link.owed() if t in ledger)
            why = f", {link.last_error}" if link.last_error else ""
            parts.append(
                f"{link.address} ({link.state.name.lower()}, {mine} task(s) outstanding{why})"
            )
        pending = ledger.pending
        self._fail(
            DataServerError(
                f"no progress for {self.config.timeout:g} s; waiting for: "
                + ", ".join(parts)
                + (f"; {pending} task(s) not yet sent" if pending else "")
            )
        )
        self.last_progress = now

    def _fail(self, error: BaseException) -> None:
        """Stop the trainer with ``error``; before the handshake, the loop stops too (the
        client's constructor raises it)."""
        if not self.handshake.done():
            self.handshake.set_exception(error)
            self._halt.set()
        self.handoff.fail(error)

    # ------------------------------------------------------------ commands (I/O thread)

    def start_epoch(
        self,
        epoch: int,
        position: int = 0,
        step: int = 0,
        deal: Deal | None = None,
        planned: tuple[np.ndarray, int] | None = None,
    ) -> int:
        n = self.book.start_epoch(epoch, self.dataset_len, position, step, deal, planned)
        self.last_progress = time.monotonic()
        return n

    def steer(self, mode: str, control: dict[str, Any] | None) -> int:
        """The trainer steers: a mode (``control`` None) or control values. A mode steer
        arms the lookahead; the same mode again changes nothing."""
        if control is None:
            self.book.arm_lookahead()
            if mode == self.book.mode:
                return self.book.plan_version
            if self.book.flip(mode):
                self.sender.cancel()  # the old mode's deeper batches; the plan itself stands
                return self.book.plan_version
        version = self.book.steer(mode, control)
        self.sender.send_control(None)
        return version

    def mode(self) -> str:
        return self.book.mode

    def snapshot(self) -> Position:
        return self.book.position()

    def restore(self, mode: str, control: dict[str, Any], control_seq: int) -> None:
        self.book.restore(mode, control, control_seq)

    def stats(self) -> dict[str, Any]:
        lookahead = self.book.lookahead.state()
        return {
            **self.counters,
            "rejected": dict(self.rejected),
            "plan_version": self.book.plan_version,
            "flips": dict(self.book.flips),
            "lookahead": None if lookahead is None else dataclasses.asdict(lookahead),
            "skipped_poison_images": self.ledger.skipped_poison,
            "task_deadline_s": round(self.deadlines.value, 3),
            "host_buffers_allocated": self.buffers.allocated,
            "servers": [dataclasses.asdict(link.stats()) for link in self.links],
        }
