"""The front's client messages: HELLO, TASK, CONTROL, HEARTBEAT, STATS and BYE (all on the
data socket: a session's CONTROL comes on its data connection), each checked (the session's
secret, the CURVE key that owns the session id, sequence numbers, limits) before it changes
anything.

``Clients`` decides what a message does; the ``Scheduler`` (sessions and their queues) and
the ``Outlet`` (every send) apply it, through their methods. It gets them, the worker
router (where results go, which tasks run), the config and the counters as arguments, and
from the ``Front`` only what ``FrontSide`` groups: its id and callables (whether it is
draining, the WELCOME it sends, its STATS, ...); which connection a message came by, it asks
``Connections`` (the front's ``conns.ConnTracker``). It owns one thing: which CURVE key each
client connection came with (``_owners``).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
import zmq

from dataserver.counting import Counts
from dataserver.loop import inject
from dataserver.protocol import (
    Bye,
    Control,
    ErrorMsg,
    Heartbeat,
    Hello,
    Message,
    ProtocolError,
    SampleSizes,
    Stats,
    Task,
    Welcome,
    decode,
)
from dataserver.security import owns, same_secret
from dataserver.server.config import ServerConfig
from dataserver.server.counts import Count, Reject
from dataserver.server.front.announce import Announced
from dataserver.server.front.digests import control_state, task_digest
from dataserver.server.front.outlet import Outlet
from dataserver.server.front.routing import WorkerRouter
from dataserver.server.front.sessions import Scheduler, Session, TaskEntry
from dataserver.server.front.statsview import StatsView, peer_address

log = logging.getLogger("dataserver.front")

OWNERS_KEPT = 4096  # connections whose CURVE key is remembered


def _user_id(frame: Any) -> str:
    """The CURVE user id ZAP gave the connection ``frame`` came on ("" without one)."""
    try:
        return str(frame.get("User-Id") or "")
    except (zmq.ZMQError, AttributeError):
        return ""


@dataclass(frozen=True)
class FrontSide:
    """What ``Clients`` asks of the ``Front``, which owns the answers: its server id, the
    WELCOME it sends (``welcome(session, nonce, fd)``), its STATS, whether it is draining,
    how often clients are told to beat now (``beats``), what the object store does now
    (heartbeat replies), and ``fetch``: a task admitted, its sources (and its plan's next
    ones) fetched ahead of the workers (a dataset in object storage: the front's
    ``prefetch.Prefetcher``; None without one)."""

    server_id: str
    welcome: Callable[[bytes, bytes, int], Welcome]
    stats: Callable[[], dict[str, Any]]
    draining: Callable[[], bool]
    beat_ms: Callable[[], int] = lambda: 0
    store_stall: Callable[[], str] = lambda: ""
    fetch: Callable[[bytes, Task], None] | None = None


class Connections(Protocol):
    """The connection (fd) a message came by (``conns.ConnTracker``): ``read`` counts a
    message read on its connection and names it, ``heard`` ties it to the session the
    message proved itself for, ``peer_of`` says whose it is."""

    def read(self, frames: list[Any], skip: int) -> int: ...

    def heard(self, fd: int, session: bytes) -> None: ...

    def peer_of(self, fd: int, address: str) -> str: ...


class Untracked:
    """``Connections`` when nobody tracks them (tests): no connection, the peer's address."""

    def read(self, frames: list[Any], skip: int) -> int:
        return -1

    def heard(self, fd: int, session: bytes) -> None:
        pass

    def peer_of(self, fd: int, address: str) -> str:
        return address


class Clients:
    """What each client message does. ``on_data`` takes the frames of the data socket; it
    runs in the front's loop thread."""

    def __init__(
        self,
        config: ServerConfig,
        scheduler: Scheduler,
        outlet: Outlet,
        workers: WorkerRouter,
        statsview: StatsView,
        counters: Counts[Count],
        rejected: Counts[Reject],
        front: FrontSide,
        conns: Connections | None = None,
        announced: Announced | None = None,
    ) -> None:
        self.config = config
        self.scheduler = scheduler
        self.outlet = outlet
        self.workers = workers
        self.statsview = statsview
        self.counters = counters
        self.rejected = rejected
        self._front = front
        # The connection (fd) the message being handled came by (``conns.ConnTracker``).
        self._source_fd = -1
        self._conns: Connections = conns if conns is not None else Untracked()
        self._announced = announced if announced is not None else Announced(None)
        self._owners: OrderedDict[bytes, str] = OrderedDict()  # identity -> CURVE user id

    def _refuse(self, reason: Reject, identity: bytes | None, detail: str, **ids: Any) -> None:
        """Count a refused message; tell its sender why when there is one to tell."""
        self.rejected.count(reason)
        log.debug("rejected (%s): %s", reason.value, detail)
        if identity is not None:
            kind = "protocol" if reason is Reject.MALFORMED else reason.value
            self.outlet.send_to(
                identity,
                ErrorMsg(message=f"rejected: {reason.value}: {detail}", kind=kind, **ids),
            )

    def _owner(self, identity: bytes, frame: Any) -> str | None:
        """The CURVE user (z85 public key) of the connection ``identity``, remembered."""
        user = self._owners.get(identity)
        if user is None:
            user = _user_id(frame)
            self._owners[identity] = user
            if len(self._owners) > OWNERS_KEPT:
                self._owners.popitem(last=False)
        else:
            self._owners.move_to_end(identity)
        return user

    def _not_owner(self, identity: bytes, frame: Any, session: bytes | None) -> bool:
        """With CURVE, a session id may only be used by the key it is tagged with."""
        if self.config.curve is None or session is None:
            return False
        return not owns(session, self._owner(identity, frame))

    def _authentic(
        self,
        identity: bytes,
        msg: Task | Control | Heartbeat | Bye | SampleSizes,
        ids: dict[str, Any] | None = None,
        quiet: bool = False,
    ) -> Session | None:
        """The session ``msg`` acts for, if it carries that session's secret: then replies
        go to ``identity`` (where its owner is now). Otherwise None, counted, and the
        sender (never the session's owner) told why unless ``quiet``."""
        session = self.scheduler.sessions.get(msg.session) if msg.session is not None else None
        if session is None:
            reason, why = Reject.UNKNOWN_SESSION, "unknown session: say HELLO first"
        elif not same_secret(session.secret, msg.auth):
            reason, why = Reject.BAD_SECRET, "this message does not carry the session's secret"
        else:
            self.scheduler.touch(session, identity)
            self._conns.heard(self._source_fd, session.sid)
            return session
        if quiet:  # (a heartbeat or BYE for a session this server forgot is no attack)
            if reason is Reject.BAD_SECRET:
                self.rejected.count(reason)
        else:
            unknown = reason is Reject.UNKNOWN_SESSION
            more = ids if ids is not None and unknown else {}
            self._refuse(
                reason,
                identity,
                why + " (the server may have restarted)" if unknown else why,
                **more,
            )
        return None

    def on_data(self, frames: list[Any]) -> None:
        self._source_fd = self._conns.read(frames, 1)  # (a ROUTER's: its first frame is the id)
        identity = frames[0].bytes
        try:
            msg = decode(frames[1:])
        except ProtocolError as exc:
            self._refuse(Reject.MALFORMED, identity, str(exc))
            return
        session_id = getattr(msg, "session", None)
        if self._not_owner(identity, frames[1], session_id):
            self._refuse(
                Reject.NOT_OWNER,
                identity,
                "this session id belongs to another key",
                session=session_id,
            )
            return
        self._on_client_message(identity, msg, frames)

    def _peer(self, frame: Any) -> str:
        """Who a cap charges for this message: its CURVE key where CURVE is on, else the
        uid at the other end of a connection from this host (loopback or the host's own
        addresses: local users share them), else the remote address."""
        try:
            user = str(frame.get("User-Id") or "")
        except zmq.ZMQError:
            user = ""
        if user:
            return f"key:{user}"
        return self._conns.peer_of(self._source_fd, peer_address(frame))

    def _on_client_message(self, identity: bytes, msg: Message, frames: list[Any]) -> None:
        """A decoded message from a client connection ``identity``, to its handler."""
        match msg:
            case Task():
                inject("front.task")
                self._on_task(identity, msg, frames[1:])
            case Hello():
                self._on_hello(identity, msg, self._peer(frames[1]))
            case Control():
                session = self._authentic(identity, msg)
                if session is not None:
                    self._steer(session, msg)
            case Heartbeat():
                self._on_heartbeat(identity, msg)
            case Stats():
                if self.statsview.allow(frames[1]):  # (counted when over the rate)
                    self.outlet.send_to(identity, Stats(stats=self._front.stats()))
            case Bye():
                self._on_bye(identity, msg)
            case SampleSizes():
                self._on_sizes(identity, msg)
            case _:
                self._refuse(
                    Reject.UNEXPECTED_TYPE, identity, f"{msg.TYPE.name} is not sent to a server"
                )

    def _on_heartbeat(self, identity: bytes, msg: Heartbeat) -> None:
        """A beat: the session (if it names one) is alive; the answer lists where the
        workers' direct results are now, and how often to beat."""
        self.counters.count(Count.HEARTBEATS)
        if msg.session is not None:
            self._authentic(identity, msg, quiet=True)
        results, local = self.workers.result_endpoints()
        beat = Heartbeat(
            server_id=self._front.server_id,
            results=results,
            local=local,
            heartbeat_ms=self._front.beat_ms(),
            store_stall=self._front.store_stall()[:512],
        )
        self.outlet.send_to(identity, beat)

    def _on_sizes(self, identity: bytes, msg: SampleSizes) -> None:
        """A session asks for a chunk of the per-sample sizes (``announce.py``): answered
        within its rate and the outbox's bounds (else dropped, counted: it asks again);
        sizes this server does not have are refused, answered."""
        if msg.hw is not None:
            self._refuse(Reject.UNEXPECTED_TYPE, identity, "a SIZES reply is not sent to a server")
            return
        session = self._authentic(identity, msg)
        if session is None:
            return
        problem = self._announced.problem(msg.start, msg.count)
        if problem is not None:
            self._refuse(Reject.SIZES_RANGE, identity, problem, session=session.sid)
            return
        if not self._announced.allow(session.sid):
            self.rejected.count(Reject.SIZES_RATE)
            return
        refused = self.outlet.send_charged(
            session, self._announced.chunk(session.sid, msg.start, msg.count)
        )
        if refused is None:
            self.counters.count(Count.SIZE_CHUNKS)
        else:
            self.rejected.count(Reject.SIZES_RATE)
            log.debug("SIZES not answered: %s", refused)

    def _on_bye(self, identity: bytes, msg: Bye) -> None:
        if msg.session is not None and self._authentic(identity, msg, quiet=True):
            self.scheduler.close(msg.session)
            self.counters.count(Count.SESSIONS_CLOSED)

    def _on_hello(self, identity: bytes, msg: Hello, peer: str = "") -> None:
        if self._front.draining():  # leaving: a new client should not count on us
            self.outlet.send_to(identity, Bye(session=msg.session))
            return
        if msg.auth is None:
            self._refuse(
                Reject.NO_SECRET,
                identity,
                "HELLO carries no session secret (auth)",
                session=msg.session,
            )
            return
        known = self.scheduler.sessions.get(msg.session)
        if known is not None and not same_secret(known.secret, msg.auth):
            # Someone else's session id: whoever holds it keeps it, and the sender learns
            # nothing but that.
            self._refuse(
                Reject.NOT_OWNER,
                identity,
                "this session id is in use by another client",
                session=msg.session,
            )
            return
        base = max(msg.plan_version, msg.control_seq)
        if self.scheduler.open(msg.session, identity, msg.auth, base, peer) is None:
            reason, why = self.scheduler.refused
            if reason is Reject.SESSION_LIMIT:
                why = (
                    f"this server has {len(self.scheduler.sessions)} sessions open, the most "
                    f"it takes ({self.scheduler.limit_why or self.scheduler.max_sessions}), "
                    f"and {why or 'none could go'}"
                )
            self._refuse(reason, identity, why, session=msg.session)
            return
        self.counters.count(Count.HELLOS)
        self._conns.heard(self._source_fd, msg.session)
        self.outlet.send_to(identity, self._front.welcome(msg.session, msg.nonce, self._source_fd))

    def _size_problem(self, task: Task) -> str | None:
        """What a worker would allocate for ``task`` beyond this server's caps, or None:
        every size it allocates for (the output, the fitted and the stored source) within
        ``--max-image-side``, and the output (images x 3 x H x W) within ``--max-task-mb``
        (a few bytes of TASK asked for 64 images of 4096^2: a 3 GiB canvas in a worker)."""
        side = self.config.max_image_side
        sizes = task.sizes
        for name, hw in (("image", sizes.out), ("fit", sizes.fit), ("stored", sizes.stored)):
            if max(hw) > side:
                return f"{name} size {hw[0]}x{hw[1]} exceeds this server's --max-image-side {side}"
        out_bytes = task.canvas_bytes()
        if out_bytes > self.config.max_task_bytes:
            return (
                f"a task of {len(task.images)} images of {sizes.out[0]}x{sizes.out[1]} "
                f"takes {out_bytes >> 20} MiB, more than this server's --max-task-mb "
                f"{self.config.max_task_mb}"
            )
        return None

    def _on_task(self, identity: bytes, task: Task, frames: list[Any]) -> None:
        ids = {"session": task.session, "task_id": task.task_id, "plan_version": task.plan_version}
        session = self._authentic(identity, task, ids)
        if session is None:
            return
        if not (session.reachable(task.plan_version) and session.reachable(task.control_seq)):
            self._refuse(
                Reject.SEQUENCE,
                identity,
                f"plan_version {task.plan_version} / control_seq {task.control_seq}: more than "
                "this session can have reached",
                **ids,
            )
            return
        digest = task_digest(task)
        known = self.scheduler.poison_of(task.session, digest)
        if known is not None:  # a copy of a task answered poison: the same answer, not run
            self.counters.count(Count.TASKS_POISONED_AGAIN)
            again = msgspec.structs.replace(
                known, task_id=task.task_id, plan_version=task.plan_version
            )
            self.outlet.reply(session, again)
            return
        if self._asked_again(session, task, digest):
            return
        problem = self._size_problem(task)
        if problem is not None:
            self._refuse(Reject.LIMIT, identity, problem, **ids)
            return
        self.outlet.cancel(session, self.scheduler.cancel_older(session, task.plan_version))
        if task.plan_version < session.version or self._front.draining():
            self.outlet.cancel(
                session, [TaskEntry(session.sid, task.task_id, task.plan_version, (), [])]
            )
            return
        nbytes = sum(len(memoryview(f)) for f in frames)
        over = self.scheduler.over_limit(session, nbytes)
        if over is not None:
            reason, why = over
            if reason is Reject.QUEUE_BYTES:
                why += f" (--max-queued-mb {self.config.max_queued_mb})"
            self._refuse(reason, identity, why, **ids)
            return
        if task.control_seq > session.control_seq:
            # The CONTROL that names these values never came (this server restarted, or
            # forgot the session): the client sends it again, then the task.
            self._refuse(
                Reject.CONTROL_MISSING,
                identity,
                f"control values {task.control_seq} unknown",
                **ids,
            )
            return
        entry = TaskEntry(
            session.sid,
            task.task_id,
            task.plan_version,
            task.images,
            frames,
            nbytes,
            control_seq=task.control_seq,
            digest=digest,
            # The control state its worker's dataset must be in (a copy of the dataset
            # for each new one: the scheduler paces how often a session changes it).
            state=control_state(task, session),
        )
        self._admit(session, task, entry)

    def _admit(self, session: Session, task: Task, entry: TaskEntry) -> None:
        """Queue a checked task (and have its bytes fetched ahead, where the front does)."""
        self.scheduler.admit(session, entry, first=bool(task.priority))
        self.counters.count(Count.TASKS_RECEIVED)
        if self._front.fetch is not None:
            self._front.fetch(session.sid, task)

    def _asked_again(self, session: Session, task: Task, digest: bytes) -> bool:
        """Whether ``task`` is one still queued or running here, asked again (its deadline
        passed): then the answer the first one makes is the answer. A task a worker holds
        but does not run may be one whose answer was lost: that one is run again."""
        live = self.scheduler.live.get((task.session, task.task_id))
        if live is not None and live.digest != digest:
            # The session's owner (the secret was checked) changed a task it asked for: a
            # source left out after it killed workers. The new one replaces a queued copy;
            # a running one finishes, and the client takes whichever answer it still wants.
            # (A task is never taken for a duplicate of one with other contents.)
            self.counters.count(Count.TASKS_REPLACED)
            if live.held_by is None:
                self.scheduler.take(session, lambda e: e is live)
            self.scheduler.finish(live)
            return False
        if live is not None and (live.held_by is None or self.workers.is_running(live)):
            self.counters.count(Count.TASKS_DUPLICATE)
            return True
        return False

    def _steer(self, session: Session, msg: Control) -> None:
        """A session's CONTROL (a copy of one already taken is a no-op): new control
        values, older plans' queued tasks cancelled, and the tasks it lists cancelled if
        still queued."""
        if msg.plan_version < session.version or msg.control_seq < session.control_seq:
            # Overtaken (a newer plan's TASK or CONTROL came first, e.g. on a connection
            # the client opened since; a task that needs its values is answered
            # control_missing and the client sends them again) or replayed:
            # nothing to do, and nothing wrong with the client, so not a rejection.
            self.counters.count(Count.CONTROLS_OVERTAKEN)
            return
        if not (session.reachable(msg.plan_version) and session.reachable(msg.control_seq)):
            self.rejected.count(Reject.SEQUENCE)  # would cancel everything the session sends after
            return
        self.counters.count(Count.CONTROLS)
        self.scheduler.steer(session, msg.control_seq, msg.control)
        seq = session.control_seq
        gone = self.scheduler.cancel_older(session, msg.plan_version)
        wanted = set(msg.cancel)
        gone += self.scheduler.take(session, lambda e: e.task_id in wanted or e.control_seq < seq)
        self.outlet.cancel(session, gone)
