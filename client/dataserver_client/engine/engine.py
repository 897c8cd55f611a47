"""The client's I/O thread: the poll loop, the command queue, and the routing of each
message and connection event to the collaborator that owns what it changes.

The trainer's thread talks to it only through ``call()`` (synchronous commands, answered
before the caller goes on, which is what makes feedback zero-stale) and the ``Handoff``
(finished batches, by step). ZeroMQ and the big copies release the GIL, so one thread
keeps up with many workers.

Collaborators, each the only writer of its state: ``PlanBook`` (book.py: plans, batches,
mode, steering), ``TaskLedger`` (ledger.py: wanted tasks, the send queue), ``Affinity``
(affinity.py: which server a key's sources went to), ``Links`` (links.py: connection events,
heartbeats; one ``ServerLink`` per server, serverlink.py), ``Sender`` (dispatch.py: tasks, cancels,
controls out), ``Handlers`` (handlers.py: what each message, link event and discovery
change does; the answer deadlines and the last progress), its ``Mailbox`` (mailbox.py: the
command queue and the pipe that wakes the loop) and ``SizeAsks`` (sizes.py: the fetch of
the dataset's sizes). This loop routes each socket and message to its handler and passes
ids and values between them; it never writes their fields. It makes the session's parts
and hands them, as ``Parts`` (parts.py), to the sender and the handlers, which share them;
the facade (client.py) reaches them only through ``call`` and ``hand_over``.

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
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from typing import Any

import numpy as np
import zmq

from dataserver.loop import MessageGuard, inject, is_shutdown
from dataserver.protocol import (
    Bye,
    Cancelled,
    ErrorMsg,
    Heartbeat,
    Message,
    Result,
    SampleSizes,
    Welcome,
)
from dataserver_client.batch import Batch
from dataserver_client.buffers.assembly import DeviceMover
from dataserver_client.buffers.handoff import Handoff
from dataserver_client.config import ClientConfig
from dataserver_client.counts import Reject
from dataserver_client.engine.dispatch import Sender
from dataserver_client.engine.handlers import Handlers
from dataserver_client.engine.mailbox import Mailbox
from dataserver_client.engine.parts import LoopHooks, Parts
from dataserver_client.engine.sizes import SizeAsks
from dataserver_client.errors import DataServerError, ServerUnreachable
from dataserver_client.net.discovery import Discovery
from dataserver_client.net.fds import FdBudget, new_context, raise_fd_limit
from dataserver_client.net.links import Links
from dataserver_client.net.serverlink import EventKind, LinkState, ServerLink
from dataserver_client.net.watch import Watch
from dataserver_client.net.welcome import DatasetInfo
from dataserver_client.plan.epoch import BatchPlan, ShardLike
from dataserver_client.plan.resume import Deal, Position
from dataserver_client.plan.sizes import SizeSchedule
from dataserver_client.session.inflight import Delivery

log = logging.getLogger("dataserver_client")

POLL_MS = 50
TICK_S = 0.02  # liveness timers, not per message: 20 ms is plenty (and the hedge timer's step)
JOIN_S = 5.0  # how long close() waits for the thread


class Phase(enum.Enum):
    """The I/O thread's lifecycle: NEW -> HANDSHAKE -> RUNNING -> STOPPED (from any, once
    the loop ends: closed, or a fatal error)."""

    NEW = "new"
    HANDSHAKE = "handshake"  # waiting for every server's WELCOME
    RUNNING = "running"
    STOPPED = "stopped"


@dataclasses.dataclass(frozen=True)
class Wiring:
    """The parts the I/O thread builds itself before its loop, because they hold its
    sockets: the links, the sender and the handlers (which share them)."""

    links: Links
    sender: Sender
    handlers: Handlers


class Engine(threading.Thread):
    """The I/O thread of one ``DataServerClient``. Its sockets (``links``, ``sender``) are
    created in the thread itself, before the loop starts: until then ``wiring`` is None and
    ``links``, ``sender`` and ``handlers`` raise."""

    def __init__(
        self, config: ClientConfig, handoff: Handoff[Delivery], curve: dict[str, bytes] | None
    ) -> None:
        super().__init__(name="dataserver-client-io", daemon=True)
        self.config = config
        self.handoff = handoff
        self.curve = curve
        self.mover = DeviceMover(config.device)
        self.parts = Parts.of_session(config, handoff, self.mover)  # (shared: parts.py)
        self.handshake: Future[DatasetInfo] = Future()
        self.guard = MessageGuard(log, partial(self.parts.rejected.count, Reject.INTERNAL))
        self.dataset_len = 0
        self.dataset: DatasetInfo | None = None  # as the handshake fixed it
        self.size_asks = SizeAsks()  # the per-sample sizes, once asked for
        self.phase = Phase.NEW
        self._mailbox = Mailbox()  # the commands of other threads, and the pipe that wakes us
        self._halt = threading.Event()  # close() or a failed handshake: the loop ends
        self._poller = Watch()  # (epoll over the sockets' descriptors: costs what is ready)
        self._sockets: dict[zmq.Socket[Any], tuple[ServerLink, str]] = {}
        self.wiring: Wiring | None = None  # (made by the thread: ``run``)

    @property
    def links(self) -> Links:
        return self._wired().links

    @property
    def sender(self) -> Sender:
        return self._wired().sender

    @property
    def handlers(self) -> Handlers:
        return self._wired().handlers

    def _wired(self) -> Wiring:
        if self.wiring is None:
            raise DataServerError("the client's I/O thread has not made its sockets yet")
        return self.wiring

    # ------------------------------------------------------------ any thread

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` in the I/O thread and return its result (or raise its error).
        Once the thread has stopped, raises at once with the reason it stopped."""
        fut = self._mailbox.post(fn, args)
        if fut is None:
            raise self.dead_error()
        deadline = time.monotonic() + self.config.timeout + 10.0
        while True:
            try:
                return fut.result(0.25)
            except TimeoutError:
                if not self.is_alive() and not fut.done():
                    raise self.dead_error() from None
                if time.monotonic() > deadline:
                    raise DataServerError("the client's I/O thread did not answer") from None

    def hand_over(self, delivery: Delivery) -> Batch:
        """Called in the trainer's thread: a delivered batch, its current stream made to
        wait for the batch's device copy (``DeviceMover.hand_over``)."""
        return self.mover.hand_over(delivery)

    def dead_error(self) -> DataServerError:
        return self.handoff.dead_error()

    def wake(self) -> None:
        self._mailbox.wake()

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
            self._mailbox.close_pipe()
            self._poller.close()

    # ------------------------------------------------------------ the thread

    def run(self) -> None:
        # Every server costs descriptors (fds.py): the soft limit goes up to the hard one,
        # and ZeroMQ's socket cap with it.
        limit, _ = raise_fd_limit()
        ctx: zmq.Context[Any] = new_context(limit)
        links: Links | None = None
        discovery: Discovery | None = None
        try:
            book = self.parts.book
            steering = lambda: (book.plan_version, book.control_seq)  # noqa: E731
            budget = FdBudget.of_process(ServerLink.FDS)
            links = Links(
                ctx,
                self.config,
                self.curve,
                steering,
                self.parts.landing,
                budget,
                self._poller.touch,
            )
            sender = Sender(self.config, self.parts, links)
            hooks = LoopHooks(self.handshake, self._fail, self._watch, self._unwatch)
            handlers = Handlers(self.config, self.parts, links, sender, hooks)
            self.wiring = Wiring(links, sender, handlers)
            discovery = Discovery(self.config.addresses, self.config.discovery_interval, self.wake)
            discovery.start()
            self._loop(discovery)
        except zmq.ZMQError as exc:
            if not is_shutdown(exc):
                self._die(exc)
        except DataServerError as exc:  # (not enough descriptors for the servers: said why)
            self._fail(exc)
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
        for fut in self._mailbox.close():
            if not fut.done():
                fut.set_exception(self.dead_error())
        self._mailbox.close_pipe()
        self._poller.close()
        self.parts.buffers.close()
        if self.parts.landing is not None:
            self.parts.landing.close()
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
        self._poller.register(self._mailbox.fd, zmq.POLLIN)
        for link in self.links:
            self._watch(link)
        started = time.monotonic()
        next_tick = 0.0
        self.phase = Phase.HANDSHAKE
        more = False  # batches left to plan: poll without waiting
        while not self._halt.is_set():
            events = dict(self._poller.poll(0 if more else self._poll_ms(next_tick)))
            if self._mailbox.fd in events:
                self._mailbox.drain()
            self._mailbox.run()
            inject("client.loop")  # a test's stand-in for a bug no guard catches
            found = discovery.take()
            if found is not None:
                self.handlers.discovered(found)
            for sock in events:
                if sock in self._sockets:
                    self._on_socket(sock, *self._sockets[sock])
            self.handlers.reset_links()
            if self.phase is Phase.HANDSHAKE:
                self._check_handshake(started)
                continue
            more = self._turn()
            now = time.monotonic()
            self.size_asks.pump(self.links, now)
            if now >= next_tick:
                next_tick = now + TICK_S
                self.handlers.on_events(self.links.tick(now))
                self.handlers.trim(now)
                self.handlers.expire(now)
                self.handlers.welcomes_due(now)
                self.handlers.hedge(now)
                self.handlers.check_progress(now)

    def _poll_ms(self, next_tick: float) -> int:
        """How long the loop may wait for a message: ``POLL_MS``, or until the next tick
        while tasks are out (a quiet server is what hedging.py acts on: the tick that
        hedges its task must not wait for another server to speak first)."""
        if not self.links.owing():
            return POLL_MS
        return max(1, min(POLL_MS, math.ceil((next_tick - time.monotonic()) * 1000)))

    def _turn(self) -> bool:
        """What every pass of the loop does once running: deliver, plan (one batch beyond
        the next a pass, its tasks sent before the next is planned), send. True: more
        batches are due."""
        self.parts.book.retry_seals()
        more = self.parts.book.fill(deeper=1)
        if self.parts.ledger.cancels:
            self.sender.cancel()
        self.handlers.send_hedges()  # (queued by the tick: ahead of new tasks)
        self.sender.dispatch()
        return more

    def _on_socket(self, sock: zmq.Socket[Any], link: ServerLink, role: str) -> None:
        if role == "monitor":
            self.handlers.on_events(self.links.on_monitor(link))
        elif role == "results_monitor":
            self.handlers.on_events(self.links.on_results_monitor(link))
        else:
            site = "client.results" if role == "results" else "client.data"
            for msg in self.handlers.messages(link, sock, direct=role == "results"):
                self.guard.run(site, self._route, link, msg)

    def _route(self, link: ServerLink, msg: Message) -> None:
        match msg:
            case Result():
                inject("client.result")
                self.handlers.on_result(link, msg)
            case ErrorMsg():
                self.handlers.on_error(link, msg)
            case Cancelled():
                self.handlers.on_cancelled(link, msg)
            case Welcome():
                self.handlers.on_welcome(link, msg)
            case Heartbeat():
                if not link.paced(msg.heartbeat_ms):
                    self.parts.rejected.count(Reject.HEARTBEAT_INTERVAL)
                if msg.results is not None:
                    link.sync_results(msg.results, msg.local or ())
                link.store_says(msg.store_stall)
            case Bye():
                self.handlers.on_bye(link)
            case SampleSizes():
                self.handlers.on_sizes(link, msg, self.size_asks.current)
            case _:
                self.parts.rejected.count(Reject.UNEXPECTED_TYPE)

    def _check_handshake(self, started: float) -> None:
        if self.handshake.done():  # failed already (a WELCOME refused): the loop is halting
            return
        info = self.links.handshake()
        if info is not None:
            self.dataset_len = info.dataset_len
            self.dataset = info
            self.handshake.set_result(info)
            self.handlers.progressed()
            self.phase = Phase.RUNNING
            return
        overflows = [e for e in self.links.tick(time.monotonic()) if e.kind is EventKind.OVERFLOW]
        self.handlers.on_events(overflows)  # (a server's endless message instead of WELCOME)
        self.handlers.reset_links()
        if time.monotonic() - started > self.config.timeout:
            self._fail(
                ServerUnreachable(
                    f"no answer from {self.links.waiting_names()} within "
                    f"{self.config.timeout:g} s (is `dataserver serve` running there, and reachable?)"
                )
            )

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
        planned: tuple[ShardLike, int] | None = None,
    ) -> int:
        n = self.parts.book.start_epoch(epoch, self.dataset_len, position, step, deal, planned)
        self.handlers.progressed()
        return n

    def steer(self, mode: str, control: dict[str, Any] | None) -> int:
        """The trainer steers: a mode (``control`` None) or control values. Mode steers
        that come often arm the lookahead (lookahead.py); the same mode again changes
        nothing else."""
        if control is None:
            self.parts.book.mode_steered(changes=mode != self.parts.book.mode)
            if mode == self.parts.book.mode:
                return self.parts.book.plan_version
            if self.parts.book.flip(mode):
                self.sender.cancel()  # the old mode's deeper batches; the plan itself stands
                return self.parts.book.plan_version
        version = self.parts.book.steer(mode, control)
        self.sender.send_control(None)
        return version

    def mode(self) -> str:
        return self.parts.book.mode

    def size_schedule(self) -> SizeSchedule:
        """The size schedule from the next batch on."""
        return self.parts.book.sizes

    def max_image_side(self) -> int | None:
        """The least ``--max-image-side`` of the servers in use (met, neither draining nor
        banned), as their WELCOMEs announced it; None: none is."""
        sides = [
            link.welcome_msg.max_image_side
            for link in self.links.met()
            if link.welcome_msg is not None
            and link.state not in (LinkState.DRAINING, LinkState.BANNED)
        ]
        return min(sides) if sides else None

    def snapshot(self) -> Position:
        return self.parts.book.position()

    def resize(self, sizes: SizeSchedule) -> int:
        """The trainer sets the size schedule: from the next batch on (planned again)."""
        version = self.parts.book.steer(self.parts.book.mode, None, sizes)
        self.sender.send_control(None)  # the servers drop the tasks of the older plan
        return version

    def rebuild(self, plan: BatchPlan, control: dict[str, Any], on_error: str) -> Future[Delivery]:
        """Compose the batch a manifest names again; its Future gets the ``Delivery``."""
        future = self.parts.book.rebuild(plan, control, on_error)
        self.handlers.progressed()
        return future

    def sizes(self) -> Future[np.ndarray]:
        """The dataset's per-sample (h, w) (``announce.py``): a Future of the table, asked
        of the servers now unless it is already (one fetch a client; a failed or abandoned
        one is asked again)."""
        assert self.dataset is not None
        return self.size_asks.ask(self.dataset, self.links, time.monotonic())

    def abandon_sizes(self, why: str) -> None:
        """The trainer stopped waiting for the sizes: the fetch ends (a later ask starts
        another)."""
        self.size_asks.abandon(why)

    def abandon_rebuild(self, future: Future[Delivery]) -> None:
        self.parts.book.abandon_rebuild(future)

    def restore(
        self, mode: str, control: dict[str, Any], control_seq: int, sizes: SizeSchedule
    ) -> None:
        self.parts.book.restore(mode, control, control_seq, sizes)

    def stats(self) -> dict[str, Any]:
        lookahead = self.parts.book.lookahead_state()
        return {
            **self.parts.counters.snapshot(),
            "rejected": self.parts.rejected.snapshot(),
            "plan_version": self.parts.book.plan_version,
            "flips": self.parts.book.flips(),
            "lookahead": None if lookahead is None else dataclasses.asdict(lookahead),
            "skipped_poison_images": self.parts.ledger.skipped_poison,
            "task_deadline_s": round(self.handlers.deadlines.value, 3),
            "hedging": dataclasses.asdict(
                self.parts.hedging.figures(
                    self.links.ready(), {lk: lk.address for lk in self.links}
                )
            ),
            "host_buffers_allocated": self.parts.buffers.allocated,
            "servers": [dataclasses.asdict(link.stats()) for link in self.links],
            "fds": dataclasses.asdict(self.links.fds()),
        }
