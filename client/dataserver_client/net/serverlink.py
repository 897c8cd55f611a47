"""The client's side of one server (``ServerLink``): its sockets (a DEALER to its front, one
to its workers for results sent straight to us), its state, credit and outstanding tasks,
its heartbeat pace, and the hand-over of our landing buffer to its workers once it proved it
is on our host. ``LinkCommons``: what every link shares (the index, the descriptor budget,
who hears of sends). ``LinkEvent``: what happened to a link, for the engine to act on.

Link states (each arrow one ``ServerLink`` method; nothing else writes ``state``)::

    CONNECTING -(welcome)-> READY -(lose: disconnected, or silent past the timeout)-> LOST
    LOST -(welcome again)-> READY
    READY -(forget_session: the server says it does not know the session)-> CONNECTING
    CONNECTING, READY -(drain: BYE from the server; decline: it cannot serve us)-> DRAINING
    DRAINING -(lose: disconnected)-> LOST
    any -(ban: it answered what it was not asked, or lied about a result)-> BANNED (for good)

Created, used and closed only in the I/O thread, by ``Links``.

Past 500 lines: the module is one class, ``ServerLink`` (about 450 lines), whose methods are
its state machine's transitions and its tasks' bookkeeping; split, one object's state would
be written from several files.
"""

from __future__ import annotations

import enum
import hashlib
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq

from dataserver.landing import Handover, LandingArea, landing_socket
from dataserver.protocol import Bye, Heartbeat, Hello, Welcome
from dataserver.security import new_secret, proof_ends, reply_id
from dataserver_client.net.beats import PacedBeat
from dataserver_client.net.fds import CONNECTIONS_PER_SERVER, FdBudget
from dataserver_client.net.handshakes import WelcomeMemo
from dataserver_client.net.inflow import ANSWER_SLACK, INFLOW_SLACK, Inflow
from dataserver_client.net.linkindex import LinkIndex
from dataserver_client.net.samehost import announced_address, same_host
from dataserver_client.net.sockets import MONITORED, dealer

log = logging.getLogger("dataserver_client")

MAX_WORKER_ENDPOINTS = 1024


class LinkState(enum.IntEnum):
    CONNECTING = 1
    READY = 2
    LOST = 3
    DRAINING = 4  # the server said BYE: it is leaving; it finishes what it runs, takes nothing
    BANNED = 5  # it broke the protocol in a way only a faulty or hostile server does: ignored


class EventKind(enum.Enum):
    LOST = "lost"  # the server went away (its tasks should move)
    RESULTS_BROKEN = "results_broken"  # a direct-result connection dropped (results in it are gone)
    NOT_AUTHORIZED = "not_authorized"  # CURVE refused this client's key
    OVERFLOW = "overflow"  # a connection holds more of an unfinished message than allowed


@dataclass(frozen=True)
class LinkStats:
    """One server as ``client.stats()`` shows it."""

    address: str
    state: str
    sent: int
    results: int
    outstanding: int
    credit: int
    heartbeat_s: float = 0.5  # the interval it beats at (its server's, within bounds)


@dataclass(frozen=True)
class LinkEvent:
    kind: EventKind
    link: ServerLink
    why: str = ""


def no_touch(sock: zmq.Socket[Any]) -> None:
    """``LinkCommons.touched`` when no one watches the sockets: nobody to tell."""


@dataclass
class LinkCommons:
    """What a client's links share: the index each keeps current (``LinkIndex``: links by
    free credit, tasks by send time), the descriptor budget their direct result
    connections come out of (``FdBudget``), and ``touched(socket)``, told of each send (the
    engine's ``Watch`` asks that socket again whether it is readable)."""

    index: LinkIndex = field(default_factory=LinkIndex)
    budget: FdBudget = field(default_factory=FdBudget.unlimited)
    touched: Callable[[zmq.Socket[Any]], None] = no_touch


class ServerLink:
    """The client's side of one server: a DEALER to its front, and a DEALER connected to
    every one of its workers for results sent straight to us."""

    # ZeroMQ sockets a link holds, each a descriptor (its mailbox): the two DEALERs and a
    # monitor each (a PAIR on either side); its connections come on top (``fds.py``).
    SOCKETS = 6
    FDS = SOCKETS + CONNECTIONS_PER_SERVER

    def __init__(
        self,
        ctx: zmq.Context[Any],
        address: str,
        session: bytes,
        curve: dict[str, bytes] | None,
        steering: Callable[[], tuple[int, int]] = lambda: (0, 0),
        landing: LandingArea | None = None,
        commons: LinkCommons | None = None,
        beat_s: float = 0.5,
    ) -> None:
        self.address = address
        # What it shares with the other links (``LinkCommons``): the index it keeps current,
        # the descriptor budget its direct connections come out of, who hears of its sends.
        self._commons = commons if commons is not None else LinkCommons()
        self._index = self._commons.index
        self._state = LinkState.CONNECTING
        self._connected = False
        self._credit = 0
        # How often it beats, and how long it may hear nothing (``beats.PacedBeat``: the
        # server's word, within bounds).
        self.pace = PacedBeat(beat_s)
        # This session's secret on this server (each server gets its own, so no server
        # learns one that acts for the session on another), and where the session stands
        # (plan version, control sequence) for the HELLO.
        self.secret = new_secret()
        self._steering = steering
        self.salt = int.from_bytes(
            hashlib.blake2b(address.encode(), digest_size=8).digest(), "little"
        )
        self.session = session
        # Its WELCOMEs before they are decoded: the last one known by its bytes, new ones
        # at most ``handshakes.RATE`` a second (a server re-sending WELCOME in a loop).
        self.welcomes = WelcomeMemo()
        self.curve = curve is not None
        self._ctx = ctx
        self._curve_keys = curve
        self._open()
        # Our HELLOs' nonce (this link's), and the proof of the last WELCOME
        # (``security.host_proof``) with the ends of the connection it came by: a server is
        # on our host when its token, read beside its ipc endpoints, makes that proof for
        # that connection. ``came_fd``: the connection the last message came by.
        self.nonce = os.urandom(16)
        self.local_proof = b""
        self.proof_ends: bytes | None = None
        self.came_fd = -1
        # Our landing buffer's hand-over to this server's workers, done only once it has
        # proven it is on our host (``sync_results``).
        self.handover = Handover(landing, session) if landing is not None else None
        self.was_lost = False
        self.last_error = ""
        # what the server's last heartbeat reply said of its object store ("": it answers)
        self.store_stall = ""
        self.welcome_msg: Welcome | None = None
        self.server_id = ""
        self.workers = 0
        self.outstanding: dict[int, float] = {}  # task_id -> when sent
        now = time.monotonic()
        self.last_heard = now
        self.last_sent = 0.0
        self.last_hello = 0.0
        self.last_claim = 0.0
        self.sent_total = 0
        self.results_total = 0

    # State, connection and credit are what its free credit depends on: each change is
    # told to the index (``LinkIndex.moved``), which keeps the links by free credit.

    @property
    def state(self) -> LinkState:
        return self._state

    @state.setter
    def state(self, value: LinkState) -> None:
        self._state = value
        self._index.moved(self)

    @property
    def connected(self) -> bool:
        """A ZMTP handshake has completed on the current connection."""
        return self._connected

    @connected.setter
    def connected(self, value: bool) -> None:
        self._connected = value
        self._index.moved(self)

    @property
    def credit(self) -> int:
        return self._credit

    @credit.setter
    def credit(self, value: int) -> None:
        self._credit = value
        self._index.moved(self)

    @property
    def ready(self) -> bool:
        return self._state is LinkState.READY

    def _open(self) -> None:
        """Its sockets, new: a DEALER to the front, and one for the workers' results."""
        self.data = dealer(self._ctx, self._curve_keys)
        # Queue nothing for a server that is not connected: a send fails at once instead
        # of piling up for a dead peer (or blocking when the queue is full).
        self.data.setsockopt(zmq.IMMEDIATE, 1)
        self.monitor = self.data.get_monitor_socket(MONITORED)
        self.data.connect(self.address)
        # Named by the reply id of our secret, so each worker can address us and nobody
        # else can take the name.
        self.results = dealer(self._ctx, self._curve_keys)
        self.results.setsockopt(zmq.ROUTING_ID, reply_id(self.secret))
        self.results_monitor = self.results.get_monitor_socket(
            zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_CONNECTED
        )
        self.result_endpoints: set[str] = set()
        self.inflow = Inflow()
        self.largest_answer = 0  # the most bytes a task sent here may be answered with
        self.open = True

    def _close_sockets(self, linger_ms: int = 0) -> None:
        self._commons.budget.give(self.address, len(self.result_endpoints))
        self.data.disable_monitor()
        self.results.disable_monitor()
        self.monitor.close(linger=0)
        self.results_monitor.close(linger=0)
        self.results.close(linger=0)
        self.data.close(linger=linger_ms)
        self.open = False

    def reopen(self) -> None:
        """New sockets in place of the old (the caller unwatched them): a lost server's
        connections are closed, and whatever they held of a message with them (a server
        that fell silent in the middle of one held it until the client closed)."""
        if self.open:
            self._close_sockets()
        self.connected = False
        self._open()

    def shut(self) -> None:
        """Close its sockets for good (a banned server: nothing it sends is read)."""
        if self.open:
            self._close_sockets()

    def inflow_budget(self) -> int:
        """What a connection of this server may hold beyond its last whole message: every
        outstanding task's answer, two more, and ``INFLOW_SLACK``."""
        answer = self.largest_answer + ANSWER_SLACK
        return (len(self.outstanding) + 2) * answer + INFLOW_SLACK

    def sockets(self) -> list[tuple[zmq.Socket[Any], str]]:
        """Its sockets the I/O thread polls, each with its role."""
        if not self.open:
            return []
        return [
            (self.data, "data"),
            (self.results, "results"),
            (self.monitor, "monitor"),
            (self.results_monitor, "results_monitor"),
        ]

    @property
    def free(self) -> int:
        if self._state is not LinkState.READY or not self._connected:
            return 0
        return self._credit - len(self.outstanding)

    def send(self, frames: list[Any]) -> bool:
        """Send without blocking; False when the server is not connected (or saturated)."""
        try:
            self.data.send_multipart(frames, zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        finally:
            self._commons.touched(self.data)
        self.last_sent = time.monotonic()
        return True

    def hello(self) -> bool:
        self.last_hello = time.monotonic()
        plan_version, control_seq = self._steering()
        hello = Hello(
            session=self.session,
            auth=self.secret,
            plan_version=plan_version,
            control_seq=control_seq,
            nonce=self.nonce,
        )
        return self.send(hello.encode())

    def heartbeat(self) -> None:
        self.send(Heartbeat(session=self.session, auth=self.secret).encode())

    def paced(self, ms: int | None) -> bool:
        """The server asks for a beat every ``ms`` (WELCOME, heartbeat reply): followed
        within ``beats``' bounds; False when refused (the caller counts it)."""
        return self.pace.told(ms)

    def claim(self) -> None:
        """Claim our session on each worker connection, as it comes up and every
        ``CLAIM_S`` after: with CURVE a worker sends results straight only to a connection
        that claimed them with the session's key, and with or without, a claim is what
        keeps a result connection from being shut down as idle. The DEALER deals one claim
        to each connected worker in turn."""
        self.last_claim = time.monotonic()
        # (the tag the front's WELCOME gave: it admitted the session; a worker takes no
        # claim without it)
        tag = self.welcome_msg.claim if self.welcome_msg is not None else b""
        frames = Hello(session=self.session, auth=self.secret, claim=tag).encode()
        for _ in self.result_endpoints:
            try:
                self.results.send_multipart(frames, zmq.NOBLOCK)
            except zmq.Again:
                break
        self._commons.touched(self.results)

    def store_says(self, stall: str) -> None:
        """The server's heartbeat reply: why its object store gives it nothing ("": fine)."""
        self.store_stall = stall

    def sync_results(
        self, announced: Sequence[str], local: Sequence[str] = (), proof: bytes | None = None
    ) -> None:
        """Connect to the workers a server announces. A worker's ipc endpoint (``local``,
        same order) is preferred when this client is on the server's host: when the
        server's token can be read beside it.

        Endpoints no longer announced (a replaced worker's) are never disconnected: libzmq
        aborts the process (``Assertion failed: !_more``, src/fq.cpp; libzmq #3485) when a
        pipe is terminated while a multipart message from it is being read, and a message
        from that worker may be waiting. A dead endpoint costs a reconnect attempt a
        second; at most ``MAX_WORKER_ENDPOINTS`` are ever connected (past that, results
        from new workers come through the front, as for a client that cannot reach them)."""
        if proof is not None:
            self.local_proof = proof
        use_local = len(local) == len(announced) and same_host(
            local, self.local_proof, self.nonce, self.session, self.proof_ends
        )
        chosen = local if use_local else announced
        wanted = {
            announced_address(self.address, e)
            for e in chosen[:MAX_WORKER_ENDPOINTS]
            if e.startswith(("tcp://", "ipc://"))
        }
        new = sorted(wanted - self.result_endpoints)
        new = new[: max(0, MAX_WORKER_ENDPOINTS - len(self.result_endpoints))]
        if not self._commons.budget.take(self.address, len(new)):
            new = []  # not enough descriptors: results come through the front
        for endpoint in new:
            self.results.connect(endpoint)
            self.result_endpoints.add(endpoint)
        if new:  # (a connect handles the socket's commands: a signal may have gone with them)
            self._commons.touched(self.results)
        if self.handover is not None:
            paths = [landing_socket(e) for e in local] if use_local else []
            self.handover.sync([p for p in paths[:MAX_WORKER_ENDPOINTS] if p is not None])

    @property
    def can_land(self) -> bool:
        """Whether tasks to this server may name our landing buffer: it is on our host
        and at least one of its workers took the buffer."""
        return self.handover is not None and self.handover.ready

    # ------------------------------------------------------------ state transitions

    def welcome_unchanged(self, msg: Welcome) -> bool:
        """Whether ``msg`` is the WELCOME this ready link holds already (a server saying
        it again, from the same process): nothing to check, move or plan again."""
        return (
            self.state is LinkState.READY
            and not self.was_lost
            and self.welcome_msg is not None
            and (msg is self.welcome_msg or msg == self.welcome_msg)
        )

    def came_by(self, fd: int) -> None:
        """A whole message came by connection ``fd`` (``ZMQ_SRCFD``)."""
        self.came_fd = fd
        self.inflow.seen(fd)

    def welcome(self, msg: Welcome, fd: int | None = None) -> bool:
        """CONNECTING or LOST -> READY on a WELCOME that came by connection ``fd`` (None:
        the last message's); True when it comes from a different server process than
        before (a restart: whatever it held is gone)."""
        restarted = bool(self.server_id) and msg.server_id != self.server_id
        self.welcome_msg = msg
        self.server_id = msg.server_id
        self.local_proof = msg.local_proof
        came = self.came_fd if fd is None else fd
        self.proof_ends = proof_ends(came, server=False) if msg.local_proof else None
        self.credit = max(1, msg.credit)
        self.workers = msg.workers
        self.state = LinkState.READY
        self.connected = True  # a WELCOME came over a live connection
        self.was_lost = False
        self.sync_results(msg.results, msg.local, msg.local_proof)
        return restarted

    def decline(self, msg: Welcome, why: str) -> None:
        """-> DRAINING: the server answered, but cannot serve this session (``why``)."""
        log.error("%s: not using it (%s)", self.address, why)
        self.welcome_msg = msg
        self.drain()

    def drain(self) -> None:
        """-> DRAINING: the server said BYE, it is leaving (SIGTERM, a scale-down). It gets
        nothing more; what it still runs may come back, what it had queued it answers
        CANCELLED."""
        if self.state is not LinkState.DRAINING:
            log.info("%s is draining: sending it nothing more", self.address)
        self.state = LinkState.DRAINING
        self.last_error = "draining"

    def ban(self, why: str) -> None:
        """-> BANNED: the server answered what it was not asked (or claimed what it did not
        do): it gets nothing more and what it sends is dropped, for the rest of this
        client's life. The engine moves its tasks to the other servers."""
        if self.state is not LinkState.BANNED:
            log.error("%s broke the protocol (%s): not using it any more", self.address, why)
        self.state = LinkState.BANNED
        self.last_error = f"dropped: {why}"

    def lose(self, why: str) -> LinkEvent:
        """-> LOST: the connection dropped, or the server fell silent."""
        # A server that drained was expected to go: no warning for that.
        level = logging.INFO if self.state is LinkState.DRAINING else logging.WARNING
        log.log(level, "%s lost (%s)", self.address, why)
        self.state = LinkState.LOST
        self.was_lost = True
        self.last_error = why
        return LinkEvent(EventKind.LOST, self, why)

    def forget_session(self) -> None:
        """READY -> CONNECTING: the server restarted or forgot the session; HELLO again
        (what it held is asked again once it answers, as after a loss)."""
        if self.state is LinkState.READY:
            self.state = LinkState.CONNECTING
            self.was_lost = True
            self.hello()

    def on_handshake(self) -> None:
        """A ZMTP handshake completed: greet the server unless it knows us already."""
        self.connected = True
        self.last_error = ""
        if self.state not in (LinkState.READY, LinkState.BANNED):
            self.hello()

    def on_disconnect(self) -> LinkEvent | None:
        """The front connection dropped: a LOST event when the server was in use."""
        self.connected = False
        if self.state in (LinkState.READY, LinkState.DRAINING):
            return self.lose("disconnected")
        return None

    def failed_handshake(self, why: str) -> None:
        self.last_error = why

    # ------------------------------------------------------------ tasks and traffic

    def heard(self) -> None:
        """Any traffic from the server: it is alive."""
        self.last_heard = time.monotonic()

    def sent(self, task_id: int, answer_bytes: int = 0) -> None:
        """``task_id`` went out (again: it goes last, as the newest); its answer's pixels
        are ``answer_bytes``."""
        self.largest_answer = max(self.largest_answer, answer_bytes)
        again = self.outstanding.pop(task_id, None) is not None
        now = self.outstanding[task_id] = time.monotonic()
        self.sent_total += 1
        self._index.sent(self, task_id, now, new=not again)
        self._index.moved(self)

    def answered(self) -> None:
        self.results_total += 1

    def owes(self, task_id: int) -> bool:
        return task_id in self.outstanding

    def sent_at(self, task_id: int) -> float | None:
        """When ``task_id`` was last sent here, if it is outstanding."""
        return self.outstanding.get(task_id)

    def owed(self) -> list[int]:
        """The outstanding task ids, oldest first."""
        return list(self.outstanding)

    def forget_tasks(self, task_ids: list[int]) -> list[int]:
        """Forget those of ``task_ids`` outstanding here (past their deadline: the index's
        ``late``, through ``Links.expire``); their ids."""
        gone = [t for t in task_ids if self.outstanding.pop(t, None) is not None]
        if gone:
            self._index.let_go(len(gone))
            self._index.moved(self)
        return gone

    def release(self, task_id: int) -> float | None:
        """The server answered ``task_id``: its credit is free again. Returns when it was
        sent (None if it was not outstanding here)."""
        sent = self.outstanding.pop(task_id, None)
        if sent is not None:
            self._index.let_go(1)
            self._index.moved(self)
        return sent

    def take_outstanding(self) -> list[int]:
        """Forget every outstanding task (they move elsewhere); their ids, oldest first."""
        ids = list(self.outstanding)
        self.outstanding.clear()
        self._index.let_go(len(ids))
        self._index.moved(self)
        return ids

    def stats(self) -> LinkStats:
        return LinkStats(
            self.address,
            self.state.name.lower(),
            self.sent_total,
            self.results_total,
            len(self.outstanding),
            self.credit,
            self.pace.interval_s,
        )

    def close(self) -> None:
        if self.open:
            try:
                # A server that welcomed us holds a session until BYE (or its idle timeout).
                if self.state is LinkState.READY or (
                    self.state is LinkState.DRAINING and self.welcome_msg is not None
                ):
                    bye = Bye(session=self.session, auth=self.secret)
                    self.data.send_multipart(bye.encode(), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            self._close_sockets(100)  # long enough for BYE to leave, short enough not to hang
        if self.handover is not None:
            self.handover.close()  # its workers let go of our buffer
