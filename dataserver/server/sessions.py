"""Client sessions on a server and the fair queue over them.

A session is one ``DataServerClient`` (one rank of one job). Its queued tasks wait in
arrival order; idle workers take tasks from the sessions in round robin, so one client
with a deep queue cannot starve another. Credits on the client side bound every queue;
``max_queue`` is the server's own bound against clients that ignore them.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any


@dataclass(eq=False)
class TaskEntry:
    """A task as the front keeps it: who asked, which plan, the frames to forward."""

    session: bytes
    task_id: int
    plan_version: int
    indices: list[int]
    frames: list[Any]
    attempts: int = 0  # workers that died running it


@dataclass(eq=False)
class Session:
    """One client's state on this server."""

    sid: bytes
    identity: bytes  # the ROUTER routing id of its latest message
    version: int = 0  # newest plan_version seen; older queued tasks are cancelled
    queue: deque[TaskEntry] = field(default_factory=deque)
    last_seen: float = field(default_factory=time.monotonic)
    in_ready: bool = False  # member of the scheduler's round robin


class Scheduler:
    """Sessions by id and a round robin of those with queued tasks."""

    def __init__(self, max_queue: int) -> None:
        self.max_queue = max_queue
        self.sessions: dict[bytes, Session] = {}
        self._ready: deque[Session] = deque()
        self.queued = 0

    def open(self, sid: bytes, identity: bytes) -> Session:
        """The session ``sid`` (new after a HELLO), now reachable at ``identity``."""
        if sid not in self.sessions:
            self.sessions[sid] = Session(sid, identity)
        session = self.touch(sid, identity)
        assert session is not None
        return session

    def touch(self, sid: object, identity: bytes) -> Session | None:
        """A message from session ``sid`` came from ``identity``: reply there, and it is
        alive. None for a session this server does not know."""
        session = self.sessions.get(sid) if isinstance(sid, bytes) else None
        if session is not None:
            session.identity = identity
            session.last_seen = time.monotonic()
        return session

    def push(self, session: Session, entry: TaskEntry, front: bool = False) -> bool:
        """Queue ``entry``; False if the session's queue is full."""
        if not front and len(session.queue) >= self.max_queue:
            return False
        if front:
            session.queue.appendleft(entry)
        else:
            session.queue.append(entry)
        self.queued += 1
        if not session.in_ready:
            session.in_ready = True
            self._ready.append(session)
        return True

    def pop(self) -> TaskEntry | None:
        """The next task in round robin over sessions, or None."""
        while self._ready:
            session = self._ready.popleft()
            if not session.queue:
                session.in_ready = False
                continue
            entry = session.queue.popleft()
            self.queued -= 1
            if session.queue:
                self._ready.append(session)
            else:
                session.in_ready = False
            return entry
        return None

    def cancel_older(self, session: Session, version: int) -> list[TaskEntry]:
        """Raise the session's version to ``version``; remove and return older queued tasks."""
        if version <= session.version:
            return []
        session.version = version
        stale = [e for e in session.queue if e.plan_version < version]
        if stale:
            session.queue = deque(e for e in session.queue if e.plan_version >= version)
            self.queued -= len(stale)
        return stale

    def close(self, sid: bytes) -> Session | None:
        """Forget a session and its queued tasks."""
        session = self.sessions.pop(sid, None)
        if session is not None:
            self.queued -= len(session.queue)
            session.queue.clear()
        return session

    def expired(self, ttl: float) -> list[bytes]:
        now = time.monotonic()
        return [sid for sid, s in self.sessions.items() if now - s.last_seen > ttl]
