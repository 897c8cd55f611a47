"""A worker process: builds its dataset from the spec, then turns TASKs into RESULTs.

Started by the front as ``python -m dataserver.server.worker.worker`` (a fresh interpreter:
never forked from a process that may hold CUDA, never handed a pickle), with
``CUDA_VISIBLE_DEVICES=""``, SIGINT and SIGTERM ignored (the front decides when workers
stop: Slurm, systemd and ``kill -- -PGID`` signal a server's whole process tree, and a
draining server must still finish what its workers run) and a parent-death signal so that
it never outlives its front.

A TASK is a run of output images of one batch. Each source comes from the server's store
(decoded and fitted once, shared by every worker, epoch and job) or is made and stored;
then every image is composed straight into the canvas its frames are sent from
(``compose.py``). Control values arrive once per change (CONTROL, forwarded by the front
before the first task that needs them), not in every task.

Before it runs a task it writes the task's key into a small shared file the front reads if
this process dies (``running.py``), so only the task it was running is blamed. If it cannot
start (its dataset fails to build here), it writes the reason for the front and exits 3.

Clients on this host hand it their landing buffers (``dataserver/landing.py``) on a unix
socket beside its ipc result endpoint, polled with the task socket; a task that names one
is composed straight into it, and its seal records written, before the RESULT says so.

Just over the house's ~500 lines (about 520): one worker process's loop, sockets and task
messages, and its ``main``; composing (``compose``), control states (``controls``), direct
results and landings (``direct``, ``landings``) are out already.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import cv2
import msgspec
import zmq

from dataserver.counting import Counts
from dataserver.data.index import MappedIndex, SharedIndex
from dataserver.data.pipeline import Recipe
from dataserver.data.remote import FetchSettings, FetchTally, configure, fetcher_if_used
from dataserver.data.sample import SampleError
from dataserver.data.spec import build_dataset, parse_spec
from dataserver.landing import landing_socket
from dataserver.loop import MessageGuard, fault, inject, serve
from dataserver.protocol import (
    Bye,
    Control,
    Done,
    ErrorMsg,
    Message,
    ProtocolError,
    Ready,
    Result,
    Tally,
    Task,
    control_digest,
    decode,
)
from dataserver.security import CLAIM_KEY_ENV, reply_id
from dataserver.server.config import WorkerConfig
from dataserver.server.conns import fd_limit, results_budget
from dataserver.server.counts import Reject, WorkerCount
from dataserver.server.memory import keep_large_blocks
from dataserver.server.running import RunningSlot
from dataserver.server.store import Store
from dataserver.server.worker.compose import Composer, TaskClock
from dataserver.server.worker.controls import ControlMissing, ControlStates
from dataserver.server.worker.direct import DirectResults
from dataserver.server.worker.landings import Landings

log = logging.getLogger("dataserver.worker")

PR_SET_PDEATHSIG = 1
EXIT_START_FAILED = 3
POLL_MS = 1000  # the longest the loop waits before it looks at its stop event again
TALLY_S = 1.0  # the front is told of dropped result connections at most this often


def _die_with_parent(parent_pid: int) -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except OSError:  # not Linux: the front's shutdown still reaps us
        return
    if os.getppid() != parent_pid:  # the front died before prctl took effect
        os._exit(1)


class Worker:
    """One worker: a DEALER connected to the front's backend ROUTER, and (for the direct
    result path) a ROUTER that clients connect to."""

    def __init__(
        self,
        config: WorkerConfig,
        dataset: Any,
        store: Store | None = None,
        running: RunningSlot | None = None,
        fresh: Callable[[], Any] | None = None,
    ) -> None:
        """``store``: the server's (None: none, or unusable); ``running``: where it says
        which task it runs; ``fresh``: builds another copy of the dataset (one per set of
        control values)."""
        self.config = config
        self.worker_id = config.worker_id
        self.store_wanted = config.store_fds is not None  # the front gave it a store
        self.dataset = dataset
        self.size = len(dataset)
        self.store = store
        self.running = running
        self.composer = Composer(config.fingerprint, store, running)
        self.counters = Counts(WorkerCount)
        self.controls = ControlStates(dataset, fresh)
        self._current: Task | None = None  # the task being handled
        self._stop = threading.Event()  # BYE came (or ``stop()``)
        self.landings = Landings(self.counters)
        self._next_tally = 0.0  # when the front may next be told of dropped result conns
        self._held: deque[list[Any]] = deque()  # messages taken early (``_look_ahead``)

    def stop(self) -> None:
        """Ask the loop to finish (from any thread); it notices within ``POLL_MS``."""
        self._stop.set()

    def run(self) -> None:
        ctx = zmq.Context(io_threads=1)
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, f"w{self.worker_id}-{os.getpid()}".encode())
        results = None
        config = self.config
        if config.results_bind is not None:
            local = None
            if config.local_results and config.state_dir:
                local = f"ipc://{config.state_dir}/results-{self.worker_id}"
            results = DirectResults(
                ctx,
                config.results_bind,
                config.curve,
                config.max_queued_mb << 20,
                local,
                idle_timeout=config.idle_timeout,
                limit=results_budget(fd_limit(), config.max_sessions),
                # (none: no claim is taken, results come through the front)
                claim_key=bytes.fromhex(os.environ.get(CLAIM_KEY_ENV, "")) or os.urandom(32),
            )
        ready = Ready(
            worker=self.worker_id,
            pid=os.getpid(),
            results=results.endpoint if results is not None else "",
            local=results.local if results is not None else "",
            store=(self.store is not None) if self.store_wanted else None,
            steerable=self.controls.steerable,
        )
        landing = landing_socket(results.local) if results is not None else None
        if landing is not None:
            try:
                self.landings.listen(landing)
            except OSError as exc:  # clients on this host then get their pixels by socket
                log.warning("worker %d: no landing socket at %s: %s", self.worker_id, landing, exc)
        poller = zmq.Poller()
        watched: set[int] = set()
        # A message that raised is counted here and told to the front (on ``sock``).
        guard = MessageGuard(
            log,
            partial(self.counters.count, WorkerCount.INTERNAL),
            report=partial(self._report, sock),
        )

        def start() -> None:
            sock.connect(config.backend)
            sock.send_multipart(ready.encode())
            poller.register(sock, zmq.POLLIN)

        def turn() -> None:
            nonlocal watched
            watched = self._turn(poller, watched, sock, results, guard)

        def close() -> None:
            self.landings.close()
            sock.close(linger=0)
            if results is not None:
                results.close(linger_ms=1000 if self._stop.is_set() else 0)
            ctx.term()

        serve(start, turn, self._stop, close)

    def _turn(
        self,
        poller: zmq.Poller,
        watched: set[int],
        sock: zmq.Socket[Any],
        results: DirectResults | None,
        guard: MessageGuard,
    ) -> set[int]:
        """One turn of the loop: messages from the front, and landing hand-overs (polled
        together, so neither waits for the other; a hand-over that came with a task is
        taken first), waiting at most ``POLL_MS``. Returns the landing fds now watched."""
        fds = set(self.landings.fds())
        for fd in watched - fds:
            poller.unregister(fd)
        for fd in fds - watched:
            poller.register(fd, zmq.POLLIN)
        events = dict(poller.poll(0 if self._held else POLL_MS))
        if results is not None:
            guard.run("worker.claims", results.read_claims)
        self._tally(sock, results)
        for fd in fds & events.keys():
            guard.run("worker.landing", self.landings.on_readable, fd)
        if self._held:  # (taken off the socket early by ``_look_ahead``: next in order)
            frames = self._held.popleft()
        elif sock in events:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return fds
        else:
            return fds
        guard.run("worker.message", self._on_frames, frames, sock, results)
        return fds

    def _look_ahead(self, sock: zmq.Socket[Any]) -> None:
        """Start fetching the next task's objects before this one runs (a dataset in object
        storage: its ``prefetch``): the front gives a worker its next task before this one
        ends (``routing.PIPELINE``); it is taken off the socket now and handled next, in
        order. Not without a fetch cache when there is a store: a source the store holds
        needs no bytes, and without the cache a fetched object would be fetched for nothing."""
        prefetch = getattr(self.dataset, "prefetch", None)
        if prefetch is None or self._held:
            return
        if self.store is not None and self.config.fetch_cache is None:
            return
        try:
            frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return
        self._held.append(frames)
        try:
            msg = decode(frames)
        except ProtocolError:
            return  # (counted when it is handled)
        if isinstance(msg, Task):
            excluded = set(msg.exclude)
            wanted = [i for i in dict.fromkeys(msg.indices) if i not in excluded and i < self.size]
            try:
                prefetch(wanted)
            except Exception as exc:  # (its own error comes when the task reads it)
                log.debug("worker %d: prefetch: %s", self.worker_id, exc)

    def _tally(self, sock: zmq.Socket[Any], results: DirectResults | None) -> None:
        """Tell the front the result connections shut down and what was fetched since the
        last TALLY (at most once a second, and only when there is something to tell)."""
        now = time.monotonic()
        if now < self._next_tally:
            return
        self._next_tally = now + TALLY_S
        dropped = results.conns.take_dropped() if results is not None else {}
        used = fetcher_if_used()
        fetched = used.take_tally() if used is not None else FetchTally()
        if dropped or fetched:
            tally = Tally(
                worker=self.worker_id,
                idle_dropped=dropped.get(Reject.RESULTS_IDLE_DROPPED, 0),
                over_limit_dropped=dropped.get(Reject.RESULTS_OVER_LIMIT_DROPPED, 0),
                unfinished_dropped=dropped.get(Reject.RESULTS_UNFINISHED_DROPPED, 0),
                frames_dropped=dropped.get(Reject.RESULTS_FRAMES_DROPPED, 0),
                barred_dropped=dropped.get(Reject.RESULTS_BARRED_DROPPED, 0),
                claim_dropped=dropped.get(Reject.RESULTS_CLAIM_DROPPED, 0),
                unclaimed_dropped=dropped.get(Reject.RESULTS_UNCLAIMED_DROPPED, 0),
                **fetched.tally_fields(),
            )
            sock.send_multipart(tally.encode(), zmq.NOBLOCK)

    def _report(self, sock: zmq.Socket[Any], site: str, exc: BaseException) -> None:
        """Tell the front a message was dropped (it counts it as internal); when it was a
        task, name it, so the front runs it again (once) instead of waiting for it."""
        text = f"worker {self.worker_id}: {site}: dropped a message: {type(exc).__name__}: {exc}"
        task, self._current = self._current, None
        ids: dict[str, Any] = {}
        if task is not None:
            ids = {
                "session": task.session,
                "task_id": task.task_id,
                "plan_version": task.plan_version,
                "retry": True,
            }
        msg = ErrorMsg(message=text[:4000], kind="internal", **ids)
        sock.send_multipart(msg.encode(), zmq.NOBLOCK)

    # ------------------------------------------------------------ messages

    def _on_frames(
        self, frames: list[Any], sock: zmq.Socket[Any], results: DirectResults | None
    ) -> None:
        try:
            msg = decode(frames)
        except ProtocolError as exc:
            self.counters.count(WorkerCount.MALFORMED)
            log.error("worker %d: dropped a bad message from the front: %s", self.worker_id, exc)
            return
        if isinstance(msg, Control):
            self.controls.learn(msg.session, msg.control_seq, msg.control)
            return
        if isinstance(msg, Bye):
            self.stop()
            return
        if not isinstance(msg, Task):
            return
        self._current = msg  # named in the report if what follows raises
        self._look_ahead(sock)
        inject("worker.task")
        out = self._run_guarded(msg)
        if isinstance(out, Result) and out.landed:
            self.counters.count(WorkerCount.RESULTS_LANDED)
        if isinstance(out, Result) and results is not None and msg.auth is not None:
            sent = results.send(out, reply_id(msg.auth))
            if sent is True:
                done = Done(
                    session=out.session,
                    task_id=out.task_id,
                    plan_version=out.plan_version,
                    decoded=out.decoded,
                    samples=sum(len(i) for i in out.images),
                    images=len(out.images),
                    task_us=out.task_us,
                    decode_us=out.decode_us,
                )
                sock.send_multipart(done.encode())
                self._current = None
                return
            if isinstance(sent, str):  # over a cap: the client is told, and asks again
                self.counters.count(WorkerCount.RESULTS_DROPPED)
                out = ErrorMsg(
                    message=f"result not sent: {sent} (--max-queued-mb)",
                    kind="dropped",
                    session=msg.session,
                    task_id=msg.task_id,
                    plan_version=msg.plan_version,
                )
        sock.send_multipart(out.encode(), copy=False)
        self._current = None

    def _run_guarded(self, task: Task) -> Message:
        """``run_task`` with the running slot set: if this process dies now, the front
        blames this task and no other."""
        if self.running is not None:
            self.running.set(task.session, task.task_id)
        try:
            return self.run_task(task)
        finally:
            if self.running is not None:
                self.running.clear()

    def _control_digest(self, ckey: str, values: dict[str, Any]) -> bytes:
        """The digest of the control values a task is composed with (``control_digest``),
        empty when its dataset consults none (its pixels do not depend on them)."""
        if not self.controls.wants_values:
            return b""
        return bytes.fromhex(ckey) if ckey else control_digest(values)

    def run_task(self, task: Task) -> Message:
        """Run one TASK; return its RESULT or ERROR (never raises)."""
        clock = TaskClock()
        ids: dict[str, Any] = {
            "session": task.session,
            "task_id": task.task_id,
            "plan_version": task.plan_version,
        }
        bad = [i for i in task.indices if i >= self.size]
        if bad:
            msg = f"index {bad[0]} out of range: the dataset has {self.size} samples"
            return ErrorMsg(message=msg, kind="request", index=bad[0], **ids)
        try:
            dataset, ckey, values = self.controls.for_task(
                task.session, task.control_seq, task.control
            )
        except ControlMissing as exc:
            return ErrorMsg(message=str(exc), kind="control_missing", **ids)
        except Exception as exc:
            msg = f"dataset.set_control raised {type(exc).__name__}: {exc}"
            return ErrorMsg(message=msg[:4000], kind="control", **ids)
        used = self._control_digest(ckey, values)
        if used and task.control_digest and task.control_digest != used:
            # Not the values the client composes this task with (a CONTROL changed on the
            # way: issue 40 item 6): composing it would give other pixels under its name.
            self.counters.count(WorkerCount.CONTROL_MISMATCH)
            msg = (
                f"task {task.task_id}: its control values (digest {task.control_digest.hex()}) "
                f"are not those this server holds for control_seq {task.control_seq} "
                f"(digest {used.hex()}): changed on the way"
            )
            return ErrorMsg(message=msg, kind="control_mismatch", **ids)
        said = {**ids, "control_digest": used} if used else ids  # (what its RESULT says)
        sizes = task.sizes
        recipe = Recipe(
            task.seed,
            task.epoch,
            task.step,
            task.mode,
            sizes,
            values,
            task.pad_value,
            task.letterbox,
            bool(task.partners),
            task.fit,
            bool(task.augment),
        )
        shape = (len(task.images), 3, *sizes.out)
        try:
            with self.landings.target(
                task.session,
                task.land_token,
                task.land_region,
                task.land_gen,
                task.land_offset,
                shape,
                task,
            ) as dest:
                if dest is None:
                    return self.composer.compose(task, dataset, ckey, recipe, said, None, clock)
                if fault("worker.lie_landed"):  # tests: claim it landed, write nothing
                    result = self.composer.compose(task, dataset, ckey, recipe, said, None, clock)
                    return msgspec.structs.replace(result, pixels=None, landed=True)
                result = self.composer.compose(
                    task, dataset, ckey, recipe, said, dest.pixels, clock
                )
                dest.seal(task.task_id)  # composed: the client may now believe "landed"
                return result
        except SampleError as exc:
            return ErrorMsg(
                message=str(exc)[:4000], kind="sample", index=exc.index, file=exc.file, **ids
            )
        except Exception as exc:
            log.exception("worker %d: task %d failed", self.worker_id, task.task_id)
            msg = f"worker error on indices {list(task.indices)}: {type(exc).__name__}: {exc}"
            return ErrorMsg(message=msg[:4000], kind="internal", **ids)


def _start_failed(state_dir: str | None, slot: int, exc: BaseException) -> int:
    """Tell the front, in one line, why this worker cannot start; exit status 3."""
    line = f"{type(exc).__name__}: {exc}".replace("\n", " ")[:2000]
    log.error("worker %d cannot start: %s", slot, line, exc_info=True)
    if state_dir:
        try:
            Path(state_dir, f"worker-{slot}.err").write_text(line)
        except OSError:
            pass
    return EXIT_START_FAILED


def inherited_store(fds: tuple[int, int] | None, capacity: int, slot: int) -> Store | None:
    """The store whose memfds (index, arena) the front passed down, checked; None when
    there is none or it is unusable (logged: this worker serves without it, and its READY
    says so). Never an exit: a worker that could not start would be replaced, and fail
    the same way, in a loop."""
    if fds is None:
        return None
    index_fd, arena_fd = fds
    try:
        store = Store.attach(index_fd, arena_fd, capacity, populate=True)
    except (OSError, ValueError) as exc:
        log.error("worker %d: the server's store is unusable (%s); serving without", slot, exc)
        store = None
    for fd in (index_fd, arena_fd):  # its handle has its own descriptors
        try:
            os.close(fd)
        except OSError:
            pass
    return store


def main(argv: list[str] | None = None) -> int:
    """``python -m dataserver.server.worker.worker CONFIG``: CONFIG is a ``WorkerConfig`` as JSON
    (what the front's pool writes), or its fields as flags (``WorkerConfig.from_argv``)."""
    config = WorkerConfig.from_argv(sys.argv[1:] if argv is None else argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the front drains; see the docstring
    _die_with_parent(config.parent_pid)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    keep_large_blocks()
    cv2.setNumThreads(1)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")

    configure(
        FetchSettings(
            cache_dir=config.fetch_cache,
            cache_where=config.fetch_where,
            cache_bytes=config.fetch_cache_bytes,
            share=(config.worker_id, max(1, config.fetch_slots)),
            max_fetches=config.max_fetches,
            prefetch=not config.front_fetches,
            mem_fds=config.fetch_mem_fds,
            marks_dir=os.path.join(config.state_dir, "fetching")
            if config.front_fetches and config.state_dir
            else None,
        )
    )
    index: MappedIndex | None = None

    def build() -> Any:
        return build_dataset(parse_spec(config.dataset, config.dataset_args), index)

    try:
        if config.index_fd is not None:  # the server's index: mapped, never parsed here
            index = SharedIndex.attach(config.index_fd, config.index_bytes).mapped
        dataset = build()
        len(dataset)
    except Exception as exc:
        return _start_failed(config.state_dir, config.worker_id, exc)
    running = RunningSlot.open(config.state_dir, config.worker_id) if config.state_dir else None
    store = inherited_store(config.store_fds, config.store_bytes, config.worker_id)
    Worker(config, dataset, store, running, fresh=build).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
