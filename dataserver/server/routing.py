"""The workers' side of the front: READY, results and DONE notices, dispatch of queued
tasks to the least loaded workers, and what a worker's death does to its tasks.

A mixin of ``Front`` (front.py): it shares the front's state and runs in its one thread.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

from dataserver import protocol
from dataserver.protocol import Message, MsgType, ProtocolError
from dataserver.server.pool import WorkerHandle, WorkerPool
from dataserver.server.sessions import Scheduler, TaskEntry

if TYPE_CHECKING:
    import zmq

log = logging.getLogger("dataserver.front")

PIPELINE = 2  # tasks a worker holds at once: the one it runs and the next


class WorkerRouting:
    """Routes tasks to worker processes and their answers back to sessions."""

    if TYPE_CHECKING:
        pool: WorkerPool
        scheduler: Scheduler
        counters: Counter[str]
        rejected: Counter[str]
        data: zmq.Socket[Any]
        backend: zmq.Socket[Any]
        _by_identity: dict[bytes, WorkerHandle]
        _ready: list[WorkerHandle]
        _respawn_at: dict[int, float]
        _stop: bool

        def _send(self, sock: zmq.Socket[Any], identity: bytes, frames: list[Any]) -> bool: ...
        def _reply(self, identity: bytes, mtype: MsgType, header: dict[str, Any]) -> None: ...
        def _cancel(self, session: Any, entries: list[TaskEntry]) -> None: ...

    def _on_backend(self, frames: list[Any]) -> None:
        identity = frames[0].bytes
        try:
            # Workers are this server's own children: read their headers, forward their
            # arrays untouched (the client checks them), instead of decoding every result.
            mtype, header = protocol.peek(frames[1:])
        except ProtocolError as exc:
            log.error("bad message from worker %r: %s", identity, exc)
            self.rejected["worker_malformed"] += 1
            return
        if mtype is MsgType.READY:
            self._on_ready_worker(identity, protocol.decode(frames[1:]))
            return
        handle = self._by_identity.get(identity)
        if (
            handle is None
            or not handle.tasks
            or mtype not in (MsgType.RESULT, MsgType.ERROR, MsgType.DONE)
        ):
            self.rejected["worker_unexpected"] += 1
            return
        entry = next((e for e in handle.tasks if e.task_id == header.get("task_id")), None)
        if entry is None:
            log.error(
                "worker %d answered task %s it was not given",
                handle.slot,
                header.get("task_id"),
            )
            self.rejected["worker_unexpected"] += 1
            return
        handle.tasks.remove(entry)
        session = self.scheduler.sessions.get(entry.session)
        ok = mtype is not MsgType.ERROR
        self.counters["tasks_done" if ok else "tasks_failed"] += 1
        decoded = header.get("decoded")
        if isinstance(decoded, int) and ok:
            samples = header.get("samples", len(header.get("indices", ())))
            self.counters["sources_decoded"] += decoded
            self.counters["sources_reused"] += int(samples) - decoded
        if mtype is MsgType.DONE:  # the worker sent the RESULT straight to the client
            self.counters["results_direct"] += 1
            handle.recent_direct.append(
                (time.monotonic(), entry.session, entry.task_id, entry.plan_version)
            )
            return
        if session is None:
            self.counters["results_orphaned"] += 1
            return
        if self._send(self.data, session.identity, frames[1:]):
            self.counters["results_sent"] += 1
            if ok:
                self.counters["results_via_front"] += 1

    def _on_ready_worker(self, identity: bytes, msg: Message) -> None:
        pid = msg.header["pid"]
        for handle in self.pool.workers.values():
            if handle.pid == pid and handle.identity is None:
                handle.identity = identity
                results = msg.header.get("results")
                handle.results = results if isinstance(results, str) else ""
                self._by_identity[identity] = handle
                self._ready.append(handle)
                return
        log.warning("READY from unknown worker pid %d", pid)

    def _dispatch(self) -> None:
        """Give queued tasks to the least loaded live workers, up to PIPELINE each.

        A worker holds the task it runs and the next one, so it never waits for this
        loop to be scheduled (on a busy machine, that wait is what idles workers)."""
        if not self.scheduler.queued:
            return
        for depth in range(PIPELINE):
            for handle in self._ready:
                if len(handle.tasks) > depth or not self.scheduler.queued:
                    continue
                entry = self._next_entry()
                if entry is None:
                    return
                handle.tasks.append(entry)
                if not self._send(self.backend, handle.identity or b"", entry.frames):
                    handle.tasks.remove(entry)
                    session = self.scheduler.sessions.get(entry.session)
                    if session is not None:
                        self.scheduler.push(session, entry, front=True)
                    return

    def _next_entry(self) -> TaskEntry | None:
        """The next queued task that is still wanted (older plans are answered CANCELLED)."""
        while (entry := self.scheduler.pop()) is not None:
            session = self.scheduler.sessions.get(entry.session)
            if session is None:
                continue
            if entry.plan_version < session.version:
                self._cancel(session, [entry])
                continue
            return entry
        return None

    def _reap(self) -> None:
        for handle in self.pool.dead():
            self._on_worker_death(handle)
        now = time.monotonic()
        for slot, when in list(self._respawn_at.items()):
            if now >= when and not self._stop:
                del self._respawn_at[slot]
                self.pool.spawn(slot)

    def _on_worker_death(self, handle: WorkerHandle) -> None:
        code = handle.proc.returncode
        log.warning(
            "worker %d (pid %d) died (exit %s); replacing it", handle.slot, handle.pid, code
        )
        self.counters["worker_deaths"] += 1
        delay = self.pool.forget(handle)
        self._respawn_at[handle.slot] = time.monotonic() + delay
        if handle.identity is not None:
            self._by_identity.pop(handle.identity, None)
        if handle in self._ready:
            self._ready.remove(handle)
        self._warn_recent_direct(handle)
        entries = list(handle.tasks)
        handle.tasks.clear()
        if not entries:
            return
        # Only the first was running; the others waited in its socket and are not to blame.
        entry = entries[0]
        entry.attempts += 1
        for waiting in reversed(entries[1:]):
            owner = self.scheduler.sessions.get(waiting.session)
            if owner is not None:
                self.scheduler.push(owner, waiting, front=True)
        session = self.scheduler.sessions.get(entry.session)
        if session is None:
            return
        if entry.attempts < 2:
            self.counters["tasks_retried"] += 1
            self.scheduler.push(session, entry, front=True)
            return
        self.counters["tasks_poisoned"] += 1
        how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        names = entry.indices[0] if len(entry.indices) == 1 else entry.indices
        header = {
            "session": entry.session,
            "task_id": entry.task_id,
            "plan_version": entry.plan_version,
            "indices": entry.indices,
            "kind": "poison",
            "message": f"sample {names} killed {entry.attempts} worker processes "
            f"(last: {how}); not retried",
        }
        if len(entry.indices) == 1:
            header["index"] = entry.indices[0]
        self._reply(session.identity, MsgType.ERROR, header)

    def _warn_recent_direct(self, handle: WorkerHandle) -> None:
        """A worker died: a result it sent straight to a client just before may not have left
        the process. Tell those clients; one still waiting for it runs the task again."""
        horizon = time.monotonic() - 10.0
        for when, sid, task_id, plan_version in handle.recent_direct:
            session = self.scheduler.sessions.get(sid)
            if when < horizon or session is None:
                continue
            header = {
                "session": sid,
                "task_id": task_id,
                "plan_version": plan_version,
                "kind": "maybe_lost",
                "message": "the worker that sent this result died just after; if it did not "
                "arrive, run the task again",
            }
            self._reply(session.identity, MsgType.ERROR, header)
        handle.recent_direct.clear()
