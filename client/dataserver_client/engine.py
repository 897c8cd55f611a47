"""The client's I/O thread: plans batches, sends tasks, assembles results.

It owns every socket (one DEALER per server, one PUB for control) and all epoch state;
the trainer's thread talks to it only through ``call()`` (synchronous commands, answered
before the caller goes on, which is what makes feedback zero-stale) and the ``Handoff``
(finished batches, by step). ZeroMQ and the big copies release the GIL, so one thread
keeps up with many workers.

Task accounting: every task is outstanding on exactly one server link until that server
answers it (RESULT, ERROR or CANCELLED), so credits are exact. A task whose plan is
superseded stays outstanding (its answer is dropped on arrival) until answered.

This module has the loop and the messages; ``plans.py`` the epoch plan and the commands
that move it, ``watch.py`` the servers' liveness (both are mixins of ``Engine``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import zmq

from dataserver import protocol
from dataserver.protocol import Message, MsgType, ProtocolError
from dataserver_client.assembly import Delivery, DeviceMover, HostBuffers, InflightBatch
from dataserver_client.config import ClientConfig
from dataserver_client.errors import DataServerError, NotAuthorized
from dataserver_client.link import LinkState, ServerLink, control_address
from dataserver_client.planner import REGULAR, Planner
from dataserver_client.plans import EpochPlans, TaskRecord
from dataserver_client.watch import LinkWatch

log = logging.getLogger("dataserver_client")


class Handoff:
    """Finished batches waiting for the trainer, by step, and the epoch's end when known.

    Shared by both threads under ``cond``. Only batches of the current plan are ever in
    ``ready``: a steer clears it before the trainer can look again.
    """

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.ready: dict[int, Delivery | DataServerError] = {}
        self.taken = 0  # steps handed to the trainer in this epoch
        self.end_step: int | None = None
        self.fatal: BaseException | None = None


class Engine(EpochPlans, LinkWatch, threading.Thread):
    """The I/O thread of one ``DataServerClient``."""

    def __init__(
        self, config: ClientConfig, handoff: Handoff, curve: dict[str, bytes] | None
    ) -> None:
        super().__init__(name="dataserver-client-io", daemon=True)
        self.config = config
        self.handoff = handoff
        self.curve = curve
        self.session = uuid.uuid4().bytes
        self.layout = config.layout()
        self.mover = DeviceMover(config.device)
        self.buffers = HostBuffers(config.device, keep=config.prefetch + 2)
        self.handshake: Future[dict[str, Any]] = Future()
        self._commands: deque[tuple[Callable[..., Any], tuple[Any, ...], Future[Any]]] = deque()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._closing = False
        # epoch and steering state (I/O thread only)
        self.epoch = 0
        self.mode = REGULAR
        self.plan_version = 0
        self.control: dict[str, Any] = {}
        self.control_seq = 0
        self.planner: Planner | None = None
        self.inflight: dict[int, InflightBatch] = {}
        self.plan_starts: dict[int, int] = {}
        self.tasks: dict[int, TaskRecord] = {}
        self.pending: deque[TaskRecord] = deque()
        self.next_task_id = 1
        self.last_progress = time.monotonic()
        self.links: list[ServerLink] = []
        self._control_endpoints: set[str] = set()
        self.counters = {"late": 0, "cancelled": 0, "results": 0, "reissued": 0}

    # ------------------------------------------------------------ any thread

    def call(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> Any:
        """Run ``fn(*args)`` in the I/O thread and return its result (or raise its error)."""
        fut: Future[Any] = Future()
        self._commands.append((fn, args, fut))
        self.wake()
        return fut.result(timeout if timeout is not None else self.config.timeout + 10.0)

    def wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:
            pass  # the pipe is full, so the thread is awake anyway

    def close(self) -> None:
        if self.is_alive():
            self._closing = True
            self.wake()
            self.join(timeout=5.0)
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    # ------------------------------------------------------------ the thread

    def run(self) -> None:
        ctx: zmq.Context[Any] = zmq.Context(io_threads=1)
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        if self.curve:
            self.pub.curve_serverkey = self.curve["server_public"]
            self.pub.curve_publickey = self.curve["public"]
            self.pub.curve_secretkey = self.curve["secret"]
        try:
            self.links = [
                ServerLink(ctx, a, self.session, self.curve) for a in self.config.addresses
            ]
            for link in self.links:
                link.hello()
            self._loop()
        except BaseException as exc:  # surface anything to the trainer instead of dying mute
            log.exception("I/O thread failed")
            self._fail(
                exc
                if isinstance(exc, DataServerError)
                else DataServerError(f"I/O thread failed: {exc!r}")
            )
        finally:
            for link in self.links:
                link.close()
            self.pub.close(linger=0)
            ctx.term()
            while self._commands:
                _, _, fut = self._commands.popleft()
                if not fut.done():
                    fut.set_exception(DataServerError("client is closed"))

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        for link in self.links:
            poller.register(link.sock, zmq.POLLIN)
            poller.register(link.monitor, zmq.POLLIN)
            poller.register(link.results, zmq.POLLIN)
        by_sock = {link.sock: link for link in self.links}
        by_results = {link.results: link for link in self.links}
        by_monitor = {link.monitor: link for link in self.links}
        started = time.monotonic()
        next_liveness = 0.0
        while not self._closing:
            events = dict(poller.poll(50))
            if self._wake_r in events:
                try:
                    while os.read(self._wake_r, 4096):
                        pass
                except BlockingIOError:
                    pass
            while self._commands:
                fn, args, fut = self._commands.popleft()
                try:
                    fut.set_result(fn(*args))
                except BaseException as exc:
                    fut.set_exception(exc)
            for sock, link in by_monitor.items():
                if sock in events:
                    self._on_link_events(link)
            for sock, link in by_sock.items():
                if sock in events:
                    self._drain(link, link.sock)
            for sock, link in by_results.items():
                if sock in events:
                    self._drain(link, link.results)
            if not self.handshake.done():
                self._check_handshake(started)
                continue
            self._fill()
            self._dispatch()
            now = time.monotonic()
            if now >= next_liveness:  # timers, not per message: 20 ms is plenty
                next_liveness = now + 0.02
                self._liveness()

    def _drain(self, link: ServerLink, sock: zmq.Socket[Any]) -> None:
        direct = sock is link.results
        for _ in range(256):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            link.last_heard = time.monotonic()
            try:
                msg = protocol.decode(frames)
            except ProtocolError as exc:
                log.warning("dropped a bad message from %s: %s", link.address, exc)
                continue
            if direct and msg.type is not MsgType.RESULT:
                continue  # workers send nothing else
            self._on_message(link, msg)

    # ------------------------------------------------------------ messages

    def _on_message(self, link: ServerLink, msg: Message) -> None:
        h = msg.header
        match msg.type:
            case MsgType.WELCOME:
                self._on_welcome(link, h)
            case MsgType.RESULT:
                self._on_result(link, msg)
            case MsgType.ERROR:
                self._on_error(link, h)
            case MsgType.CANCELLED:
                for tid in h["task_ids"]:
                    if link.release(tid):
                        self.counters["cancelled"] += 1
                    rec = self.tasks.get(tid)
                    if rec is not None and rec.link is link:
                        rec.link = None  # cancelled though still wanted: send it again
                        self.pending.appendleft(rec)
            case MsgType.HEARTBEAT:
                link.sync_results(h.get("results"))
            case _:
                log.debug("ignored %s from %s", msg.type.name, link.address)

    def _on_welcome(self, link: ServerLink, h: dict[str, Any]) -> None:
        if h["session"] != self.session:
            return
        if self.handshake.done():
            first = self.links[0].info
            if h["fingerprint"] != first.get("fingerprint"):
                self._fail(
                    DataServerError(
                        f"{link.address} now serves a different dataset ({h['fingerprint']})"
                    )
                )
                return
        was_lost = link.was_lost
        restarted = link.welcome(h)
        link.was_lost = False
        link.sync_results(h.get("results"))
        endpoint = control_address(link.address, h["control"])
        if endpoint not in self._control_endpoints:
            self._control_endpoints.add(endpoint)
            self.pub.connect(endpoint)
        if restarted or was_lost:
            # A restarted server lost what it held; after a lost connection, answers in
            # flight may be gone. Send again; an answer that comes twice is dropped by id.
            log.warning("%s is back: re-sending its %d tasks", link.address, len(link.outstanding))
            self._reissue(link)

    def _on_result(self, link: ServerLink, msg: Message) -> None:
        h = msg.header
        tid = h["task_id"]
        link.release(tid)
        link.results_total += 1
        rec = self.tasks.get(tid)
        if rec is None or h["plan_version"] != rec.plan_version:
            self.counters["late"] += 1  # superseded plan, or a duplicate after a re-issue
            return
        del self.tasks[tid]
        self.last_progress = time.monotonic()
        if rec.probe_of is not None:
            self._probe_done(rec, bad=False)
            return
        batch = self.inflight.get(rec.step)
        if batch is None:
            return
        image, boxes, labels = msg.arrays
        failed = [int(f[0]) for f in h["failed"]]
        try:
            batch.fill(rec.slot, image, boxes, labels, [int(i) for i in h["indices"]], failed)
        except DataServerError as exc:
            self._fail_batch(batch, DataServerError(f"{link.address}: {exc}"))
            return
        self.counters["results"] += 1
        self._maybe_finish(batch)

    def _on_error(self, link: ServerLink, h: dict[str, Any]) -> None:
        kind = h.get("kind", "")
        tid = h.get("task_id")
        message = h["message"]
        if not isinstance(tid, int):
            if "not authorized" in message:
                self._fail(NotAuthorized(f"not authorized by {link.address}: {message}"))
            else:
                log.warning("%s: %s", link.address, message)
            return
        link.release(tid)
        rec = self.tasks.get(tid)
        if rec is None or h.get("plan_version") != rec.plan_version:
            self.counters["late"] += 1
            return
        if kind == "maybe_lost":  # its worker died right after sending it straight to us
            if rec.link is link:  # still waiting for it: run it again (a late copy is dropped)
                rec.link = None
                self.pending.appendleft(rec)
            return
        if kind == "unknown_session":  # the server restarted or forgot us: handshake again
            rec.link = None
            self.pending.appendleft(rec)
            if link.state is LinkState.READY:
                link.state = LinkState.CONNECTING
                link.was_lost = True
                link.hello()
            return
        self.last_progress = time.monotonic()
        skip = self.config.on_error == "skip"
        if skip and kind == "poison" and rec.probe_of is None and len(rec.task.indices) > 1:
            self._probe(rec)  # still wanted: composed again once the probes say how
            return
        del self.tasks[tid]
        if rec.probe_of is not None:
            self._probe_done(rec, bad=kind in ("sample", "poison"))
            return
        batch = self.inflight.get(rec.step)
        if batch is None:
            return
        if skip and kind in ("sample", "poison"):
            batch.drop(rec.slot, list(rec.task.indices))
            self._maybe_finish(batch)
            return
        index = h.get("index")
        file = h.get("file")
        self._fail_batch(
            batch,
            DataServerError(
                message,
                index if isinstance(index, int) else None,
                file if isinstance(file, str) else None,
            ),
        )

    # ------------------------------------------------------------ batches

    def _fail(self, error: BaseException) -> None:
        if not self.handshake.done():
            self.handshake.set_exception(error)
        with self.handoff.cond:
            if self.handoff.fatal is None:
                self.handoff.fatal = error
            self.handoff.cond.notify_all()

    def _dispatch(self) -> None:
        while self.pending:
            link = max(self.links, key=lambda lk: lk.free)
            if link.free <= 0:
                return
            rec = self.pending.popleft()
            if self.tasks.get(rec.task_id) is not rec:
                continue
            header = {
                "session": self.session,
                "task_id": rec.task_id,
                "plan_version": rec.plan_version,
                "epoch": self.epoch,
                "seed": self.config.seed,
                "indices": list(rec.task.indices),
                "grid": rec.task.grid,
                "out_hw": list(rec.task.out_hw),
                "on_error": self.config.on_error,
                "control_seq": self.control_seq,
                "control": self.control,
            }
            if rec.exclude:
                header["exclude"] = list(rec.exclude)
            if not link.send(protocol.make(MsgType.TASK, header)):
                self.pending.appendleft(rec)  # not connected after all: try again shortly
                return
            link.outstanding[rec.task_id] = time.monotonic()
            link.sent_total += 1
            rec.link = link

    # ------------------------------------------------------------ commands (I/O thread)

    def stats(self) -> dict[str, Any]:
        return {
            **self.counters,
            "plan_version": self.plan_version,
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
                for link in self.links
            ],
        }
