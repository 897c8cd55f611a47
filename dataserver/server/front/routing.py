"""The workers as the front sees them: READY, answers (RESULT, ERROR, DONE), dispatch of
queued tasks to the least loaded workers, and what a worker's death does to its tasks.

``WorkerRouter`` decides; the worker handles (``pool.py``), the scheduler's sessions and
the task entries change only through their own methods. It reaches clients and workers
only through the ``Sends`` interface (the front's ``Outlet``, which owns the sends).

A worker runs its tasks in the order it was given them, so an answer for a task tells the
front that every task given to that worker before it was answered too: an entry older than
an answered one is an answer that was lost (dropped as bad, or by a fault) and is let go,
never left to occupy the worker's pipeline for good. The client asks for it again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from dataserver.counting import Counts
from dataserver.loop import inject
from dataserver.protocol import (
    Control,
    Done,
    ErrorMsg,
    Message,
    ProtocolError,
    Ready,
    Result,
    Tally,
    decode,
)
from dataserver.server.counts import Count, Reject, fetch_errors
from dataserver.server.front.pool import WorkerHandle, WorkerPool
from dataserver.server.front.sessions import Scheduler, Session, TaskEntry
from dataserver.server.running import task_key

log = logging.getLogger("dataserver.front")

PIPELINE = 2  # tasks a worker holds at once: the one it runs and the next
MAYBE_LOST_S = 10.0  # a direct result this recent may have died with its worker


class Sends(Protocol):
    """What the router needs to send to sessions and workers (the front's ``Outlet``)."""

    def reply(self, session: Session, msg: Message) -> None: ...
    def forward_result(self, session: Session, frames: list[Any], landed: bool) -> None: ...
    def cancel(self, session: Session, entries: list[TaskEntry]) -> None: ...
    def send_worker(self, identity: bytes, frames: list[Any]) -> bool: ...


Observe = Callable[[int, tuple[int, ...] | None], None]  # a worker's timings of a task


class WorkerRouter:
    """Routes tasks to worker processes and their answers back to sessions.

    Its collaborators come in as arguments: the ``pool`` (processes), the ``scheduler``
    (sessions, queues, live tasks: changed through its methods), ``sends`` (sending),
    the server's ``counters`` and ``rejected`` counts, and ``observe`` and ``observe_fetch``
    (the metrics' hooks, None when they are off). It owns which workers are ready and their routing ids."""

    def __init__(
        self,
        pool: WorkerPool,
        scheduler: Scheduler,
        sends: Sends,
        counters: Counts[Count],
        rejected: Counts[Reject],
        observe: Observe | None = None,
        observe_fetch: Callable[[tuple[int, ...]], None] | None = None,
    ) -> None:
        self.pool = pool
        self.scheduler = scheduler
        self.sends = sends
        self.counters = counters
        self.rejected = rejected
        self.by_identity: dict[bytes, WorkerHandle] = {}
        self.ready: list[WorkerHandle] = []  # live workers that said READY
        self._respawn_at: dict[int, float] = {}
        self._stopping = False
        self._observe = observe
        self._observe_fetch = observe_fetch  # GET latencies (us) a TALLY told, for the metrics

    def stop(self) -> None:
        """The server is shutting down: workers that die are not replaced."""
        self._stopping = True

    # ------------------------------------------------------------ answers

    def on_message(self, frames: list[Any]) -> None:
        identity = frames[0].bytes
        try:
            # Workers are this server's own children: their headers are checked, their
            # arrays forwarded untouched (the client checks them).
            msg = decode(frames[1:], with_arrays=False)
        except ProtocolError as exc:
            log.error("bad message from worker %r: %s", identity, exc)
            self.rejected.count(Reject.WORKER_MALFORMED)
            return
        if isinstance(msg, Ready):
            self._on_ready(identity, msg)
            return
        inject("front.backend")
        handle = self.by_identity.get(identity)
        if handle is None:
            self.rejected.count(Reject.WORKER_UNEXPECTED)
        elif isinstance(msg, ErrorMsg) and msg.task_id is None:
            if msg.kind == "internal":  # the worker's loop dropped a message that raised
                self.rejected.count(Reject.INTERNAL)
            log.error("worker %d: %s", handle.slot, msg.message)
        elif isinstance(msg, (Result, ErrorMsg, Done)):
            self._on_answer(handle, msg, frames[1:])
        elif isinstance(msg, Tally):  # result connections shut down, objects fetched
            self.on_tally(msg)
        else:
            self.rejected.count(Reject.WORKER_UNEXPECTED)

    def on_tally(self, msg: Tally) -> None:
        """A worker's TALLY (or the front's own fetcher's): its result connections shut
        down, what it fetched."""
        for name, n in (
            (Reject.RESULTS_IDLE_DROPPED, msg.idle_dropped),
            (Reject.RESULTS_OVER_LIMIT_DROPPED, msg.over_limit_dropped),
            (Reject.RESULTS_UNFINISHED_DROPPED, msg.unfinished_dropped),
            (Reject.RESULTS_FRAMES_DROPPED, msg.frames_dropped),
            (Reject.RESULTS_BARRED_DROPPED, msg.barred_dropped),
            (Reject.RESULTS_CLAIM_DROPPED, msg.claim_dropped),
            (Reject.RESULTS_UNCLAIMED_DROPPED, msg.unclaimed_dropped),
        ):
            if n:
                self.rejected.count(name, n)
        for count, n in (
            (Count.FETCHES, msg.fetches),
            (Count.FETCH_BYTES, msg.fetch_bytes),
            (Count.FETCH_RETRIES, msg.fetch_retries),
            (Count.FETCH_ERRORS, msg.fetch_errors),
        ):
            if n:
                self.counters.count(count, n)
        for kind, n in msg.fetch_error_kinds.items():
            if n:
                self.counters.count(fetch_errors(kind), n)
        if msg.fetch_us and self._observe_fetch is not None:
            self._observe_fetch(msg.fetch_us)

    def _on_answer(
        self, handle: WorkerHandle, msg: Result | ErrorMsg | Done, frames: list[Any]
    ) -> None:
        entry = self._take(handle, msg)
        if entry is None:
            return
        session = self.scheduler.sessions.get(entry.session)
        if isinstance(msg, ErrorMsg) and self._again(handle, entry, session, msg):
            return
        self._count(msg)
        if isinstance(msg, Done):  # the worker sent the RESULT straight to the client
            self.counters.count(Count.RESULTS_DIRECT)
            handle.sent_direct(entry.session, entry.task_id, entry.plan_version)
            return
        if isinstance(msg, ErrorMsg) and msg.kind == "dropped":
            self.counters.count(Count.RESULTS_DROPPED_WORKER)
        if session is None:
            self.counters.count(Count.RESULTS_ORPHANED)
        elif isinstance(msg, Result):
            self.sends.forward_result(session, frames, bool(msg.landed))
        else:
            self.sends.reply(session, msg)

    def _again(
        self, handle: WorkerHandle, entry: TaskEntry, session: Session | None, msg: ErrorMsg
    ) -> bool:
        """Whether an ERROR is one the front answers by queueing the task again (at the
        head) instead of passing it on."""
        if msg.kind == "control_missing" and session is not None:
            # The worker no longer has the session's values (it keeps a bounded number of
            # sessions'): they go to it again before the task does, instead of the client
            # resending values this front believes the worker has, forever.
            handle.forgot_control(entry.session)
            resends = entry.resend_control()
            if resends <= 3 and entry.control_seq == session.control_seq:
                self.counters.count(Count.CONTROLS_RESENT)
                self._requeue(session, entry)
                return True
        if msg.kind == "internal" and msg.retry:
            # The worker's loop dropped this task as it raised: once more, then the error.
            self.rejected.count(Reject.INTERNAL)
            if entry.blame() < 2 and session is not None:
                self.counters.count(Count.TASKS_RETRIED)
                self._requeue(session, entry)
                return True
        return False

    def _requeue(self, session: Session, entry: TaskEntry) -> None:
        """``entry`` is live again and first in its session's queue."""
        self.scheduler.mark_live(session, entry)
        self.scheduler.push(session, entry, front=True)

    def _count(self, msg: Result | ErrorMsg | Done) -> None:
        """An answer the client gets: counted, and its timings observed."""
        ok = not isinstance(msg, ErrorMsg)
        self.counters.count(Count.TASKS_DONE if ok else Count.TASKS_FAILED)
        if isinstance(msg, ErrorMsg):
            return
        if isinstance(msg, Done):
            samples, images = msg.samples, msg.images
        else:
            samples, images = sum(len(i) for i in msg.images), len(msg.images)
        self.counters.count(Count.IMAGES_DONE, images)
        self.scheduler.charge(msg.session, msg.task_us)
        self.counters.count(Count.SOURCES_DECODED, msg.decoded)
        self.counters.count(Count.SOURCES_REUSED, max(0, samples - msg.decoded))
        if self._observe is not None:
            self._observe(msg.task_us, msg.decode_us)

    def _take(self, handle: WorkerHandle, msg: Result | ErrorMsg | Done) -> TaskEntry | None:
        """The entry ``msg`` answers, taken from the worker's; older entries go with it."""
        taken = handle.answered(msg.session, msg.task_id)
        if taken is None:
            log.error("worker %d answered task %s it was not given", handle.slot, msg.task_id)
            self.rejected.count(Reject.WORKER_UNEXPECTED)
            return None
        lost, entry = taken
        for e in lost:  # answered before this one, but the answer never came
            self.scheduler.finish(e)
            self.counters.count(Count.WORKER_ANSWERS_LOST)
        self.scheduler.finish(entry)
        return entry

    def is_running(self, entry: TaskEntry) -> bool:
        """Whether a worker holds ``entry`` and shows it running now."""
        handle = entry.held_by
        return handle is not None and handle.running.read()[0] == task_key(
            entry.session, entry.task_id
        )

    def _on_ready(self, identity: bytes, msg: Ready) -> None:
        handle = self.pool.starting(msg.pid)
        if handle is None:
            log.warning("READY from unknown worker pid %d", msg.pid)
            return
        handle.became_ready(identity, msg.results, msg.local)
        if msg.store is False:  # it logged why; it serves, decoding every source
            self.counters.count(Count.WORKERS_WITHOUT_STORE)
        self.scheduler.pace(msg.steerable)  # (every worker has the same dataset)
        self.by_identity[identity] = handle
        self.ready.append(handle)
        self.pool.mark_ready(handle)

    def result_endpoints(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """Where clients connect to receive results straight from the workers: over the
        network, and (the same workers, in the same order) over ipc for clients on this
        host."""
        pairs = sorted((w.results, w.local) for w in self.ready if w.results)
        return tuple(r for r, _ in pairs), tuple(local for _, local in pairs)

    # ------------------------------------------------------------ dispatch

    def dispatch(self) -> None:
        """Give queued tasks to the least loaded live workers, up to PIPELINE each.

        A worker holds the task it runs and the next one, so it never waits for this
        loop to be scheduled (on a busy machine, that wait is what idles workers)."""
        if not self.scheduler.queued:
            return
        for depth in range(PIPELINE):
            for handle in self.ready:
                if len(handle.tasks) > depth or not self.scheduler.queued:
                    continue
                entry = self._next_entry()
                if entry is None or not self._give(handle, entry):
                    return

    def _give(self, handle: WorkerHandle, entry: TaskEntry) -> bool:
        """Send ``entry`` to ``handle``'s worker; if it cannot go, it is first in its
        session's queue again (and False)."""
        handle.give(entry)
        self._send_control(handle, entry)
        if self.sends.send_worker(handle.identity or b"", entry.frames):
            return True
        handle.take_back(entry)
        session = self.scheduler.sessions.get(entry.session)
        if session is not None:
            self.scheduler.push(session, entry, front=True)
        return False

    def _send_control(self, handle: WorkerHandle, entry: TaskEntry) -> None:
        """Give the worker the session's control values before a task that needs values it
        does not have yet (sent once per change, not with every task)."""
        if entry.control_seq == 0 or handle.has_control(entry.session, entry.control_seq):
            return
        session = self.scheduler.sessions.get(entry.session)
        if session is None or session.control_seq != entry.control_seq:
            return  # a task of older values: its answer is not wanted anyway
        msg = Control(
            session=entry.session, control_seq=session.control_seq, control=session.control
        )
        if self.sends.send_worker(handle.identity or b"", msg.encode()):
            handle.learned_control(entry.session, entry.control_seq)

    def _next_entry(self) -> TaskEntry | None:
        """The next queued task that is still wanted (older plans are answered CANCELLED)."""
        while (entry := self.scheduler.pop()) is not None:
            session = self.scheduler.sessions.get(entry.session)
            if session is None:
                continue
            if entry.plan_version < session.version:
                self.sends.cancel(session, [entry])
                continue
            return entry
        return None

    # ------------------------------------------------------------ deaths

    def reap(self) -> None:
        for handle in self.pool.dead():
            self._on_death(handle)
        now = time.monotonic()
        for slot, when in list(self._respawn_at.items()):
            if now >= when and not self._stopping:
                del self._respawn_at[slot]
                self.pool.spawn(slot)
        if not self._stopping:
            self.pool.retry_due(now)  # starts that failed for want of fds

    def _on_death(self, handle: WorkerHandle) -> None:
        code = handle.proc.returncode
        running_key, running_image = handle.running.read()
        log.warning(
            "worker %d (pid %d) died (exit %s); replacing it", handle.slot, handle.pid, code
        )
        self.counters.count(Count.WORKER_DEATHS)
        delay = self.pool.forget(handle)
        self._respawn_at[handle.slot] = time.monotonic() + delay
        if handle.identity is not None:
            self.by_identity.pop(handle.identity, None)
        if handle in self.ready:
            self.ready.remove(handle)
        self._warn_recent_direct(handle)
        entries = handle.drop_all()
        # Only the task it was running is to blame; the others go back unblamed, in order.
        blamed = next((e for e in entries if task_key(e.session, e.task_id) == running_key), None)
        for entry in reversed(entries):
            owner = self.scheduler.sessions.get(entry.session)
            if owner is None:
                continue
            if entry is blamed:
                if entry.blame() >= 2:
                    self._poison(owner, entry, code, running_image)
                    continue
                self.counters.count(Count.TASKS_RETRIED)
            self.scheduler.push(owner, entry, front=True)

    def _poison(self, session: Session, entry: TaskEntry, code: int | None, image: int) -> None:
        """Answer a task that killed two workers: poison, naming the image of it that was
        being composed when the last one died (and its sample, when it has one)."""
        self.scheduler.finish(entry)
        self.counters.count(Count.TASKS_POISONED)
        how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        image = min(image, len(entry.images) - 1)
        indices = entry.images[image]
        names: Any = indices[0] if len(indices) == 1 else list(indices)
        answer = ErrorMsg(
            message=f"sample {names} killed {entry.attempts} worker processes "
            f"(last: {how}); not retried",
            kind="poison",
            session=entry.session,
            task_id=entry.task_id,
            plan_version=entry.plan_version,
            indices=indices,
            index=indices[0] if len(indices) == 1 else None,
            image=image,
        )
        self.scheduler.remember_poison(entry, answer)
        self.sends.reply(session, answer)

    def _warn_recent_direct(self, handle: WorkerHandle) -> None:
        """A worker died: a result it sent straight to a client just before may not have left
        the process. Tell those clients; one still waiting for it runs the task again."""
        horizon = time.monotonic() - MAYBE_LOST_S
        for when, sid, task_id, plan_version in handle.take_recent_direct():
            session = self.scheduler.sessions.get(sid)
            if when < horizon or session is None:
                continue
            self.sends.reply(
                session,
                ErrorMsg(
                    message="the worker that sent this result died just after; if it did not "
                    "arrive, run the task again",
                    kind="maybe_lost",
                    session=sid,
                    task_id=task_id,
                    plan_version=plan_version,
                ),
            )

    def busy(self) -> int:
        return sum(1 for w in self.pool.workers.values() if w.tasks)
