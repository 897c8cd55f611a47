"""``dataserver bench --only scale``: what bounds a job of many ranks, measured on one host.

Three measurements, each of one part alone, for the paper model of a large job
(docs/DESIGN-NOTES.md, "Scale model: 1,000 ranks"). One real ``dataserver serve`` serves
all three: ``simulated`` samples that cost nothing (ms=0, 8x8), ``--workers
--scale-workers``, ``--cache-gb 0`` (the workers do less; they are not what is measured)
and ``--no-local-results`` (results over TCP, as to another host and from the fakes).

(a) ``front``: the server's front under ``--scale-clients`` lightweight sessions
    (``swarm``: raw pyzmq DEALERs speaking HELLO / TASK / HEARTBEAT with
    ``dataserver.protocol``'s messages and a secret from ``dataserver.security``), each
    keeping 4 one-image tasks outstanding: the front's CPU per task from ``/proc`` (less its
    CPU with the same sessions only beating), results sent straight to the clients (the
    front sees a DONE) and through the front (it forwards the RESULT). Tasks per core =
    1 / (front CPU per task). On 2 cores the workers, not the front, bound the rate: the
    cost per task is measured below saturation (each message a turn of the loop), an upper
    bound of what a saturated front pays.
(b) ``client``: the real ``DataServerClient``'s CPU per task (its process's CPU / tasks)
    against ``--scale-servers`` fake servers (``fakes``: one process, three sockets a
    server, answering HELLO, HEARTBEAT and TASK with a tiny RESULT sent straight to the
    client's result connection, as a worker does; 16 workers announced, so every batch of
    16 is cut into 16 one-image tasks at any count), and its CPU per second while idle
    (heartbeats, timers). The real server beside a fake with as many workers checks the
    fake.
(c) ``sessions``: the server holding ``--scale-sessions`` sessions, each as a real client
    holds one (a data connection beating at the interval its server tells, a result
    connection to each worker), opened 100 at a time from two processes: file descriptors
    and RSS of the front and a worker before and after, and the front's CPU per second
    with none, with the sessions silent, and beating (per heartbeat it handled).

Roles run in their own processes: ``python -m dataserver.bench.scale swarm|fakes|client``.

Over the house's ~500 lines (about 1,090): a benchmark, not the product; the helper
processes of its three measurements (swarm, fakes, client) run as ``main``s of this one
module.
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import resource
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import zmq

from dataserver.bench.cpu import CpuWindow, cpu_seconds
from dataserver.protocol import (
    Bye,
    Heartbeat,
    Hello,
    MsgType,
    ProtocolError,
    Result,
    Task,
    Welcome,
    decode,
)
from dataserver.protocol.messages import MAX_CATEGORY_NAME
from dataserver.security import CLAIM_S, new_secret, reply_id, session_id

Progress = Callable[[str], None]
ZERO = "dataserver.data.simulated:simulated"
ZERO_ARGS = json.dumps({"n": 4096, "ms": 0, "size": 8})
BEAT_S = 0.5  # what a real client beats at until its server says (ClientConfig.heartbeat_interval)
# A real client's sockets' ZMTP heartbeats (``net.sockets.dealer``): PINGs every 5 s, dropped
# after 15 s without an answer (``--zmtp-ping-ms``: the front connection's PINGs, timeout
# twice that).
ZMTP_FRONT = ((zmq.HEARTBEAT_IVL, 5000), (zmq.HEARTBEAT_TIMEOUT, 15000), (zmq.HEARTBEAT_TTL, 15000))
ZMTP_OTHER = ZMTP_FRONT
BEAT_FLOOR_S, BEAT_CEILING_S = 0.25, 10.0  # the bounds a real client keeps (``beats``)
HELLO_BATCH = 100  # sessions opened at once (a listen backlog is ~100)
SWARM_SESSIONS = 2500  # sessions one swarm process holds at most (c)
SIDE = 8  # output images of the swarm's tasks: 8 x 8


def _raise_fd_limit(want: int = 0) -> None:
    """The soft limit up to the hard one; as root, both up to ``want`` when that is more
    (1,024 fake servers and a client against them hold ~10,000 descriptors each)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if os.geteuid() == 0 and hard != resource.RLIM_INFINITY and want > hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, want))
            return
        except (ValueError, OSError):
            pass
    if hard == resource.RLIM_INFINITY or soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _raise_hard_fd_limit(want: int) -> tuple[int, bool]:
    """The bench alone, as root: raise this process's hard fd limit to ``want`` (at most
    ``/proc/sys/fs/nr_open``), so that the server and the swarms it starts inherit room for
    the sessions measured. (The hard limit after; whether it was raised.)"""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    try:
        with open("/proc/sys/fs/nr_open") as f:
            want = min(want, int(f.read()))
    except (OSError, ValueError):
        pass
    if hard == resource.RLIM_INFINITY or hard >= want or os.geteuid() != 0:
        return int(hard), False
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, want))
    except (ValueError, OSError):
        return int(hard), False
    return want, True


def _kind(frames: list[Any], at: int = 1) -> int:
    """The message type byte of a message whose frame ``at`` is the type frame (0: none)."""
    if len(frames) <= at:
        return 0
    raw = frames[at].bytes if hasattr(frames[at], "bytes") else bytes(frames[at])
    return raw[0] if len(raw) == 1 else 0


# ============================================================================ (a), (c): swarm


@dataclass(eq=False)
class _Session:
    """One lightweight session: what a real client holds on one server."""

    sid: bytes
    secret: bytes
    data: zmq.Socket[Any]
    results: zmq.Socket[Any] | None = None
    welcomed: bool = False
    credit: int = 0
    outstanding: int = 0
    beat_s: float = BEAT_S  # as its server says (WELCOME, heartbeat replies), within bounds
    claimed: float = 0.0  # when it last claimed its results (``security.CLAIM_S``)
    tag: bytes = b""  # what its claims carry: WELCOME's ``claim`` (the front's tag)

    def claim(self, now: float) -> None:
        """Claim its results, as a real client does on each worker connection every
        ``CLAIM_S`` (a worker shuts down one unclaimed for long: churn that is no part of
        the figure)."""
        if self.results is None or now - self.claimed <= CLAIM_S:
            return
        self.claimed = now
        try:
            self.results.send_multipart(
                Hello(session=self.sid, auth=self.secret, claim=self.tag).encode(), zmq.NOBLOCK
            )
        except zmq.Again:
            pass

    def paced(self, ms: int) -> None:
        if ms and BEAT_FLOOR_S <= ms / 1000 <= BEAT_CEILING_S:
            self.beat_s = ms / 1000


@dataclass
class _SwarmConfig:
    address: str
    sessions: int
    depth: int  # tasks each session keeps outstanding (0: it only beats)
    direct: bool  # results straight from the workers (a result connection to each)


@dataclass
class _Swarm:
    """``sessions`` sessions on one server, polled in one loop."""

    cfg: _SwarmConfig
    ctx: zmq.Context[Any]
    sessions: list[_Session] = field(default_factory=list)
    by_sock: dict[Any, _Session] = field(default_factory=dict)
    beats: list[tuple[float, int, _Session]] = field(default_factory=list)  # a heap
    counts: Counter[str] = field(default_factory=Counter)
    poller: zmq.Poller = field(default_factory=zmq.Poller)
    next_id: int = 0
    beating: bool = True
    tasking: bool = True
    template: Task | None = None
    ping_ms: int = ZMTP_FRONT[0][1]  # its front connections' ZMTP PINGs (a real client's: 5 s)

    def open(self, n: int) -> None:
        for _ in range(n):
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            for option, value in ZMTP_FRONT:
                sock.setsockopt(option, value)
            if self.ping_ms != ZMTP_FRONT[0][1]:  # (an experiment: faster PINGs)
                sock.setsockopt(zmq.HEARTBEAT_IVL, self.ping_ms)
                sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 2 * self.ping_ms)
            sock.connect(self.cfg.address)
            s = _Session(session_id(), new_secret(), sock)
            self.sessions.append(s)
            self.by_sock[sock] = s
            self.poller.register(sock, zmq.POLLIN)
            sock.send_multipart(Hello(session=s.sid, auth=s.secret).encode())

    def welcome(self, s: _Session, msg: Welcome) -> None:
        if s.welcomed:
            return
        s.welcomed, s.credit, s.tag = True, msg.credit, msg.claim
        s.paced(getattr(msg, "heartbeat_ms", 0))  # (an older server: nothing said)
        self.counts["welcomed"] += 1
        if self.cfg.direct and msg.results:
            s.results = self.ctx.socket(zmq.DEALER)
            s.results.setsockopt(zmq.LINGER, 0)
            for option, value in ZMTP_OTHER:
                s.results.setsockopt(option, value)
            s.results.setsockopt(zmq.ROUTING_ID, reply_id(s.secret))
            for endpoint in msg.results:
                s.results.connect(endpoint)
            if self.cfg.depth:  # (no tasks: nothing ever comes on it)
                self.by_sock[s.results] = s
                self.poller.register(s.results, zmq.POLLIN)
        self._due(time.monotonic() + s.beat_s, s)

    def _due(self, when: float, s: _Session) -> None:
        self.next_id += 1
        heapq.heappush(self.beats, (when, self.next_id, s))

    def task(self, s: _Session) -> None:
        assert self.template is not None
        self.next_id += 1
        t = msgspec.structs.replace(
            self.template,
            session=s.sid,
            auth=s.secret,
            task_id=self.next_id,
            images=((self.next_id % 4096,),),
        )
        s.data.send_multipart(t.encode(), copy=False)
        s.outstanding += 1

    def fill(self, s: _Session) -> None:
        want = min(self.cfg.depth, s.credit) if self.tasking else 0
        while s.welcomed and s.outstanding < want:
            self.task(s)

    def on_message(self, s: _Session, frames: list[Any]) -> None:
        kind = _kind(frames, 1)
        if kind == MsgType.RESULT:
            self.counts["results"] += 1
            s.outstanding -= 1
            self.fill(s)
        elif kind == MsgType.HEARTBEAT:
            self.counts["beats_answered"] += 1
            try:
                beat = decode(frames)
            except ProtocolError:
                self.counts["malformed"] += 1
                return
            if isinstance(beat, Heartbeat):
                s.paced(getattr(beat, "heartbeat_ms", 0))
        elif kind == MsgType.WELCOME:
            try:
                msg = decode(frames)
            except ProtocolError:
                self.counts["malformed"] += 1
                return
            if isinstance(msg, Welcome):
                self.welcome(s, msg)
                self.fill(s)
        else:
            self.on_other(s, frames, kind)

    def on_other(self, s: _Session, frames: list[Any], kind: int) -> None:
        """ERROR (a refused HELLO or task), CANCELLED, BYE: counted; a task's credit back."""
        try:
            name = MsgType(kind).name.lower()
        except ValueError:
            name = "unknown"
        self.counts[name] += 1
        if kind in (MsgType.ERROR, MsgType.CANCELLED) and s.welcomed and s.outstanding:
            s.outstanding -= 1
            self.fill(s)

    def beat(self, now: float) -> None:
        while self.beats and self.beats[0][0] <= now:
            _, _, s = heapq.heappop(self.beats)
            if self.beating:
                hb = Heartbeat(session=s.sid, auth=s.secret).encode()
                s.data.send_multipart(hb)
                self.counts["beats"] += 1
            s.claim(now)
            self._due(now + s.beat_s, s)

    def turn(self, timeout_ms: int) -> None:
        for sock, _ in self.poller.poll(timeout_ms):
            s = self.by_sock[sock]
            for _ in range(256):
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self.on_message(s, frames)
        self.beat(time.monotonic())

    def open_all(self, deadline: float) -> None:
        """Open the sessions ``HELLO_BATCH`` at a time, each batch once the last is welcomed
        (HELLOs are sent again every second until a WELCOME comes)."""
        while len(self.sessions) < self.cfg.sessions and time.monotonic() < deadline:
            self.open(min(HELLO_BATCH, self.cfg.sessions - len(self.sessions)))
            asked = time.monotonic()
            while self.counts["welcomed"] < len(self.sessions) and time.monotonic() < deadline:
                self.turn(20)
                if time.monotonic() - asked > 1.0:
                    asked = time.monotonic()
                    for s in self.sessions:
                        if not s.welcomed:
                            s.data.send_multipart(Hello(session=s.sid, auth=s.secret).encode())

    def close(self) -> None:
        """BYE on every session (as a real client's close), then the sockets."""
        for s in self.sessions:
            if s.welcomed:
                s.data.send_multipart(Bye(session=s.sid, auth=s.secret).encode())
            s.data.close(linger=500)
            if s.results is not None:
                s.results.close(linger=0)


def _task_template() -> Task:
    return Task(
        session=b"x",
        task_id=0,
        plan_version=0,
        epoch=0,
        seed=0,
        images=((0,),),
        grid=1,
        out_hw=(SIDE, SIDE),
        fit_hw=(SIDE, SIDE),
        on_error="skip",
        control_seq=0,
    )


def swarm_main(argv: list[str]) -> int:
    """Open the sessions, print ``{"ready": ...}``, then run until SIGTERM: SIGUSR1 stops or
    starts the heartbeats, SIGUSR2 the tasks, SIGHUP prints the counts (one JSON line)."""
    p = argparse.ArgumentParser(prog="scale swarm")
    p.add_argument("--address", required=True)
    p.add_argument("--sessions", type=int, default=64)
    p.add_argument("--depth", type=int, default=0)
    p.add_argument("--direct", type=int, default=1)
    p.add_argument("--zmtp-ping-ms", type=int, default=ZMTP_FRONT[0][1], help="(front connection)")
    a = p.parse_args(argv)
    _raise_fd_limit()
    ctx: zmq.Context[Any] = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, 4 * a.sessions + 256)
    cfg = _SwarmConfig(a.address, a.sessions, a.depth, bool(a.direct))
    swarm = _Swarm(cfg, ctx, template=_task_template(), ping_ms=a.zmtp_ping_ms)
    flags = {"stop": False, "report": False}

    def on_signal(signum: int, _frame: Any) -> None:
        if signum == signal.SIGHUP:
            flags["report"] = True
        elif signum == signal.SIGUSR1:
            swarm.beating = not swarm.beating
        elif signum == signal.SIGUSR2:
            swarm.tasking = not swarm.tasking
            for s in swarm.sessions:
                swarm.fill(s)
        else:
            flags["stop"] = True

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP):
        signal.signal(sig, on_signal)
    swarm.open_all(time.monotonic() + 120)
    print(json.dumps({"ready": swarm.counts["welcomed"], "counts": swarm.counts}), flush=True)
    while not flags["stop"]:
        swarm.turn(10)
        if flags["report"]:
            flags["report"] = False
            print(json.dumps({"counts": swarm.counts}), flush=True)
    print(json.dumps({"done": True, "counts": swarm.counts}), flush=True)
    swarm.close()
    ctx.term()
    return 0


# ============================================================================ (b): fakes


@dataclass(eq=False)
class _Fake:
    """One fake server: a front ROUTER (HELLO, HEARTBEAT, TASK), a result ROUTER that the
    client's result connection reaches (named by ``reply_id`` of the session's secret, as
    a worker's). A TASK is answered at once with zero pixels, no boxes."""

    front: zmq.Socket[Any]
    results: zmq.Socket[Any]
    workers: int
    server_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    counts: Counter[str] = field(default_factory=Counter)
    categories: tuple[tuple[int, str], ...] = ()  # what its WELCOME announces

    @classmethod
    def bind(
        cls, ctx: zmq.Context[Any], workers: int, categories: tuple[tuple[int, str], ...] = ()
    ) -> _Fake:
        front, results = (ctx.socket(zmq.ROUTER) for _ in range(2))
        for sock in (front, results):
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind("tcp://127.0.0.1:*")
        results.setsockopt(zmq.ROUTER_MANDATORY, 1)
        return cls(front, results, workers, categories=categories)

    @property
    def address(self) -> str:
        return str(self.front.getsockopt_string(zmq.LAST_ENDPOINT))

    def welcome(self, sid: bytes) -> Welcome:
        return Welcome(
            session=sid,
            server_id=self.server_id,
            dataset_len=4096,
            fingerprint="scale-fake",
            workers=self.workers,
            credit=4 * self.workers,  # as a real front: PIPELINE x 2 per worker
            results=(self.results.getsockopt_string(zmq.LAST_ENDPOINT),),
            categories=self.categories,
        )

    def on_front(self, frames: list[Any]) -> None:
        ident = frames[0].bytes
        try:
            msg = decode(frames[1:])
        except ProtocolError:
            self.counts["malformed"] += 1
            return
        if isinstance(msg, Task):
            self.answer(ident, msg)
        elif isinstance(msg, Hello):
            self.front.send_multipart([ident, *self.welcome(msg.session).encode()])
        elif isinstance(msg, Heartbeat):
            beat = Heartbeat(server_id=self.server_id, results=self.welcome(b"x").results)
            self.front.send_multipart([ident, *beat.encode()])
        self.counts[type(msg).__name__.lower()] += 1

    def answer(self, ident: bytes, task: Task) -> None:
        n = len(task.images)
        out = Result(
            session=task.session,
            task_id=task.task_id,
            plan_version=task.plan_version,
            images=task.images,
            box_counts=(1,) * n,  # one box an image, as ``simulated`` has
            pixels=_zeros((n, 3, *task.out_hw)),
            boxes=_boxes(n, task.out_hw),
            labels=np.ones(n, np.int64),
        )
        frames = out.encode()
        try:
            route = reply_id(task.auth or b"")
            self.results.send_multipart([route, *frames], zmq.NOBLOCK, copy=False)
        except zmq.ZMQError:  # not connected there (yet): through the front, as a worker does
            self.front.send_multipart([ident, *frames], copy=False)
            self.counts["through_front"] += 1


_ZEROS: dict[tuple[int, ...], np.ndarray] = {}


def _boxes(n: int, hw: tuple[int, int]) -> np.ndarray:
    return np.tile(np.array([[1, 1, hw[1] - 1, hw[0] - 1]], np.float32), (n, 1))


def _zeros(shape: tuple[int, ...]) -> np.ndarray:
    if shape not in _ZEROS:
        _ZEROS[shape] = np.zeros(shape, np.uint8)
    return _ZEROS[shape]


def fakes_main(argv: list[str]) -> int:
    """Bind ``--count`` fake servers, print their addresses, answer until SIGTERM."""
    p = argparse.ArgumentParser(prog="scale fakes")
    p.add_argument("--count", type=int, default=1)
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--categories", type=int, default=0, help="each announces this many, long names")
    a = p.parse_args(argv)
    _raise_fd_limit(8 * a.count + 1024)
    ctx: zmq.Context[Any] = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, 3 * a.count + 64)
    names = tuple((n, f"{n:05d}".ljust(MAX_CATEGORY_NAME, "c")) for n in range(a.categories))
    fakes = [_Fake.bind(ctx, a.workers, names) for _ in range(a.count)]
    # The client's own poller (epoll over the sockets' descriptors): a zmq.Poller over
    # 3,072 sockets cost the fakes milliseconds a pass, enough to fall silent at 1,024.
    from dataserver_client.net.watch import Watch

    poller = Watch()
    handlers: dict[Any, Callable[[list[Any]], None]] = {}
    owner: dict[Any, _Fake] = {}
    for f in fakes:
        handlers[f.front] = f.on_front
        handlers[f.results] = lambda frames: None  # (claims: only with CURVE)
        owner.update({f.front: f, f.results: f})
    for sock in handlers:
        poller.register(sock, zmq.POLLIN)
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    print(json.dumps({"addresses": [f.address for f in fakes]}), flush=True)
    while not stop["now"]:
        for sock, _ in poller.poll(50):
            for _ in range(256):
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                handlers[sock](frames)
            poller.touch(owner[sock].front)  # (sent on: asked again whether readable)
            poller.touch(owner[sock].results)
    poller.close()
    ctx.destroy(linger=0)
    return 0


# ============================================================================ (b): the client


def client_main(argv: list[str]) -> int:
    """The real client against ``--addresses``: its CPU per second idle (connected, no
    epoch), then per task over ``--batches`` batches; one JSON line."""
    from dataserver_client import DataServerClient, iterate_epochs

    p = argparse.ArgumentParser(prog="scale client")
    p.add_argument("--addresses", required=True)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--batches", type=int, default=200)
    p.add_argument("--idle-seconds", type=float, default=2.0)
    p.add_argument("--others", default="", help="pids whose CPU is reported beside")
    p.add_argument("--rate", type=float, default=0.0, help="tasks a second (0: flat out)")
    a = p.parse_args(argv)
    servers = len(a.addresses.split(","))
    _raise_fd_limit(32 * servers + 1024)
    others = [int(x) for x in a.others.split(",") if x]
    me = os.getpid()
    size = (a.image_size, a.image_size)
    fds_before = _proc_fds(me)
    connecting = time.perf_counter()
    with DataServerClient(
        a.addresses.split(","),
        batch_size=a.batch_size,
        image_size=size,
        device="cpu",
        timeout=60.0,
    ) as client:
        connect_s = time.perf_counter() - connecting  # (every server's WELCOME)
        fds_connected = _proc_fds(me)
        idle = CpuWindow([me])
        idle.start()
        time.sleep(a.idle_seconds)
        idle_per_s = idle.stop()[0] / a.idle_seconds
        batches = iterate_epochs(client)
        for _ in range(10):  # warm up: every link has answered, buffers exist
            next(batches)
        window = CpuWindow([me, *others])
        before = client.stats()["results"]
        # At a fixed rate, each batch waits for its turn: the client's CPU per task is
        # then what it costs at that rate (it wakes as often, whatever the server count).
        every = a.batch_size / a.rate if a.rate > 0 else 0.0
        window.start()
        start = time.perf_counter()
        images = 0
        for i in range(a.batches):
            images += len(next(batches))
            wait = start + (i + 1) * every - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
        seconds = time.perf_counter() - start
        spent = window.stop()
        stats = client.stats()
        tasks = stats["results"] - before
    out = {
        "servers": servers,
        "fds_per_server": round((fds_connected - fds_before) / servers, 2),
        "connect_s": round(connect_s, 2),
        "fd_budget": stats.get("fds", {}),  # (a client before the budget: none)
        "tasks": tasks,
        "images": images,
        "seconds": seconds,
        "cpu_self_s": spent[0],
        "cpu_others_s": spent[1:],
        "idle_cpu_per_s": idle_per_s,
    }
    print(json.dumps(out), flush=True)
    os._exit(0)


# ============================================================================ the figure


def _proc_fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def _proc_rss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _fd_soft_limit(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/limits") as f:
            for line in f:
                if line.startswith("Max open files"):
                    return int(line.split()[3])
    except (OSError, ValueError):
        pass
    return None


class _Child:
    """A role's process and the JSON lines it prints, read by a thread of their own."""

    def __init__(self, cmd: list[str]) -> None:
        import queue
        import threading

        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        self.pid = self.proc.pid
        self.role = cmd[3]
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                self._lines.put(line)
        self._lines.put(None)

    def send_signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def next_json(self, timeout: float) -> dict[str, Any]:
        """The next JSON line it prints (within ``timeout``)."""
        import queue

        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            line = None
        if line is None:
            raise RuntimeError(f"bench scale: {self.role} printed nothing within {timeout:g} s")
        return dict(json.loads(line))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@contextmanager
def role(name: str, *flags: str, timeout: float = 180.0) -> Iterator[tuple[_Child, dict[str, Any]]]:
    """A role of this module in its own process (``swarm``, ``fakes``, ``client``; also the
    tests' fake servers): the process and its first JSON line; stopped on the way out."""
    child = _Child([sys.executable, "-m", "dataserver.bench.scale", name, *flags])
    try:
        yield child, child.next_json(timeout)
    finally:
        child.stop()


def _fetch_counters(address: str) -> dict[str, Any]:
    from dataserver.admin import fetch_stats

    return dict(fetch_stats(address, 20))


def _front_run(
    args: argparse.Namespace, address: str, pids: list[int], direct: bool, progress: Progress
) -> dict[str, Any]:
    """One measurement of (a): the swarm's sessions keep tasks outstanding through a window
    of ``--scale-seconds`` (the front's finished tasks and every process's CPU counted),
    then only beat through a second window (the front's CPU without tasks): the front's
    CPU per task is the difference over the tasks."""
    flags = ["--address", address, "--sessions", str(args.scale_clients), "--depth", "4"]
    flags += ["--direct", str(int(direct))]
    with role("swarm", *flags) as (swarm, ready):
        time.sleep(1.0)  # queues fill, every worker busy
        window = CpuWindow([*pids, swarm.pid])
        before = _fetch_counters(address)["counters"]
        window.start()
        start = time.perf_counter()
        time.sleep(args.scale_seconds)
        spent = window.stop()
        seconds = time.perf_counter() - start
        after = _fetch_counters(address)["counters"]
        swarm.send_signal(signal.SIGUSR2)  # no more tasks: the sessions only beat
        time.sleep(1.0)
        beating = _cpu_per_s(pids, args.scale_seconds)
    done = after.get("tasks_done", 0) - before.get("tasks_done", 0)
    direct_n = after.get("results_direct", 0) - before.get("results_direct", 0)
    path = "direct" if direct else "forwarded"
    progress(f"(a) {path}: {done / seconds:,.0f} tasks/s, {ready['ready']} sessions")
    n = max(1, done)
    return {
        "tasks_per_s": round(done / seconds, 1),
        "front_us_per_task": round(1e6 * (spent[0] - beating * seconds) / n, 1),
        "front_us_per_task_gross": round(1e6 * spent[0] / n, 1),
        "front_cpu_share": round(spent[0] / seconds, 3),
        "front_cpu_ms_per_s_beats_only": round(1e3 * beating, 1),
        "workers_us_per_task": round(1e6 * sum(spent[1 : len(pids)]) / n, 1),
        "swarm_us_per_task": round(1e6 * spent[-1] / n, 1),
        "results_sent_direct": round(direct_n / n, 3),
    }


def fig_front(
    args: argparse.Namespace, address: str, pids: list[int], progress: Progress
) -> dict[str, Any]:
    """(a) One front's CPU per task, results direct and through the front."""
    out: dict[str, Any] = {"a_sessions": args.scale_clients, "a_workers": len(pids) - 1}
    for direct in (True, False):
        r = _front_run(args, address, pids, direct, progress)
        key = "direct" if direct else "forwarded"
        us = r.pop("front_us_per_task")
        out[f"a_{key}_front_us_per_task"] = us
        out[f"a_{key}_tasks_per_front_core_s"] = round(1e6 / us) if us > 0 else None
        out.update({f"a_{key}_{k}": v for k, v in r.items()})
    return out


def _client_run(
    args: argparse.Namespace, addresses: list[str], others: list[int], rate: float = 0.0
) -> dict[str, Any]:
    flags = ["--addresses", ",".join(addresses), "--batches", str(args.scale_batches)]
    flags += ["--idle-seconds", str(min(2.0, args.scale_seconds))]
    flags += ["--others", ",".join(map(str, others)), "--rate", str(rate)]
    with role("client", *flags, timeout=600) as (_, out):
        return out


def _per_task(r: dict[str, Any]) -> float:
    return round(1e6 * r["cpu_self_s"] / max(1, r["tasks"]), 1)


def _net_per_task(r: dict[str, Any]) -> float:
    """CPU per task less what the client spends idle (heartbeats, timers) meanwhile."""
    net = r["cpu_self_s"] - r["idle_cpu_per_s"] * r["seconds"]
    return round(1e6 * net / max(1, r["tasks"]), 1)


def client_curve(
    args: argparse.Namespace, counts: list[int], rate: float, progress: Progress
) -> dict[str, Any]:
    """The client against S fake servers for each S in ``counts``, at ``rate`` tasks a
    second: its CPU per task net of its idle CPU, the idle CPU per server apart, the
    descriptors a server costs it."""
    out: dict[str, dict[int, Any]] = {
        k: {} for k in ("us_per_task_net", "us_per_task", "idle_us_per_s_per_server", "tasks_per_s")
    }
    out["fds_per_server"], out["results_through_front_servers"] = {}, {}
    out["connect_s"] = {}
    for s in counts:
        with role("fakes", "--count", str(s), "--workers", "16", timeout=600) as (proc, first):
            r = _client_run(args, first["addresses"], [proc.pid], rate)
        out["us_per_task_net"][s] = _net_per_task(r)
        out["us_per_task"][s] = _per_task(r)
        out["idle_us_per_s_per_server"][s] = round(1e6 * r["idle_cpu_per_s"] / s, 1)
        out["tasks_per_s"][s] = round(r["tasks"] / r["seconds"], 1)
        out["fds_per_server"][s] = r["fds_per_server"]
        out["connect_s"][s] = r["connect_s"]
        out["results_through_front_servers"][s] = r["fd_budget"].get("through_front")
        progress(
            f"(b) {s} servers at {rate:g} tasks/s: client {out['us_per_task_net'][s]} us/task "
            f"net of idle ({out['us_per_task'][s]} gross), idle "
            f"{out['idle_us_per_s_per_server'][s]} us/s a server, {r['fds_per_server']} fds "
            f"a server, connected in {r['connect_s']} s"
        )
    return {f"b_rate_{k}": v for k, v in out.items()} | {"b_rate_tasks_per_s_asked": rate}


def fig_client(
    args: argparse.Namespace, address: str, pids: list[int], progress: Progress
) -> dict[str, Any]:
    """(b) The real client's CPU per task and idle CPU against S fake servers."""
    counts = [int(c) for c in str(args.scale_servers).split(",") if c]
    per_task: dict[int, float] = {}
    idle: dict[int, float] = {}
    rate: dict[int, float] = {}
    fakes_us: dict[int, float] = {}
    for s in counts:
        with role("fakes", "--count", str(s), "--workers", "16") as (proc, first):
            r = _client_run(args, first["addresses"], [proc.pid])
        per_task[s] = _per_task(r)
        idle[s] = round(1e3 * r["idle_cpu_per_s"], 2)
        rate[s] = round(r["tasks"] / r["seconds"], 1)
        fakes_us[s] = round(1e6 * r["cpu_others_s"][0] / max(1, r["tasks"]), 1)
        progress(f"(b) {s} servers: client {per_task[s]} us/task, {rate[s]:,.0f} tasks/s")
    out: dict[str, Any] = {
        "b_client_us_per_task": per_task,
        "b_client_idle_cpu_ms_per_s": idle,
        "b_tasks_per_s": rate,
        "b_fakes_us_per_task": fakes_us,
        "b_images_per_task": 1,
    }
    if len(counts) >= 2:
        xs, ys = np.array(counts, float), np.array([per_task[c] for c in counts])
        slope, base = np.polyfit(xs, ys, 1)
        out["b_fit_us_per_task"] = f"{base:.1f} + {slope:.3f} x servers"
    rated = [int(c) for c in str(args.scale_rate_servers).split(",") if c]
    if rated and args.scale_rate > 0:
        out.update(client_curve(args, rated, args.scale_rate, progress))
    out.update(_fake_check(args, address, pids, progress))
    return out


def _fake_check(
    args: argparse.Namespace, address: str, pids: list[int], progress: Progress
) -> dict[str, Any]:
    """A fake with as many workers as the real server (``--no-local-results``: results
    over TCP, as from a fake): the client's CPU per task on each, tasks of the same shape
    (the client cuts batches by the servers' workers)."""
    workers = len(pids) - 1
    with role("fakes", "--count", "1", "--workers", str(workers)) as (proc, first):
        fake = _client_run(args, first["addresses"], [proc.pid])
    real = _client_run(args, [address], pids)
    progress(
        f"(b) check, {workers} worker(s): client {_per_task(fake)} us/task on the fake, "
        f"{_per_task(real)} on the real server"
    )
    return {
        "b_check_client_us_per_task_fake": _per_task(fake),
        "b_check_client_us_per_task_real": _per_task(real),
        "b_check_images_per_task": round(real["images"] / max(1, real["tasks"]), 2),
        "b_check_tasks_per_s_fake": round(fake["tasks"] / fake["seconds"], 1),
        "b_check_tasks_per_s_real": round(real["tasks"] / real["seconds"], 1),
    }


@dataclass
class _Snapshot:
    fds: list[int]
    rss_kib: list[int]

    @classmethod
    def of(cls, pids: list[int]) -> _Snapshot:
        return cls([_proc_fds(p) for p in pids], [_proc_rss_kib(p) for p in pids])


def _thread_cpu_seconds(pid: int) -> float:
    """CPU seconds of ``pid``'s main thread (the front's loop; not libzmq's I/O thread)."""
    return cpu_seconds(pid, pid)


def _cpu_per_s(pids: list[int], seconds: float) -> float:
    """CPU seconds per second the first of ``pids`` spends over ``seconds``."""
    return _cpu_and_thread_per_s(pids, seconds)[0]


def _cpu_and_thread_per_s(pids: list[int], seconds: float) -> tuple[float, float]:
    """CPU seconds per second the first of ``pids`` spends over ``seconds``: all of it, and
    its main thread's."""
    start, thread = cpu_seconds(pids[0]), _thread_cpu_seconds(pids[0])
    time.sleep(seconds)
    return (
        (cpu_seconds(pids[0]) - start) / seconds,
        (_thread_cpu_seconds(pids[0]) - thread) / seconds,
    )


class _Swarms:
    """Swarm processes, signalled together; their counts summed."""

    def __init__(self, procs: list[_Child]) -> None:
        self.procs = procs

    def signal(self, signum: int) -> None:
        for p in self.procs:
            p.send_signal(signum)

    def counts(self) -> Counter[str]:
        total: Counter[str] = Counter()
        for p in self.procs:
            p.send_signal(signal.SIGHUP)
            total.update(p.next_json(30)["counts"])
        return total

    def settle(self, key: str, limit: float = 20.0) -> None:
        """Wait until ``key`` stops growing (what the server still had queued is answered)."""
        last, deadline = self.counts()[key], time.monotonic() + limit
        while time.monotonic() < deadline:
            time.sleep(0.5)
            now = self.counts()[key]
            if now == last:
                return
            last = now


@dataclass
class _Beats:
    """The front's CPU with the sessions beating, per second; the beats sent and answered."""

    cpu_per_s: float
    sent_per_s: float
    handled_per_s: float  # by the front (its ``heartbeats`` counter)
    thread_cpu_per_s: float = 0.0  # the front's main thread alone


def _beating(address: str, pids: list[int], swarms: _Swarms, seconds: float) -> _Beats:
    """Each figure over its own span (a STATS answer waits behind the heartbeats queued)."""

    def handled() -> float:
        return float(_fetch_counters(address)["counters"].get("heartbeats", 0))

    def sent() -> float:
        return float(swarms.counts()["beats"])

    probes = {
        "sent": sent,
        "handled": handled,
        "cpu": lambda: cpu_seconds(pids[0]),
        "thread": lambda: _thread_cpu_seconds(pids[0]),
    }
    first = {k: (f(), time.perf_counter()) for k, f in probes.items()}
    time.sleep(seconds)
    rate = {}
    for k, f in probes.items():
        v0, t0 = first[k]
        rate[k] = (f() - v0) / (time.perf_counter() - t0)
    return _Beats(rate["cpu"], rate["sent"], rate["handled"], rate["thread"])


def fig_sessions(
    args: argparse.Namespace, address: str, pids: list[int], progress: Progress
) -> dict[str, Any]:
    """(c) fds, memory and CPU of one server holding ``--scale-sessions`` sessions: the
    front's CPU with none, with the sessions open and silent (their ZMTP PINGs only), then
    beating at the interval the server tells them (quiet sessions, as a real client's
    between tasks; per beat it handled: a front short of CPU handles fewer than are sent).
    The front's main thread (its loop) is measured beside the whole process."""
    n = args.scale_sessions
    t = args.scale_seconds
    time.sleep(1.0)
    idle = _cpu_and_thread_per_s(pids, t)
    before = _Snapshot.of(pids)
    limit = _fd_soft_limit(pids[0])
    direct = str(int(getattr(args, "scale_direct", 1)))  # (0: no result connections)
    common = ["--address", address, "--depth", "0", "--direct", direct]
    # A swarm holds ~6 fds a session (3 sockets: their eventfds and connections): enough
    # swarms that each stays within an fd limit of 20,000 (two at least, as ever).
    count = max(2, -(-n // SWARM_SESSIONS))
    shares = [n // count + (1 if i < n % count else 0) for i in range(count)]
    with ExitStack() as stack:
        started = [
            stack.enter_context(role("swarm", *common, "--sessions", str(k))) for k in shares
        ]
        swarms = _Swarms([proc for proc, _ in started])
        opened = sum(int(ready["ready"]) for _, ready in started)
        progress(f"(c) {opened} sessions open ({count} swarms)")
        swarms.signal(signal.SIGUSR1)  # silent
        swarms.settle("beats_answered", 5.0)  # (not long: silent sessions expire at 30 s)
        loaded = _Snapshot.of(pids)
        silent = _cpu_and_thread_per_s(pids, t)
        swarms.signal(signal.SIGUSR1)  # beating again
        # Every session has had an answer telling it the server's interval now.
        time.sleep(1.0 + float(_fetch_counters(address).get("heartbeat_interval_s", BEAT_S)))
        beats = _beating(address, pids, swarms, t)
        stats = _fetch_counters(address)
    report = _sessions_report(opened, before, loaded, stats, (idle, beats, silent))
    report["c_front_fd_limit"] = limit
    progress(
        f"(c) {opened} sessions: {report['c_front_fds_per_session']} fds and "
        f"{report['c_front_kib_per_session']} KiB a session on the front; beating every "
        f"{report['c_heartbeat_interval_s']} s, front thread "
        f"{report['c_front_thread_ms_per_s_sessions_beating']} ms/s"
    )
    return report


def _sessions_report(
    opened: int,
    before: _Snapshot,
    loaded: _Snapshot,
    stats: dict[str, Any],
    cpu: tuple[tuple[float, float], _Beats, tuple[float, float]],
) -> dict[str, Any]:
    (idle_cpu, idle_thread), beats, (silent_cpu, silent_thread) = cpu
    per = max(1, opened)
    per_1000 = max(1, opened) / 1000
    limits = stats.get("limits", {})
    interval = float(stats.get("heartbeat_interval_s", BEAT_S))
    per_beat = (beats.cpu_per_s - silent_cpu) / max(1.0, beats.handled_per_s)
    per_beat_thread = (beats.thread_cpu_per_s - silent_thread) / max(1.0, beats.handled_per_s)
    return {
        "c_sessions": opened,
        "c_sessions_on_server": stats.get("sessions"),
        "c_connections_on_front": stats.get("connections"),
        "c_front_fds_before": before.fds[0],
        "c_front_fds_after": loaded.fds[0],
        "c_front_fds_per_session": round((loaded.fds[0] - before.fds[0]) / per, 2),
        "c_worker_fds_per_session": round((loaded.fds[1] - before.fds[1]) / per, 2),
        "c_front_rss_mib_before": round(before.rss_kib[0] / 1024, 1),
        "c_front_rss_mib_after": round(loaded.rss_kib[0] / 1024, 1),
        "c_front_kib_per_session": round((loaded.rss_kib[0] - before.rss_kib[0]) / per, 1),
        "c_worker_kib_per_session": round((loaded.rss_kib[1] - before.rss_kib[1]) / per, 1),
        "c_heartbeat_interval_s": interval,
        "c_heartbeats_due_per_s": round(opened / interval, 1),
        "c_heartbeats_sent_per_s": round(beats.sent_per_s, 1),
        "c_heartbeats_handled_per_s": round(beats.handled_per_s, 1),
        "c_front_cpu_ms_per_s_no_sessions": round(1e3 * idle_cpu, 2),
        "c_front_cpu_ms_per_s_sessions_beating": round(1e3 * beats.cpu_per_s, 2),
        "c_front_cpu_ms_per_s_sessions_silent": round(1e3 * silent_cpu, 2),
        "c_front_thread_ms_per_s_no_sessions": round(1e3 * idle_thread, 2),
        "c_front_thread_ms_per_s_sessions_silent": round(1e3 * silent_thread, 2),
        "c_front_thread_ms_per_s_sessions_beating": round(1e3 * beats.thread_cpu_per_s, 2),
        "c_front_thread_ms_per_s_per_1000_quiet": round(
            1e3 * (beats.thread_cpu_per_s - idle_thread) / per_1000, 2
        ),
        "c_front_cpu_ms_per_s_per_1000_quiet": round(
            1e3 * (beats.cpu_per_s - idle_cpu) / per_1000, 2
        ),
        "c_front_us_per_heartbeat": round(1e6 * per_beat, 1),
        "c_front_thread_us_per_heartbeat": round(1e6 * per_beat_thread, 1),
        "c_front_cpu_ms_per_s_at_0_5_s_beats": round(
            1e3 * (silent_cpu + per_beat * opened / 0.5), 1
        ),
        "c_max_sessions": limits.get("max_sessions"),
        "c_max_sessions_why": limits.get("max_sessions_why"),
        "c_max_connections": limits.get("max_connections"),
        "c_rejected": stats.get("rejected", {}),
        "c_sessions_expired": stats.get("counters", {}).get("sessions_expired", 0),
        "c_hellos": stats.get("counters", {}).get("hellos", 0),
        "c_data_connections_made": stats.get("counters", {}).get("data_connections", 0),
    }


def fig_scale(args: argparse.Namespace, spec: str, progress: Progress) -> dict[str, Any]:
    """(a) a front's capacity, (b) a client's cost per server count, (c) a server's cost
    per session (``--scale-parts``: which of them); the paper model built from them is in
    docs/DESIGN-NOTES.md."""
    from dataserver.bench.common import server

    # One server for all three: zero-cost samples, no store (its workers do less; the front
    # and the sessions are what is measured), results over TCP to clients on this host too
    # (as to the fakes, and to clients on other hosts).
    flags = ["--dataset", ZERO, "--dataset-args", ZERO_ARGS, "--workers", str(args.scale_workers)]
    flags += ["--cache-gb", "0", "--no-local-results"]
    parts = set(str(getattr(args, "scale_parts", "a,b,c")).split(","))
    # The server derives its session cap from its fd limit: as root, the bench raises the
    # hard limit it and the swarms inherit (8 fds a session covers the swarms' own).
    hard, raised = _raise_hard_fd_limit(8 * args.scale_sessions + 8192)
    out: dict[str, Any] = {"fd_hard_limit": hard, "fd_hard_limit_raised_by_bench": raised}
    with server(flags) as (address, pids):
        if "a" in parts:
            out.update(fig_front(args, address, pids, progress))
        if "b" in parts:
            out.update(fig_client(args, address, pids, progress))
        if "c" in parts:
            out.update(fig_sessions(args, address, pids, progress))
    with open("/proc/loadavg") as f:
        out["load_average"] = " ".join(f.read().split()[:3])
    return out


def curve_main(argv: list[str]) -> int:
    """(b) alone, at a fixed rate, without a real server: ``python -m
    dataserver.bench.scale curve --servers 16,256,1024 --rate 200``; one JSON line."""
    p = argparse.ArgumentParser(prog="scale curve")
    p.add_argument("--servers", default="16,256,1024")
    p.add_argument("--rate", type=float, default=200.0)
    p.add_argument("--batches", type=int, default=100)
    p.add_argument("--seconds", type=float, default=2.0)
    a = p.parse_args(argv)
    args = argparse.Namespace(scale_batches=a.batches, scale_seconds=a.seconds)
    counts = [int(c) for c in a.servers.split(",") if c]
    out = client_curve(args, counts, a.rate, lambda line: print(line, file=sys.stderr))
    print(json.dumps(out), flush=True)
    return 0


ROLES = {"swarm": swarm_main, "fakes": fakes_main, "client": client_main, "curve": curve_main}


if __name__ == "__main__":
    sys.exit(ROLES[sys.argv[1]](sys.argv[2:]))
