"""The worker processes of one server: start, watch, replace, stop.

Workers are fresh interpreters (``subprocess``, not fork or multiprocessing's pickling
spawn), in their own process group so that a terminal's Ctrl-C reaches only the front,
with ``CUDA_VISIBLE_DEVICES=""``. Each has a pidfd (Linux) the front polls, so a death
is noticed at once. Shutdown escalates BYE -> SIGKILL (workers ignore SIGTERM) and logs it. The
store's memfds are passed down (``pass_fds``): the only descriptors a worker inherits
besides its standard streams.
"""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from dataserver.security import CLAIM_KEY_ENV
from dataserver.server.config import WorkerConfig
from dataserver.server.front.sessions import TaskEntry
from dataserver.server.running import RunningSlot

log = logging.getLogger("dataserver.pool")

# Why a start can fail that waiting may cure: no fd (this process's limit or the system's),
# no process slot, no memory for the fork.
SPAWN_RETRY_ERRNOS = (errno.EMFILE, errno.ENFILE, errno.EAGAIN, errno.ENOMEM)
CONTROLS_KEPT = 4096  # sessions whose control values the front remembers a worker has


@dataclass(eq=False)
class WorkerHandle:
    """One worker process, as the front sees it."""

    slot: int
    proc: subprocess.Popen[bytes]
    pidfd: int | None
    started: float
    running: RunningSlot  # the task it runs, readable after it died
    identity: bytes | None = None  # its DEALER's routing id, known once READY arrives
    tasks: deque[TaskEntry] = field(default_factory=deque)  # sent to it, oldest first
    results: str = ""  # the endpoint its clients connect to for direct results
    local: str = ""  # the same, over ipc, for clients on this host
    controls: dict[bytes, int] = field(default_factory=dict)  # session -> control_seq it has
    # (time, session, task_id, plan_version) of results it sent straight to clients lately:
    # if it dies just after, one may not have left the process, so the client is told.
    recent_direct: deque[tuple[float, bytes, int, int]] = field(
        default_factory=lambda: deque(maxlen=64)
    )

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def ready(self) -> bool:
        return self.identity is not None

    def became_ready(self, identity: bytes, results: str, local: str) -> None:
        """Its READY came from the connection ``identity``; clients reach its direct
        results at ``results`` (and ``local``, on this host)."""
        self.identity, self.results, self.local = identity, results, local

    def give(self, entry: TaskEntry) -> None:
        """``entry`` was (about to be) sent to it: it holds it, after those it holds."""
        self.tasks.append(entry)
        entry.hold(self)

    def take_back(self, entry: TaskEntry) -> None:
        """``entry`` never reached it (the send failed)."""
        self.tasks.remove(entry)
        entry.release()

    def answered(
        self, session: bytes | None, task_id: int | None
    ) -> tuple[list[TaskEntry], TaskEntry] | None:
        """It answered ``task_id`` of ``session``: (the entries given before it, whose
        answers were lost, and the answered entry), all no longer held; None when it holds
        no such task. (A worker runs its tasks in order; a task asked again may be held
        twice: the later is the one answered.)"""
        found = None
        for i, entry in enumerate(self.tasks):
            if entry.task_id == task_id and entry.session == session:
                found = i
        if found is None:
            return None
        lost = [self.tasks.popleft() for _ in range(found)]
        entry = self.tasks.popleft()
        for e in (*lost, entry):
            e.release()
        return lost, entry

    def drop_all(self) -> list[TaskEntry]:
        """It died: every entry it held, oldest first, no longer held."""
        entries = list(self.tasks)
        self.tasks.clear()
        for entry in entries:
            entry.release()
        return entries

    def has_control(self, session: bytes, control_seq: int) -> bool:
        """Whether it was sent ``session``'s control values of ``control_seq``."""
        return self.controls.get(session) == control_seq

    def learned_control(self, session: bytes, control_seq: int) -> None:
        """It was sent ``session``'s values of ``control_seq`` (the oldest of more than
        ``CONTROLS_KEPT`` sessions are forgotten: a worker keeps a bounded number too)."""
        self.controls[session] = control_seq
        if len(self.controls) > CONTROLS_KEPT:
            self.controls.pop(next(iter(self.controls)))

    def forgot_control(self, session: bytes) -> None:
        """It said it lacks ``session``'s values: send them again before its next task."""
        self.controls.pop(session, None)

    def sent_direct(self, session: bytes, task_id: int, plan_version: int) -> None:
        """It sent a result straight to its client (DONE came)."""
        self.recent_direct.append((time.monotonic(), session, task_id, plan_version))

    def take_recent_direct(self) -> list[tuple[float, bytes, int, int]]:
        """The direct results it sent lately, forgotten here (it died)."""
        recent = list(self.recent_direct)
        self.recent_direct.clear()
        return recent


class WorkerPool:
    """Starts ``count`` workers for ``backend`` and replaces those that die."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config  # what each worker is told (``for_slot`` fills in the slot)
        # What the workers tag admitted sessions' claims with (``security.claim_tag``),
        # given in their environment (a command line is anyone's to read).
        self.claim_key = os.urandom(32)
        self.backend = config.backend
        self.state_dir = config.state_dir
        self.workers: dict[int, WorkerHandle] = {}  # by slot
        self.started_total = 0
        self.membership = 0  # bumped whenever a worker is added or removed
        self.ever_ready = False
        self._early_deaths: dict[int, int] = {}  # slot -> consecutive deaths before READY
        self._start_errors: dict[int, str] = {}  # slot -> why its last start failed
        self._slots: dict[int, RunningSlot] = {}
        self.spawn_failures = 0  # starts that failed for want of fds or processes
        self._spawn_fails: dict[int, int] = {}  # slot -> such failures in a row
        self._retry_at: dict[int, float] = {}  # slot -> when to try starting it again

    def spawn(self, slot: int) -> WorkerHandle | None:
        """Start the worker of ``slot``. Out of file descriptors or processes (``EMFILE``,
        ``ENFILE``, ``EAGAIN``, ``ENOMEM``), it logs, counts ``spawn_failures`` and returns
        None: ``retry_due`` tries again later, backing off (0.25 s doubling up to 10 s)."""
        try:
            return self._spawn(slot)
        except OSError as exc:
            if exc.errno not in SPAWN_RETRY_ERRNOS:
                raise
            self.spawn_failures += 1
            n = self._spawn_fails.get(slot, 0) + 1
            self._spawn_fails[slot] = n
            delay = min(10.0, 0.25 * 2 ** (n - 1))
            self._retry_at[slot] = time.monotonic() + delay
            log.error(
                "cannot start worker %d: %s (%s; %d time(s) in a row); trying again in %.2g s",
                slot,
                exc.strerror or exc,
                errno.errorcode.get(exc.errno or 0, "?"),
                n,
                delay,
            )
            return None

    def retry_due(self, now: float) -> None:
        """Start the workers whose start failed for want of resources, once it is time."""
        for slot, when in list(self._retry_at.items()):
            if slot in self.workers:  # started meanwhile
                del self._retry_at[slot]
            elif now >= when:
                del self._retry_at[slot]
                if self.spawn(slot) is not None:
                    self._spawn_fails.pop(slot, None)
                    log.warning("worker %d started after all", slot)

    def _spawn(self, slot: int) -> WorkerHandle:
        config = self.config.for_slot(slot, os.getpid())
        cmd = [sys.executable, "-m", "dataserver.server.worker.worker", config.to_json()]
        # The store's memfds keep their numbers in the worker (the only fds it inherits).
        pass_fds = (
            *(config.store_fds or ()),
            *(() if config.index_fd is None else (config.index_fd,)),
            *(config.fetch_mem_fds or ()),
        )
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
        env[CLAIM_KEY_ENV] = self.claim_key.hex()
        running = self._slots.get(slot)
        if running is None:
            running = self._slots[slot] = RunningSlot.open(self.state_dir, slot)
        running.clear()
        self._error_file(slot).unlink(missing_ok=True)
        proc = subprocess.Popen(
            cmd, env=env, stdin=subprocess.DEVNULL, process_group=0, pass_fds=pass_fds
        )
        try:
            pidfd: int | None = os.pidfd_open(proc.pid)
        except (AttributeError, OSError):
            pidfd = None
        handle = WorkerHandle(slot, proc, pidfd, time.monotonic(), running)
        self.workers[slot] = handle
        self.started_total += 1
        self.membership += 1
        log.info("started worker %d (pid %d)", slot, proc.pid)
        return handle

    def _error_file(self, slot: int) -> Path:
        return Path(self.state_dir) / f"worker-{slot}.err"

    def starting(self, pid: int) -> WorkerHandle | None:
        """The worker of ``pid`` that has not said READY yet, if there is one."""
        return next((w for w in self.workers.values() if w.pid == pid and not w.ready), None)

    def mark_ready(self, handle: WorkerHandle) -> None:
        self.ever_ready = True
        self._early_deaths.pop(handle.slot, None)

    def startup_failure(self, limit: int = 2) -> str | None:
        """While no worker ever started: why, once some slot failed ``limit`` times in a row."""
        if self.ever_ready:
            return None
        for slot, n in self._early_deaths.items():
            if n >= limit:
                why = self._start_errors.get(slot) or "it exited before it was ready"
                return f"worker {slot} failed to start ({n} times): {why}"
        return None

    def start(self, count: int) -> None:
        for slot in range(count):
            self.spawn(slot)

    def by_pidfd(self) -> dict[int, WorkerHandle]:
        return {w.pidfd: w for w in self.workers.values() if w.pidfd is not None}

    def dead(self) -> list[WorkerHandle]:
        """Workers whose process has exited (reaped)."""
        return [w for w in self.workers.values() if w.proc.poll() is not None]

    def forget(self, handle: WorkerHandle) -> float:
        """Drop a dead worker; return how long to wait before replacing it (crash-loop backoff)."""
        self.membership += 1
        if handle.pidfd is not None:
            os.close(handle.pidfd)
            handle.pidfd = None
        self.workers.pop(handle.slot, None)
        if handle.ready:
            self._early_deaths.pop(handle.slot, None)
            return 0.0
        n = self._early_deaths.get(handle.slot, 0) + 1
        self._early_deaths[handle.slot] = n
        try:
            why = self._error_file(handle.slot).read_text().strip()
        except OSError:
            why = f"exit status {handle.proc.returncode}"
        self._start_errors[handle.slot] = why
        log.error(
            "worker %d (pid %d) exited before it was ready (%d time(s) in a row): %s",
            handle.slot,
            handle.pid,
            n,
            why,
        )
        return min(10.0, 0.5 * 2 ** (n - 1))

    def alive(self) -> int:
        return sum(1 for w in self.workers.values() if w.proc.poll() is None)

    def stop(self, timeout: float = 3.0) -> None:
        """Wait for workers that were told BYE, then SIGKILL the rest (they ignore SIGTERM)."""
        procs = [w.proc for w in self.workers.values()]
        deadline = time.monotonic() + timeout
        for p in procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        left = [p for p in procs if p.poll() is None]
        if left:
            log.info("killing %d worker(s) that did not exit", len(left))
            for p in left:
                p.kill()
            for p in left:
                p.wait()
        for w in self.workers.values():
            if w.pidfd is not None:
                os.close(w.pidfd)
                w.pidfd = None
        self.workers.clear()
        for running in self._slots.values():
            running.close()
        self._slots.clear()
