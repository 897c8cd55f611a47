"""``Outlet``: everything the front sends, to clients and to workers, without blocking.

The front's router (``routing.py``) and its client handlers both answer through it, so
neither reaches the other's sockets: a gone or saturated peer costs a counter, never the
loop; a result forwarded for a worker stays within the ``Outbox``'s bounds; a cancelled
task is finished in the scheduler and answered CANCELLED in one place, so the client's
credits stay exact.

The sockets are created by the front's loop, in its thread, and handed over once
(``attach``) before that loop runs; the outlet exists before them so that the router can
be built with it.
"""

from __future__ import annotations

from typing import Any

import zmq

from dataserver.counting import Counts
from dataserver.protocol import Cancelled, ErrorMsg, Message, decode
from dataserver.server.counts import Count
from dataserver.server.front.sessions import Scheduler, Session, TaskEntry
from dataserver.server.outbox import Outbox, tracked


class Outlet:
    """Sends on the front's data (clients) and backend (workers) ROUTER sockets."""

    def __init__(self, scheduler: Scheduler, outbox: Outbox, counters: Counts[Count]) -> None:
        self._scheduler = scheduler
        self._outbox = outbox
        self._counters = counters
        self._data: zmq.Socket[Any] | None = None
        self._backend: zmq.Socket[Any] | None = None

    def attach(self, data: zmq.Socket[Any], backend: zmq.Socket[Any]) -> None:
        """The sockets to send on (the loop's own, created in its thread)."""
        self._data, self._backend = data, backend

    def _send(self, sock: zmq.Socket[Any] | None, identity: bytes, frames: list[Any]) -> bool:
        """Send without blocking; a gone or saturated peer costs a counter, not the loop."""
        if sock is None:  # (before the loop: nothing to send to yet)
            return False
        try:
            sock.send_multipart([identity, *frames], zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            self._counters.count(Count.SEND_DROPPED_FULL)
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            self._counters.count(Count.SEND_DROPPED_GONE)
        return False

    def send_to(self, identity: bytes, msg: Message) -> None:
        """``msg`` to the client connection ``identity``."""
        self._send(self._data, identity, msg.encode())

    def send_worker(self, identity: bytes, frames: list[Any]) -> bool:
        """Frames to the worker ``identity``: whether they went."""
        return self._send(self._backend, identity, frames)

    def reply(self, session: Session, msg: Message) -> None:
        """``msg`` to where ``session`` last spoke from."""
        self.send_to(session.identity, msg)

    def send_charged(self, session: Session, msg: Message) -> str | None:
        """``msg`` (a reply with one large array frame: SIZES) to ``session``, charged to it
        within the outbox's bounds as a forwarded result is; why it was not sent, or None."""
        frames = msg.encode()
        nbytes = len(memoryview(frames[3]).cast("B")) if len(frames) > 3 else 0
        refused = self._outbox.refuse(session.sid, nbytes)
        if refused is not None:
            return refused
        big = tracked(frames[3]) if len(frames) > 3 else None
        out = [*frames[:3], big, *frames[4:]] if big is not None else frames
        if self._send(self._data, session.identity, out) and big is not None:
            self._outbox.sent(session.sid, nbytes, big.tracker)
        return None

    def forward_result(self, session: Session, frames: list[Any], landed: bool) -> None:
        """A worker's RESULT that could not go straight to its client: send it on, within
        the outbox's bounds (beyond them the client is told, and asks again)."""
        if landed:  # no pixels in it: only a header, boxes and labels
            if self._send(self._data, session.identity, frames):
                self._counters.count(Count.RESULTS_VIA_FRONT)
            return
        nbytes = len(memoryview(frames[3])) if len(frames) > 3 else 0
        refused = self._outbox.refuse(session.sid, nbytes)
        if refused is not None:
            self._counters.count(Count.RESULTS_DROPPED_FRONT)
            header = decode(frames, with_arrays=False)
            self.reply(
                session,
                ErrorMsg(
                    message=f"result not sent: {refused} (--max-queued-mb)",
                    kind="dropped",
                    session=session.sid,
                    task_id=getattr(header, "task_id", None),
                    plan_version=getattr(header, "plan_version", None),
                ),
            )
            return
        image = tracked(frames[3]) if len(frames) > 3 else None
        out = [*frames[:3], image, *frames[4:]] if image is not None else frames
        if self._send(self._data, session.identity, out):
            self._counters.count(Count.RESULTS_VIA_FRONT)
            if image is not None:
                self._outbox.sent(session.sid, nbytes, image.tracker)

    def cancel(self, session: Session, entries: list[TaskEntry]) -> None:
        """``entries`` of ``session`` will not run: finished, counted, answered CANCELLED."""
        if not entries:
            return
        for entry in entries:
            self._scheduler.finish(entry)
        self._counters.count(Count.TASKS_CANCELLED, len(entries))
        self.reply(
            session,
            Cancelled(
                session=session.sid,
                task_ids=tuple(e.task_id for e in entries),
                plan_version=session.version,
            ),
        )
