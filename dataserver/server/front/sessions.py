"""Client sessions on a server and the fair queue over them.

A session is one ``DataServerClient`` (one rank of one job). Its queued tasks wait in
arrival order; idle workers take tasks from the sessions in round robin, so one client
with a deep queue cannot starve another. Credits on the client side bound every queue for
honest clients; the caps here bound them for everyone: at most ``max_sessions`` sessions,
at most ``max_tasks`` queued tasks and ``session_bytes`` of them per session, and
``total_bytes`` in all. A new session may take the place of one silent for ``evict_after``
seconds when all places are taken (a few of the beats its client is told to send,
``beats``: a silent one is gone).

Sessions are also counted by who holds them (issue 25, item 1: one connection opened 1,024
sessions and kept them beating, and every new job was refused): at most
``SESSIONS_PER_CONNECTION`` on one connection (a client holds one), and when every place is
taken and none is silent, a newcomer takes the place of a session of the peer holding the
most, provided that peer holds more than the newcomer's own and more than its share: one peer
can no longer hold the server against the others. A peer's share is the cap over the peers
that sent tasks within ``WORKING_S`` (the newcomer's and the largest counted too): issue 40,
item 4, one session from each of 24 other addresses took 3 of the 4 places of a one-node job
that was working; sessions that only beat no longer dilute a working job's share, and the
newcomer is refused ``session_limit`` instead. Of the victim's sessions, one that sent no
task lately goes first, then the least recently seen. A peer is a CURVE key where CURVE is
on, else the uid at the other end of a connection from this host (loopback or any of the
host's own addresses: every local user shares them; ``tcpinfo.loopback_uid``), else the
remote address (``Clients._peer``).

Worker time is shared per peer, then per session (issue 40, item 3: 16 cheap sessions of one
user made an honest job 4.5-19x slower when the queue shared per session): ``pop`` serves
the peer whose sessions' tasks took the least worker time, and of its sessions the one whose
took the least. Control states are paced per peer too (16 sessions of one user, each with a
constant state of its own, never changed theirs, while the workers' dataset copies
thrashed: ``tasks_paced`` stayed 0).

Over the house's ~500 lines (about 530): the ``Scheduler``'s fair queue, caps and eviction
change one set of maps together (sessions, the ready ring, the peers' shares, the live
tasks, the least-recently-seen order); split, each part would write the others' maps.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dataserver.protocol import ErrorMsg
from dataserver.ratelimit import TokenBucket
from dataserver.server.counts import Reject

if TYPE_CHECKING:
    from dataserver.server.front.pool import WorkerHandle  # (pool imports this module)

# Sessions one connection may hold: a DataServerClient opens one per server on a connection
# of its own; room for a few more (a process that multiplexes, a session opened again).
SESSIONS_PER_CONNECTION = 8
# Control states a session may move its tasks to a second (bursts as many): each new
# one costs a copy of the dataset object in the worker that runs it.
STATE_CHANGES = 2
STEER_RATE = 100_000  # plan/control changes a second a session could make (a tight loop)
STEER_SLACK = 1 << 16
POISONS_KEPT = 1024  # tasks answered poison lately, by (session, digest): a copy is not run
# A peer whose sessions sent a task within this many seconds is working: the session cap is
# shared among the working peers (``Scheduler._evict_from_largest``).
WORKING_S = 30.0


@dataclass(eq=False)
class TaskEntry:
    """A task as the front keeps it: who asked, which plan, the frames to forward."""

    session: bytes
    task_id: int
    plan_version: int
    images: tuple[tuple[int, ...], ...]  # each output image's sources
    frames: list[Any]
    nbytes: int = 0  # what its frames hold, counted against the queue caps
    control_seq: int = 0  # the control values it needs
    attempts: int = 0  # workers that died running it (or dropped it as it raised)
    held_by: WorkerHandle | None = None  # the worker it was given to, while it holds it
    digest: bytes = b""  # of what it computes: a task asked again is the same task
    control_resends: int = 0  # its worker lacked the session's values: sent again
    state: bytes = b""  # the control state it needs (``digests.control_state``)

    def hold(self, handle: WorkerHandle) -> None:
        """A worker (its handle) was given this task."""
        self.held_by = handle

    def release(self) -> None:
        """No worker holds this task any more (answered, lost, or its worker died)."""
        self.held_by = None

    def blame(self) -> int:
        """A worker died running it (or dropped it as it raised): how many have now."""
        self.attempts += 1
        return self.attempts

    def resend_control(self) -> int:
        """Its worker lacked the session's values, sent again: how many times now."""
        self.control_resends += 1
        return self.control_resends


@dataclass(eq=False)
class Session:
    """One client's state on this server."""

    sid: bytes
    identity: bytes  # the ROUTER routing id replies go to: of its latest authentic message
    secret: bytes = b""  # bound by the HELLO that opened it; every message must carry it
    version: int = 0  # newest plan_version seen; older queued tasks are cancelled
    control_seq: int = 0  # its control values, as of this sequence number
    control: dict[str, Any] = field(default_factory=dict)
    queue: deque[TaskEntry] = field(default_factory=deque)
    queued_bytes: int = 0
    last_seen: float = field(default_factory=time.monotonic)
    in_ready: bool = False  # member of the scheduler's round robin
    opened: float = field(default_factory=time.monotonic)
    base: int = 0  # the larger of plan_version, control_seq its HELLO said it stood at
    live_ids: set[int] = field(default_factory=set)  # its task ids in Scheduler.live
    used: float = 0.0  # microseconds of worker time its tasks took (the fair queue's measure)
    state: bytes = b""  # the control state of the task it was last given a worker for
    conn: bytes = b""  # the connection (routing id) its HELLO came on
    peer: str = ""  # the peer that opened it: key:Z85, uid:N or an address ("" unknown)
    worked: float = 0.0  # when it last sent a task (monotonic; 0: never)

    def next_task(self) -> TaskEntry:
        """Its next queued task, taken off the queue: its control state is now that one's."""
        entry = self.queue.popleft()
        self.state = entry.state
        return entry

    @property
    def share(self) -> str:
        """Whose share of worker time it draws on: its peer's (a session of no known peer
        is a peer of its own)."""
        return self.peer or f"session:{self.sid.hex()}"

    def reachable(self, value: int) -> bool:
        """Whether a plan version or control sequence number of ``value`` is one this
        session can have reached by now: where its HELLO said it stood, plus at most
        ``STEER_RATE`` changes a second since (an honest client changes them once per
        feedback, far below that)."""
        return value <= self.base + STEER_SLACK + STEER_RATE * (time.monotonic() - self.opened)


@dataclass(eq=False)
class PeerShare:
    """What the fair queue knows of one peer (``Session.peer``): the worker time all its
    sessions' tasks took, how many of them are in the round robin, the time of its session
    served last, and its control state and how often that may change."""

    used: float = 0.0
    ready: int = 0
    vtime: float = 0.0
    state: bytes = b""
    changes: TokenBucket | None = None  # how often that may change (``Scheduler._paced``)


class Scheduler:
    """Sessions by id and a round robin of those with queued tasks."""

    def __init__(
        self,
        max_sessions: int,
        max_tasks: int,
        session_bytes: int,
        total_bytes: int,
        evict_after: float = 5.0,
        limit_why: str = "",
    ) -> None:
        self.max_sessions = max_sessions
        self.max_tasks = max_tasks
        self.evict_after = evict_after
        self.evicted = 0
        self.evicted_live = 0  # of those, sessions still beating (their peer held the most)
        self.session_bytes = session_bytes
        self.total_bytes = total_bytes
        self.sessions: dict[bytes, Session] = {}
        # Tasks queued here or held by a worker, by (session, task_id): a client that asks
        # again for one of these (its deadline passed) gets the answer the first one makes.
        self.live: dict[tuple[bytes, int], TaskEntry] = {}
        self._ready: deque[Session] = deque()
        self.shares: dict[str, PeerShare] = {}  # peers with sessions (``PeerShare``)
        self.queued = 0
        self.queued_bytes = 0
        self._vtime = 0.0  # the worker time of the session served last (``pop``)
        self.paced = 0  # times a session's task waited for its control-state pace
        self.pace_states = False  # the dataset has set_control: state changes are paced
        # Tasks answered poison lately (the ERROR sent), by (session, digest): a copy the
        # client sent before the answer reached it (its results connection broke when the
        # worker died, so it asked again) is answered the same, not run to kill again.
        self.poisoned: OrderedDict[tuple[bytes, bytes], ErrorMsg] = OrderedDict()
        self.by_conn: Counter[bytes] = Counter()  # sessions opened on each connection
        self.by_peer: dict[str, dict[bytes, Session]] = {}  # each peer's sessions
        # (reason, why) of the last open() that returned None
        self.refused: tuple[Reject, str] = (Reject.SESSION_LIMIT, "")
        self.limit_why = limit_why  # why max_sessions is what it is (``capacity.SessionCap``)
        # Every session, least recently seen first (``touch`` moves one to the end): expiry
        # and eviction look at the head only, not at every session (10,000 of them).
        self._seen: OrderedDict[bytes, Session] = OrderedDict()
        # Peers whose sessions sent a task within ``WORKING_S``, least recently first
        # (each TASK moves its peer to the end; the head is let go when stale).
        self._working: OrderedDict[str, float] = OrderedDict()

    def pace(self, steerable: bool) -> None:
        """Whether the dataset takes control states (``set_control``, as a worker's READY
        says): a task needing another state than its session's last is then paced."""
        self.pace_states = steerable

    def open(
        self, sid: bytes, identity: bytes, secret: bytes, base: int = 0, peer: str = ""
    ) -> Session | None:
        """The session ``sid`` (new after a HELLO, bound to ``secret``), now reachable at
        ``identity`` (a connection of ``peer``); None when it is new and may not open:
        ``refused`` says why (``session_limit``: ``max_sessions`` are open and none could
        go; ``connection_sessions``: that connection holds ``SESSIONS_PER_CONNECTION``).
        The caller checks that a HELLO for a known session carries its secret."""
        session = self.sessions.get(sid)
        if session is None:
            if self.by_conn[identity] >= SESSIONS_PER_CONNECTION:
                self.refused = (
                    Reject.CONNECTION_SESSIONS,
                    f"this connection holds {self.by_conn[identity]} sessions, the most one "
                    f"may ({SESSIONS_PER_CONNECTION})",
                )
                return None
            if len(self.sessions) >= self.max_sessions and not (
                self._evict_one() or self._evict_from_largest(peer)
            ):
                return None
            session = self.sessions[sid] = Session(
                sid, identity, secret, base=base, conn=identity, peer=peer
            )
            self.by_conn[identity] += 1
            self.by_peer.setdefault(peer, {})[sid] = session
        session.identity = identity
        session.last_seen = time.monotonic()
        self._seen[sid] = session
        self._seen.move_to_end(sid)
        return session

    def beat_every(self, interval_s: float, evict_after: float) -> None:
        """Clients are now told to beat every ``interval_s``: a session silent for
        ``evict_after`` (a few of its beats) may give its place to a newcomer."""
        self.evict_after = max(evict_after, 2 * interval_s)

    def remember_poison(self, entry: TaskEntry, answer: ErrorMsg) -> None:
        """``entry`` was answered poison with ``answer``."""
        key = (entry.session, entry.digest)
        self.poisoned[key] = answer
        self.poisoned.move_to_end(key)
        if len(self.poisoned) > POISONS_KEPT:
            self.poisoned.popitem(last=False)

    def poison_of(self, sid: bytes, digest: bytes) -> ErrorMsg | None:
        """The poison answer a task of session ``sid`` with this digest got lately, or None."""
        return self.poisoned.get((sid, digest)) if digest else None

    def _evict_from_largest(self, peer: str) -> bool:
        """Every place taken, none silent: forget a session of the peer holding the most,
        if it holds more than ``peer`` (the newcomer's) does and more than its share (the
        cap over the working peers: ``_sharing``); of its sessions, one that sent no task
        within ``WORKING_S`` first, then the least recently seen. Otherwise ``refused``
        says why the newcomer is."""
        if not self.by_peer:
            self.refused = (Reject.SESSION_LIMIT, "")
            return False
        largest = max(self.by_peer, key=lambda p: len(self.by_peer[p]))
        held = len(self.by_peer[largest])
        own = len(self.by_peer.get(peer, ()))
        if held <= own:
            self.refused = (Reject.SESSION_LIMIT, "no peer holds more of them than yours")
            return False
        sharing = self._sharing(peer, largest)
        if held * sharing <= self.max_sessions:
            self.refused = (
                Reject.SESSION_LIMIT,
                f"no peer holds more than its share ({self.max_sessions} over the "
                f"{sharing} peers working now: {self.max_sessions // sharing}); "
                "working sessions are not evicted for a newcomer",
            )
            return False
        cutoff = time.monotonic() - WORKING_S
        victim = min(self.by_peer[largest].values(), key=lambda s: (s.worked > cutoff, s.last_seen))
        self.close(victim.sid)
        self.evicted += 1
        self.evicted_live += 1
        return True

    def _sharing(self, peer: str, largest: str) -> int:
        """How many peers share the session cap: those that sent tasks within
        ``WORKING_S``, the newcomer's ``peer`` and ``largest`` among them."""
        working = self._working
        cutoff = time.monotonic() - WORKING_S
        while working and next(iter(working.values())) < cutoff:
            working.popitem(last=False)
        return len(working) + (peer not in working) + (largest not in working)

    def worked(self, session: Session, now: float | None = None) -> None:
        """``session`` sent a task: it, and its peer, are working."""
        session.worked = time.monotonic() if now is None else now
        self._working[session.peer] = session.worked
        self._working.move_to_end(session.peer)

    def _evict_one(self) -> bool:
        """Forget the session silent longest, if it has been silent ``evict_after``."""
        oldest = next(iter(self._seen.values()), None)
        if oldest is None or time.monotonic() - oldest.last_seen < self.evict_after:
            return False
        self.close(oldest.sid)
        self.evicted += 1
        return True

    def steer(self, session: Session, control_seq: int, control: dict[str, Any]) -> None:
        """The session's control values are now ``control``, as of ``control_seq`` (newer
        values only: an older or repeated CONTROL changes nothing)."""
        if control_seq > session.control_seq:
            session.control_seq, session.control = control_seq, control

    def touch(self, session: Session, identity: bytes) -> None:
        """An authentic message of ``session`` came from ``identity``: reply there (a
        client that reconnected has a new one), and it is alive."""
        session.identity = identity
        session.last_seen = time.monotonic()
        self._seen.move_to_end(session.sid)

    def over_limit(self, session: Session, nbytes: int) -> tuple[Reject, str] | None:
        """(reason, why) ``nbytes`` more may not be queued for ``session``, or None."""
        if len(session.queue) >= self.max_tasks:
            return (
                Reject.QUEUE_FULL,
                f"{len(session.queue)} tasks queued: the client ignores its credit",
            )
        if session.queued_bytes + nbytes > self.session_bytes:
            why = f"session queue holds {session.queued_bytes} bytes; at most {self.session_bytes}"
            return Reject.QUEUE_BYTES, why
        if self.queued_bytes + nbytes > self.total_bytes:
            return (
                Reject.QUEUE_BYTES,
                f"queues hold {self.queued_bytes} bytes; at most {self.total_bytes}",
            )
        return None

    def admit(self, session: Session, entry: TaskEntry, first: bool = False) -> None:
        """Queue a task a client sent (``first``: ahead of its session's others, the TASK's
        ``priority``)."""
        self.worked(session)
        self.mark_live(session, entry)
        self.push(session, entry, front=first)

    def mark_live(self, session: Session, entry: TaskEntry) -> None:
        """``entry`` is live (queued or held): a client asking for it again gets its answer."""
        self.live[(entry.session, entry.task_id)] = entry
        session.live_ids.add(entry.task_id)

    def finish(self, entry: TaskEntry) -> None:
        """``entry`` was answered (or cancelled, or given up): no longer live."""
        key = (entry.session, entry.task_id)
        if self.live.get(key) is entry:
            del self.live[key]
            session = self.sessions.get(entry.session)
            if session is not None:
                session.live_ids.discard(entry.task_id)

    def push(self, session: Session, entry: TaskEntry, front: bool = False) -> None:
        """Queue ``entry`` (at the head when ``front``: a task given back by a worker, or
        one its client sent with ``priority``)."""
        if front:
            session.queue.appendleft(entry)
        else:
            session.queue.append(entry)
        self.queued += 1
        session.queued_bytes += entry.nbytes
        self.queued_bytes += entry.nbytes
        if not session.in_ready:
            session.in_ready = True
            share = self._share(session)
            # No credit saved up while idle: a peer starts level with those being served,
            # a session level with its peer's.
            if not share.ready:
                share.used = max(share.used, self._vtime)
            share.ready += 1
            session.used = max(session.used, share.vtime)
            self._ready.append(session)

    def _share(self, session: Session) -> PeerShare:
        share = self.shares.get(session.share)
        if share is None:
            share = self.shares[session.share] = PeerShare()
        return share

    def _unready(self, session: Session) -> None:
        session.in_ready = False
        share = self.shares.get(session.share)
        if share is not None:
            share.ready -= 1

    def _took(self, session: Session, entries: int, nbytes: int) -> None:
        self.queued -= entries
        session.queued_bytes -= nbytes
        self.queued_bytes -= nbytes

    def pop(self) -> TaskEntry | None:
        """The next task: of the peer whose sessions' tasks took the least worker time so
        far, of its session whose took the least (``charge``; equal ones in round robin),
        or None. Peers and sessions share the workers by time, not by task: one whose tasks
        cost more (a control state copied for each: issue 25 item 4) gets fewer of them,
        not the others' time; one peer's many sessions get one peer's share."""
        ready = self._ready
        while ready and not ready[0].queue:
            gone = ready.popleft()
            if gone.in_ready:  # (a closed session's was let go at its close)
                self._unready(gone)
        now = time.monotonic()
        found = self._best(now)
        if found is None:
            return None
        best, at = found
        del ready[at]
        share = self.shares[best.share]
        entry = best.next_task()
        if entry.state != share.state:
            share.state = entry.state
            if share.changes is not None:
                share.changes.take(now)
        self._took(best, 1, entry.nbytes)
        share.vtime = best.used
        self._vtime = share.used
        if best.queue:
            ready.append(best)
        else:
            self._unready(best)
        return entry

    def _best(self, now: float) -> tuple[Session, int] | None:
        """The session to serve (and its place in the round robin): the least worker time
        of its peer, then its own, of those whose next task is not paced."""
        best, at, best_key = None, 0, (0.0, 0.0)
        shares = self.shares
        for j, candidate in enumerate(self._ready):
            if not candidate.queue:
                continue
            share = shares[candidate.share]
            key = (share.used, candidate.used)
            if best is not None and key >= best_key:
                continue
            if self._paced(candidate, share, now):
                continue
            best, at, best_key = candidate, j, key
        return None if best is None else (best, at)

    def _paced(self, session: Session, share: PeerShare, now: float) -> bool:
        """Whether ``session``'s next task must wait: it needs another control state than
        its peer's last one, and the peer changed states ``STATE_CHANGES`` a second already
        (each change copies the dataset object in a worker: a job calling
        ``control(v=step % 5)`` before every batch made another 5.8x slower; 16 sessions
        of one user, each a constant state of its own, 36-87x)."""
        head = session.queue[0]
        if not self.pace_states or head.state == share.state:
            return False
        if share.changes is None:
            share.changes = TokenBucket(STATE_CHANGES, STATE_CHANGES)
        if share.changes.peek(now):
            return False
        self.paced += 1
        return True

    def charge(self, sid: bytes, micros: int) -> None:
        """A task of session ``sid`` took ``micros`` of a worker's time."""
        session = self.sessions.get(sid)
        if session is not None:
            session.used += max(1, micros)
            share = self.shares.get(session.share)
            if share is not None:
                share.used += max(1, micros)

    def cancel_older(self, session: Session, version: int) -> list[TaskEntry]:
        """Raise the session's version to ``version``; remove and return older queued tasks."""
        if version <= session.version:
            return []
        session.version = version
        stale = [e for e in session.queue if e.plan_version < version]
        if stale:
            session.queue = deque(e for e in session.queue if e.plan_version >= version)
            self._took(session, len(stale), sum(e.nbytes for e in stale))
        return stale

    def take(self, session: Session, which: Callable[[TaskEntry], bool]) -> list[TaskEntry]:
        """Remove and return the session's queued tasks for which ``which(entry)``."""
        gone = [e for e in session.queue if which(e)]
        if gone:
            session.queue = deque(e for e in session.queue if not which(e))
            self._took(session, len(gone), sum(e.nbytes for e in gone))
        return gone

    def close(self, sid: bytes) -> Session | None:
        """Forget a session and its queued tasks."""
        session = self.sessions.pop(sid, None)
        if session is not None:
            self._seen.pop(sid, None)
            self.by_conn[session.conn] -= 1
            if self.by_conn[session.conn] <= 0:
                del self.by_conn[session.conn]
            held = self.by_peer.get(session.peer)
            if held is not None:
                held.pop(sid, None)
                if not held:
                    del self.by_peer[session.peer]
                    self._working.pop(session.peer, None)
            if session.in_ready:  # (it stays in the round robin, empty, until passed over)
                self._unready(session)
            share = self.shares.get(session.share)
            if (
                share is not None
                and not share.ready
                and (not session.peer or session.peer not in self.by_peer)
            ):
                del self.shares[session.share]
            self._took(session, len(session.queue), session.queued_bytes)
            session.queue.clear()
            for task_id in session.live_ids:  # its own, not a scan of every session's
                self.live.pop((sid, task_id), None)
            session.live_ids.clear()
        return session

    def expired(self, ttl: float) -> list[bytes]:
        """The sessions silent for more than ``ttl`` seconds (the head of ``_seen`` only)."""
        now = time.monotonic()
        out = []
        for sid, session in self._seen.items():
            if now - session.last_seen <= ttl:
                break
            out.append(sid)
        return out
