"""The client's I/O thread: the loop that owns the sockets, the plan book and the links.

The trainer's thread talks to it only through ``call()`` (synchronous commands, answered
before the caller goes on, which is what makes feedback zero-stale) and the ``Handoff``
(finished batches, by step). ZeroMQ and the big copies release the GIL, so one thread
keeps up with many workers.

Collaborators, each owning its state: ``PlanBook`` (book.py: batches, tasks, steering; no
sockets), ``Links`` (links.py: one ``ServerLink`` per server, connection events,
heartbeats). This loop decodes messages, hands each to the book or the links, and decides
what link events do to tasks.

No message can stop this thread: a message that does not decode is counted and dropped,
and every handler runs under a ``MessageGuard`` (an exception costs that message, counted as
``rejected["internal"]`` in ``client.stats()``). A task whose answer never comes (a direct
result lost with its connection, a dropped message) is asked again after a deadline drawn
from the latencies seen, so nothing waits for ``timeout`` unless a server is really gone.
"""

from __future__ import annotations

import logging
import math
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
    Control,
    ErrorMsg,
    Heartbeat,
    Message,
    ProtocolError,
    Result,
    Task,
    Welcome,
    steer_tag,
)
from dataserver.protocol.messages import MAX_TAGS
from dataserver.security import session_id
from dataserver_client.assembly import DeviceMover, HostBuffers
from dataserver_client.book import Handoff, PlanBook, TaskRecord
from dataserver_client.config import ClientConfig
from dataserver_client.errors import DataServerError, NotAuthorized, ServerUnreachable
from dataserver_client.links import (
    Discovery,
    EventKind,
    LinkEvent,
    Links,
    LinkState,
    ServerLink,
    announced_address,
)
from dataserver_client.receive import WrongAnswer, boxes_problem, receive
from dataserver_client.resume import Deal

log = logging.getLogger("dataserver_client")

POLL_MS = 50
PIPELINE = 2  # tasks each worker holds at once (the server's own setting)
TICK_S = 0.02  # liveness timers, not per message: 20 ms is plenty
DRAIN = 256
MAX_CANCEL = 4096  # task ids per CONTROL


_MASK = (1 << 64) - 1
_SPAN = float(1 << 64) + 2.0


def _mix(x: int) -> int:
    """splitmix64's finaliser: a well-mixed 64-bit hash of ``x``."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


class Deadlines:
    """How long a task may stay unanswered before it is asked again: a multiple of the
    recent answer latencies (which include queueing), never below ``floor``; before enough
    were seen, ``initial``."""

    def __init__(self, floor: float, initial: float, factor: float = 8.0) -> None:
        self.floor = floor
        self.initial = initial
        self.factor = factor
        self._seen: deque[float] = deque(maxlen=256)
        self._value = initial

    def observe(self, latency: float) -> None:
        self._seen.append(latency)
        if len(self._seen) >= 16 and len(self._seen) % 16 == 0:
            ordered = sorted(self._seen)
            p90 = ordered[int(0.9 * (len(ordered) - 1))]
            self._value = max(self.floor, self.factor * p90)

    @property
    def value(self) -> float:
        return self._value


def _file_of(index: int, reason: str) -> str | None:
    """The file a worker's failure reason names: it writes "sample I (FILE): why" when the
    dataset named the sample's file (``SampleError``), "sample I: why" otherwise."""
    head = f"sample {index} ("
    if not reason.startswith(head) or "): " not in reason:
        return None
    return reason[len(head) : reason.index("): ")]


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
    """The I/O thread of one ``DataServerClient``."""

    def __init__(
        self, config: ClientConfig, handoff: Handoff, curve: dict[str, bytes] | None
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
        self.book.route = self._route
        self._ready_links: list[ServerLink] = []
        self.handshake: Future[dict[str, Any]] = Future()
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
        self._commands: deque[tuple[Callable[..., Any], tuple[Any, ...], Future[Any]]] = deque()
        self._lock = threading.Lock()  # guards _stopped, the command queue's closing, the pipe
        self._stopped = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._closing = False
        self._control_endpoints: set[str] = set()

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
        cause = self.handoff.fatal
        if isinstance(cause, DataServerError):
            return cause
        err = DataServerError(
            f"the client's I/O thread has stopped: {cause!r}" if cause else "the client is closed"
        )
        err.__cause__ = cause
        return err

    def wake(self) -> None:
        with self._lock:
            if self._wake_w < 0:
                return
            try:
                os.write(self._wake_w, b"\0")
            except BlockingIOError:
                pass  # the pipe is full, so the thread is awake anyway

    def close(self) -> None:
        """Stop the thread. Descriptors it polls are closed by the thread itself as it
        ends, never from here while it might still be polling them."""
        self._closing = True
        if self.is_alive():
            self.wake()
            self.join(timeout=5.0)
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
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        if self.curve:
            self.pub.curve_serverkey = self.curve["server_public"]
            self.pub.curve_publickey = self.curve["public"]
            self.pub.curve_secretkey = self.curve["secret"]
        self.links: Links | None = None
        self.discovery: Discovery | None = None
        try:
            self.links = Links(
                ctx,
                self.config,
                self.session,
                self.curve,
                lambda: (self.book.plan_version, self.book.control_seq),
                self.landing,
            )
            self.discovery = Discovery(
                self.config.addresses, self.config.discovery_interval, self.wake
            )
            self.discovery.start()
            self._loop(self.links)
        except zmq.ZMQError as exc:
            if not is_shutdown(exc):
                self._die(exc)
        except BaseException as exc:  # surface anything to the trainer instead of dying mute
            self._die(exc)
        finally:
            if self.discovery is not None:
                self.discovery.close()
            if self.links is not None:
                self.links.close()
            self.pub.close(linger=0)
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
            with self.handoff.cond:
                if self.handoff.fatal is None:
                    self.handoff.fatal = DataServerError("the client is closed")
                self.handoff.cond.notify_all()

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

    @staticmethod
    def _roles(link: ServerLink) -> list[tuple[zmq.Socket[Any], str]]:
        return [
            (link.sock, "front"),
            (link.results, "results"),
            (link.monitor, "monitor"),
            (link.results_monitor, "results_monitor"),
        ]

    def _watch(self, link: ServerLink) -> None:
        for sock, role in self._roles(link):
            self._poller.register(sock, zmq.POLLIN)
            self._sockets[sock] = (link, role)

    def _unwatch(self, link: ServerLink) -> None:
        for sock, _ in self._roles(link):
            self._poller.unregister(sock)
            self._sockets.pop(sock, None)

    def _loop(self, links: Links) -> None:
        poller = self._poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        sockets: dict[Any, tuple[ServerLink, str]] = {}
        self._sockets = sockets
        for link in links:
            self._watch(link)
        started = time.monotonic()
        next_tick = 0.0
        while not self._closing:
            events = dict(poller.poll(POLL_MS))
            if self._wake_r in events:
                try:
                    while os.read(self._wake_r, 4096):
                        pass
                except BlockingIOError:
                    pass
            self._run_commands()
            inject("client.loop")  # a test's stand-in for a bug no guard catches
            found = self.discovery.take() if self.discovery is not None else None
            if found is not None:
                self._discovered(links, found)
            for sock in events:
                if sock in sockets:
                    link, role = sockets[sock]
                    if role == "monitor":
                        self._on_events(links.on_monitor(link))
                    elif role == "results_monitor":
                        self._on_events(links.on_results_monitor(link))
                    else:
                        self._drain(link, sock, direct=role == "results")
            if not self.handshake.done():
                self._check_handshake(links, started)
                continue
            self.book.retry_seals()
            self.book.fill()
            if self.book.to_cancel:
                self._cancel()
            self._dispatch(links)
            now = time.monotonic()
            if now >= next_tick:
                next_tick = now + TICK_S
                self._on_events(links.tick(now))
                self._deadlines(links, now)
                self._check_progress(links, now)

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

    def _drain(self, link: ServerLink, sock: zmq.Socket[Any], direct: bool) -> None:
        site = "client.results" if direct else "client.data"
        for _ in range(DRAIN):
            try:
                msg = receive(sock, lambda result: self._destinations(link, result))
            except zmq.Again:
                return
            except WrongAnswer as exc:  # well-formed, for a task we want, and wrong
                link.last_heard = time.monotonic()
                self.rejected["wrong_answer"] += 1
                self._bad_server(link, str(exc))
                continue
            except ProtocolError as exc:
                link.last_heard = time.monotonic()
                self.rejected["malformed"] += 1
                # The first few are worth a warning; a flood is counted (client.stats()).
                level = logging.WARNING if self.rejected["malformed"] <= 5 else logging.DEBUG
                log.log(level, "dropped a bad message from %s: %s", link.address, exc)
                continue
            link.last_heard = time.monotonic()
            self.guard.run(site, self._on_message, link, msg, direct)

    def _destinations(self, link: ServerLink, result: Result) -> np.ndarray | None:
        """Where the images of ``result`` from ``link`` go: its task's slots of the batch
        buffer (a scratch array for a probe, or for slots that are not consecutive), if the
        task is still wanted and was sent to that server; None otherwise (the pixels are
        read off and dropped: a server reaches only the slots of tasks it was given)."""
        if result.session != link.session or link.state is LinkState.BANNED:
            return None
        rec = self.book.wanted(result.task_id, result.plan_version)
        if rec is None or rec.link is not link:
            return None
        n = len(rec.slots)
        if len(result.images) != n:
            raise WrongAnswer(f"{len(result.images)} images for task {rec.task_id} of {n}")
        batch = self.book.batch_of(rec)
        first = rec.slots[0]
        if rec.probe_of is not None or batch is None or rec.slots != tuple(range(first, first + n)):
            return np.empty((n, 3, *rec.out_hw), np.uint8)
        return batch.array[first : first + n]

    # ------------------------------------------------------------ messages

    def _on_message(self, link: ServerLink, msg: Message, direct: bool) -> None:
        if link.state is LinkState.BANNED:
            self.rejected["from_banned_server"] += 1
            return
        if direct and not isinstance(msg, Result):
            self.rejected["unexpected_type"] += 1  # workers send nothing else
            return
        if getattr(msg, "session", link.session) not in (link.session, None):
            self.rejected["other_session"] += 1
            return
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
        link.results_total += 1
        rec = self.book.wanted(msg.task_id, msg.plan_version)
        if rec is None:
            self.counters["late"] += 1  # superseded plan, or a second answer after asking again
            return
        # Nothing counts as progress before the answer is checked: a server answering
        # what it was not asked must not keep an epoch that goes nowhere alive.
        failed = {i for i, _ in msg.failed}
        wanted = [tuple(i for i in image if i not in failed) for image in rec.images]
        no_pixels = rec.land_gen is None if msg.landed else msg.pixels is None
        if no_pixels or list(msg.images) != wanted or not failed <= set(rec.indices):
            self.rejected["wrong_answer"] += 1
            shown = [list(i) for i in msg.images][:4]
            why = f"answered task {msg.task_id} with images {shown}, not those asked"
            self._refuse(link, rec, why)
            return
        if msg.landed and not self._sealed(rec):
            # "Landed" without the seal records it must write under its lock: the buffer
            # holds whatever was there before (a stale batch), which must never be delivered.
            self.rejected["landed_unsealed"] += 1
            self._refuse(link, rec, f"task {msg.task_id}: said it landed, wrote no seal")
            return
        assert msg.boxes is not None and msg.labels is not None  # (receive checked them)
        problem = boxes_problem(msg.boxes, msg.labels, rec.out_hw)
        if problem is not None:
            self.rejected["bad_boxes"] += 1
            self._refuse(link, rec, f"task {msg.task_id}: {problem}")
            return
        self.last_progress = time.monotonic()
        if failed and self.config.on_error == "raise":
            # A server leaving samples out of a task that said "raise" reports them failed:
            # the trainer gets the error a failed sample gives, never a silent skip.
            index, reason = msg.failed[0]
            error = DataServerError(
                f"{link.address}: {reason}" if reason else f"{link.address}: sample {index} failed",
                index,
                _file_of(index, reason),
            )
            self.book.on_failure(rec, "sample", error)
            return
        self.counters["results"] += 1
        batch = self.book.batch_of(rec)
        if msg.landed:
            self.counters["results_landed"] += 1
        elif (
            batch is not None
            and rec.probe_of is None
            and msg.pixels is not None
            and not np.shares_memory(msg.pixels, batch.array)
        ):
            for j, slot in enumerate(rec.slots):  # received apart: slots not consecutive
                batch.array[slot] = msg.pixels[j]
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
            self._ask_again([rec])

    def _on_error(self, link: ServerLink, msg: ErrorMsg) -> None:
        if msg.task_id is None:
            self._on_session_error(link, msg)
            return
        self._answered(link, msg.task_id)
        rec = self.book.wanted(msg.task_id, msg.plan_version)
        if rec is None or rec.link is not link:
            self.counters["late"] += 1  # (or about a task it was not given: not its to fail)
            return
        if msg.kind in ("maybe_lost", "dropped"):
            # A result that may never arrive (its worker died right after sending it), or
            # one the server would not hold for us: ask again (a late copy is dropped).
            if msg.kind == "dropped" or rec.link is link:
                self.counters[f"asked_again_{msg.kind}"] += 1
                self._ask_again([rec])
            return
        if msg.kind == "control_missing":  # it never had our control values: send them
            self._send_control(link)
            self._ask_again([rec])
            return
        if msg.kind == "unknown_session":  # the server restarted or forgot us: handshake again
            self._ask_again([rec])
            if link.state is LinkState.READY:
                link.state = LinkState.CONNECTING
                link.was_lost = True
                link.hello()
            return
        blamed = msg.index if msg.kind in ("sample", "poison") else None
        if blamed is not None and blamed not in rec.indices:  # a sample the task lacks
            self.rejected["wrong_answer"] += 1
            self._refuse(link, rec, f"blamed sample {blamed} for task {msg.task_id}")
            return
        self.last_progress = time.monotonic()
        error = DataServerError(
            msg.message if msg.kind in ("sample", "poison") else f"{link.address}: {msg.message}",
            msg.index,
            msg.file,
        )
        self.book.on_failure(rec, msg.kind, error, msg.image)

    def _on_session_error(self, link: ServerLink, msg: ErrorMsg) -> None:
        """An ERROR about this session and no task: the server forgot the session (say
        HELLO again), or refuses it (limits, a key that does not own it, a message it cannot
        read). A refusal is final for this client when no other server can go on without
        that one (waiting would not help, and the server's words say why); with others
        ready, that server alone is dropped, so one server cannot end a job by saying so."""
        if msg.kind == "unknown_session":
            if link.state is LinkState.READY:
                link.state = LinkState.CONNECTING
                link.was_lost = True
                link.hello()
            return
        if msg.kind == "not_authorized" or "not authorized" in msg.message:
            error: DataServerError = NotAuthorized(
                f"not authorized by {link.address}: {msg.message}"
            )
        else:
            error = DataServerError(f"{link.address}: {msg.message}")
        others = self.links is not None and any(
            lk is not link and lk.state is LinkState.READY for lk in self.links
        )
        if others and self.handshake.done():
            self._bad_server(link, f"it refused this session: {msg.message}")
        else:
            self._fail(error)

    def _on_cancelled(self, link: ServerLink, msg: Cancelled) -> None:
        for tid in msg.task_ids:
            if link.release(tid) is not None:
                self.counters["cancelled"] += 1
            rec = self.book.tasks.get(tid)
            if rec is not None and rec.link is link:
                self._ask_again([rec])  # cancelled though still wanted: send it again

    def _on_bye(self, link: ServerLink) -> None:
        """The server is draining (SIGTERM: a scale-down, a rolling update): send it nothing
        more. What it had queued for us comes back CANCELLED and goes to the others; what
        it runs, it finishes."""
        if self.links is None:
            return
        self.counters["servers_drained"] += link.state is not LinkState.DRAINING
        self.links.drain(link)
        self._count_workers()

    def _discovered(self, links: Links, addresses: list[str]) -> None:
        """DNS says the servers are now ``addresses``: greet the new ones (they get tasks once
        they answer), let go of those that left (their tasks move at once)."""
        known = {link.address: link for link in links}
        for address in addresses:
            if address not in known:
                log.info("%s joined (discovery)", address)
                self.counters["servers_joined"] += 1
                self._watch(links.add(address))
        for address, link in known.items():
            if address in addresses:
                continue
            log.info("%s left (discovery): moving its %d task(s)", address, len(link.outstanding))
            self.counters["servers_left"] += 1
            self._unwatch(link)
            links.remove(link)
            self._count_workers()
            self._move_tasks(link)
            if link.welcome_msg is not None:
                endpoint = announced_address(link.address, link.welcome_msg.control)
                if endpoint in self._control_endpoints:
                    self._control_endpoints.discard(endpoint)
                    try:
                        self.pub.disconnect(endpoint)
                    except zmq.ZMQError:
                        pass
        self._count_workers()
        self._check_lookahead()

    def _on_welcome(self, link: ServerLink, msg: Welcome) -> None:
        limit = self.config.max_dataset_len
        if msg.dataset_len > limit:
            # The epoch's order is built in memory from this number: a server must not
            # be able to make the trainer allocate gigabytes by a claim.
            why = f"it announces {msg.dataset_len} samples, more than max_dataset_len {limit}"
            self._bad_server(link, why)
            self._fail(
                DataServerError(
                    f"{link.address}: {why} (a dataset that large needs "
                    "DataServerClient(max_dataset_len=...))"
                )
            )
            return
        if self.handshake.done():
            info = self.handshake.result()
            if msg.fingerprint != info["fingerprint"] or msg.dataset_len != info["dataset_len"]:
                self._fail(
                    DataServerError(
                        f"{link.address} serves a different dataset ({msg.fingerprint}, "
                        f"{msg.dataset_len} samples) than the others ({info['fingerprint']})"
                    )
                )
                return
            if max(self.config.image_size) > msg.max_image_side:
                log.error(
                    "%s serves images of at most %d pixels a side (its --max-image-side); "
                    "this client asks for %s: not using it",
                    link.address,
                    msg.max_image_side,
                    self.config.image_size,
                )
                link.welcome_msg = msg
                if self.links is not None:
                    self.links.drain(link)
                return
        was_lost = link.was_lost
        restarted = link.welcome(msg)
        if self.book.control_seq or self.book.plan_version:
            self._send_control(link)  # a server met anew learns the session's values first
        self._count_workers()
        self._check_lookahead()
        endpoint = announced_address(link.address, msg.control)
        if endpoint not in self._control_endpoints:
            self._control_endpoints.add(endpoint)
            self.pub.connect(endpoint)
        if restarted or was_lost:
            # A restarted server lost what it held; after a lost connection, answers in
            # flight may be gone. Send again; an answer that comes twice is dropped by id.
            moved = self._move_tasks(link)
            log.warning("%s is back: asking again for its %d task(s)", link.address, moved)
        if self.links is not None:
            for other in self.links:  # servers still gone: their tasks come to those back
                if other.state is LinkState.LOST and other.outstanding:
                    self._move_tasks(other)

    # ------------------------------------------------------------ links and tasks

    def _on_events(self, events: list[LinkEvent]) -> None:
        for event in events:
            if event.kind is EventKind.NOT_AUTHORIZED:
                self._fail(NotAuthorized(event.why))
            elif event.kind is EventKind.LOST:
                self.counters["servers_lost"] += 1
                self._count_workers()
                if self.links is not None and self.links.any_ready():
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
        if self.links is None or link.state is LinkState.BANNED:
            return
        self.rejected["bad_server"] += 1
        self.links.ban(link, why)
        self._count_workers()
        self._check_lookahead()
        self._move_tasks(link)

    def _count_workers(self) -> None:
        """How many tasks the ready servers can work on at once (the book cuts batches
        into enough tasks to keep them all busy)."""
        if self.links is not None:
            ready = [lk for lk in self.links if lk.state is LinkState.READY]
            self.book.parallelism = max(1, sum(lk.workers for lk in ready)) * PIPELINE
            self._ready_links = ready if len(ready) > 1 else []
            live = set(self._ready_links)
            for rec in self.book.pending:  # a server gone: its waiting tasks go to anyone
                if rec.prefer is not None and rec.prefer not in live:
                    rec.prefer = None
            owner = self.book.owner
            if any(v not in live for v in owner.values()):
                self.book.owner = {k: v for k, v in owner.items() if v in live}

    def _route(self, key: int) -> ServerLink | None:
        """Weighted rendezvous hashing: the ready server an affinity key belongs to (None
        with one server), each server winning keys in proportion to its workers. A server
        joining or leaving moves only the keys it wins or held."""
        ready = self._ready_links
        if not ready:
            return None
        return max(ready, key=lambda lk: lk.workers / -math.log((_mix(lk.salt ^ key) + 1) / _SPAN))

    def arm_lookahead(self) -> None:
        self.book.armed = True

    def _check_lookahead(self) -> None:
        """Lookahead composes the next batch in both modes from the same sources: worth it
        only where every server keeps the sources it decoded (a store); without one, it
        would decode them twice. Off, flips replan (zero stale batches either way)."""
        if self.links is None or not self.config.lookahead:
            return
        stores = all(
            lk.welcome_msg.store_bytes > 0 for lk in self.links if lk.welcome_msg is not None
        )
        if self.book.lookahead and not stores:
            log.info("a server keeps no store of sources (--cache-gb 0): lookahead is off")
            self.book.set_lookahead(False)
        elif not self.book.lookahead and stores and self.config.stitch_k > 1:
            self.book.set_lookahead(True)

    def _move_tasks(self, link: ServerLink) -> int:
        recs = self.book.records(link.take_outstanding())
        n = self.book.ask_again(recs)
        self.counters["reissued"] += n
        return n

    def _ask_again(self, recs: list[TaskRecord]) -> None:
        self.book.ask_again(recs)

    def _deadlines(self, links: Links, now: float) -> None:
        """Tasks unanswered past the deadline are asked again (their credit is let go: the
        server either lost the answer, or will answer twice and the copy is dropped)."""
        limit = self.deadlines.value
        for link in links:
            if link.state is not LinkState.READY or not link.outstanding:
                continue
            oldest = next(iter(link.outstanding.values()))
            if now - oldest < limit:
                continue
            late = [t for t, sent in link.outstanding.items() if now - sent >= limit]
            for tid in late:
                del link.outstanding[tid]
            n = self.book.ask_again(self.book.records(late))
            if n:
                self.counters["asked_again_deadline"] += n
                log.info(
                    "%s: %d task(s) unanswered for %.1f s; asked again", link.address, n, limit
                )

    def _check_handshake(self, links: Links, started: float) -> None:
        try:
            info = links.handshake()
        except DataServerError as exc:
            self.handshake.set_exception(exc)
            self._closing = True
            return
        if info is not None:
            self.dataset_len = int(info["dataset_len"])
            self.handshake.set_result(info)
            self.last_progress = time.monotonic()
            return
        links.tick(time.monotonic())
        if time.monotonic() - started > self.config.timeout:
            self.handshake.set_exception(
                ServerUnreachable(
                    f"no answer from {links.waiting_names()} within {self.config.timeout:g} s "
                    "(is `dataserver serve` running there, and reachable?)"
                )
            )
            self._closing = True

    def _check_progress(self, links: Links, now: float) -> None:
        waiting = bool(self.book.pending) or any(link.outstanding for link in links)
        if not (waiting and self.book.tasks):
            self.last_progress = now
            return
        if now - self.last_progress <= self.config.timeout:
            return
        parts = []
        for link in links:
            mine = sum(1 for t in link.outstanding if t in self.book.tasks)
            why = f", {link.last_error}" if link.last_error else ""
            parts.append(
                f"{link.address} ({link.state.name.lower()}, {mine} task(s) outstanding{why})"
            )
        pending = len(self.book.pending)
        self._fail(
            DataServerError(
                f"no progress for {self.config.timeout:g} s; waiting for: "
                + ", ".join(parts)
                + (f"; {pending} task(s) not yet sent" if pending else "")
            )
        )
        self.last_progress = now

    def _fail(self, error: BaseException) -> None:
        if not self.handshake.done():
            self.handshake.set_exception(error)
        with self.handoff.cond:
            if self.handoff.fatal is None:
                self.handoff.fatal = error
            self.handoff.cond.notify_all()

    def _dispatch(self, links: Links) -> None:
        book = self.book
        skip: set[ServerLink] = set()  # links with nothing they should take now
        while book.pending:
            link = links.best(skip)
            if link is None:
                return
            rec = book.pop_pending(link)
            if rec is None:
                skip.add(link)
                continue
            task = Task(
                session=link.session,
                auth=link.secret,
                task_id=rec.task_id,
                plan_version=rec.plan_version,
                epoch=book.epoch,
                seed=self.config.seed,
                images=rec.images,
                grid=rec.grid,
                out_hw=rec.out_hw,
                fit_hw=self.config.image_size,
                on_error=self.config.on_error,
                control_seq=book.control_seq,
                exclude=rec.exclude,
            )
            generation = self._land(task, rec, link)
            if generation is not None:  # (else kept: an earlier send's landed answer may come)
                rec.land_gen = generation
            if not link.send(task.encode()):
                book.pending.appendleft(rec)  # not connected after all: try again shortly
                return
            link.outstanding.pop(rec.task_id, None)  # sent again: it goes last, as the newest
            link.outstanding[rec.task_id] = time.monotonic()
            link.sent_total += 1
            rec.link = link

    def _land(self, task: Task, rec: TaskRecord, link: ServerLink) -> int | None:
        """Name the landing place of ``task``'s images (a worker on this host writes them
        straight into the batch buffer): the server's workers took our buffer (so it is
        on this host), its batch's buffer is a landing region, and the task's slots are
        consecutive. Returns the generation named, or None."""
        batch = self.book.batch_of(rec)
        if self.landing is None or batch is None or rec.probe_of is not None:
            return None
        if not link.can_land:
            return None
        where = self.buffers.landing_of(batch.host)
        first = rec.slots[0]
        if where is None or rec.slots != tuple(range(first, first + len(rec.slots))):
            return None
        region, generation, offset = where
        task.land_token = self.landing.token
        task.land_region = region
        task.land_gen = generation
        task.land_offset = offset + first * 3 * rec.out_hw[0] * rec.out_hw[1]
        # Only a task's first send: a retry may follow a writer that died half-way.
        task.land_zero = int(rec.land_gen is None and self.landing.fresh(region))
        return generation

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
        if control is None and self.book.flip(mode):
            self._cancel()  # the old mode's deeper batches; the plan itself stands
            return self.book.plan_version
        version = self.book.steer(mode, control)
        self._send_control(None)
        return version

    def _cancel(self) -> None:
        """Ask servers to drop queued tasks the plan no longer wants (by id: the rest of
        the plan stands, so its version does not change)."""
        by_link: dict[ServerLink, list[int]] = {}
        for link, task_id in self.book.to_cancel:
            if task_id in link.outstanding:
                by_link.setdefault(link, []).append(task_id)
        self.book.to_cancel.clear()
        for link, ids in by_link.items():
            for start in range(0, len(ids), MAX_CANCEL):
                msg = self._control_msg(link)
                msg.cancel = tuple(ids[start : start + MAX_CANCEL])
                link.send(msg.encode())

    def _control_msg(self, link: ServerLink | None) -> Control:
        """The session's CONTROL: for ``link``'s data socket (with its secret), or, for
        ``None``, to publish (with a tag for each server met, none of the secrets)."""
        msg = Control(
            session=link.session if link is not None else self.session,
            auth=link.secret if link is not None else None,
            plan_version=self.book.plan_version,
            control_seq=self.book.control_seq,
            control=self.book.control,
            mode=self.book.mode,
        )
        if link is None:
            met = [lk for lk in self.links or () if lk.welcome_msg is not None]
            msg.tags = tuple(steer_tag(lk.secret, msg) for lk in met[:MAX_TAGS])
        return msg

    def _send_control(self, link: ServerLink | None) -> None:
        """The session's control values and plan to one server (``link``), or to every
        server: on its data socket (reliable, and ahead of any task that needs them) and
        published on the control socket."""
        if link is not None:
            link.send(self._control_msg(link).encode())
            return
        self.pub.send_multipart(self._control_msg(None).encode())
        for each in self.links or ():
            if each.state is LinkState.READY:
                each.send(self._control_msg(each).encode())

    def snapshot(self) -> dict[str, Any]:
        return self.book.snapshot()

    def _lookahead_state(self) -> dict[str, Any] | None:
        """The lookahead batch, if one is planned: its step, mode and whether it is done."""
        plan = self.book.alt_plan
        if plan is None:
            return None
        return {"step": plan.step, "mode": plan.mode, "ready": self.book.alt_ready is not None}

    def restore(self, mode: str, control: dict[str, Any], control_seq: int) -> None:
        self.book.restore(mode, control, control_seq)

    def stats(self) -> dict[str, Any]:
        links = list(self.links) if self.links is not None else []
        return {
            **self.counters,
            "rejected": dict(self.rejected),
            "plan_version": self.book.plan_version,
            "flips": dict(self.book.flips),
            "lookahead": self._lookahead_state(),
            "skipped_poison_images": self.book.skipped_poison,
            "task_deadline_s": round(self.deadlines.value, 3),
            "host_buffers_allocated": self.buffers.allocated,
            "servers": [
                {
                    "address": link.address,
                    "state": link.state.name.lower(),
                    "sent": link.sent_total,
                    "results": link.results_total,
                    "outstanding": len(link.outstanding),
                    "credit": link.credit,
                }
                for link in links
            ],
        }
