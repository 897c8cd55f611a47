"""Where the protocol fuzzer sends its messages: a live server's data port, its
workers' result sockets, and a live client's sockets (through a fake server the client
connects to). Shared by ``test_fuzz.py`` (a few thousand messages in CI) and
``fuzz_long.py`` (the long run).

Each target drives hypothesis itself (``run_*(count)``) and returns how many messages it
sent; what must hold afterwards is checked by the caller against the live processes.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import msgpack
import numpy as np
import zmq
from fuzzing import VALID, headers, messages
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from dataserver.protocol import MAGIC, Bye, Hello, MsgType, Welcome, decode

BATCH = 50  # messages per hypothesis example


def _settings(count: int) -> settings:
    return settings(
        max_examples=max(1, count // BATCH),
        deadline=None,
        phases=[Phase.generate],  # a live target has state: shrinking would mislead
        suppress_health_check=list(HealthCheck),
        database=None,
    )


def _send(sock: zmq.Socket[Any], frames: list[Any]) -> bool:
    frames = frames or [b""]  # ZeroMQ has no message of no frames
    try:
        sock.send_multipart(frames, zmq.NOBLOCK)
        return True
    except zmq.Again:
        return False


def _drain(sock: zmq.Socket[Any]) -> int:
    """Read every reply waiting; each must be a message this protocol can decode."""
    n = 0
    while True:
        try:
            frames = sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return n
        decode(frames)  # a server only ever answers with well-formed messages
        n += 1


def run_data_port(address: str, count: int) -> int:
    """Fuzzed messages of every type on the data port, from one connection."""
    ctx: zmq.Context[Any] = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 100_000)
    sock.connect(address)
    sent = 0

    @_settings(count)
    @given(st.lists(messages(), min_size=BATCH, max_size=BATCH))
    def fuzz(batch: list[list[bytes]]) -> None:
        nonlocal sent
        for frames in batch:
            sent += _send(sock, frames)
        _drain(sock)

    try:
        fuzz()
        time.sleep(0.5)
        _drain(sock)
    finally:
        sock.close(linger=0)
    return sent


def run_worker_results(endpoints: list[str], count: int) -> int:
    """Fuzzed messages at workers' direct-result sockets (which never read): from
    connections named like client sessions, and unnamed."""
    ctx: zmq.Context[Any] = zmq.Context.instance()
    socks = []
    for i, endpoint in enumerate(endpoints):
        for named in (True, False):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            if named:
                s.setsockopt(zmq.ROUTING_ID, b"fuzz-session-%d" % i)
            s.connect(endpoint)
            socks.append(s)
    sent = 0

    @_settings(count)
    @given(
        st.lists(
            st.tuples(st.integers(0, len(socks) - 1), messages()), min_size=BATCH, max_size=BATCH
        )
    )
    def fuzz(batch: list[tuple[int, list[bytes]]]) -> None:
        nonlocal sent
        for i, frames in batch:
            sent += _send(socks[i], frames)

    try:
        fuzz()
    finally:
        for s in socks:
            s.close(linger=0)
    return sent


class FakeServer:
    """A hostile server a real client connects to (beside a real one): it answers HELLO
    with a WELCOME like the real server's (so the client sends it tasks), then answers
    everything with fuzzed messages on the client's front and result connections, some
    naming the client's real session and task ids. After ``count`` messages it goes away,
    and the client must move the tasks it still holds to the real server."""

    def __init__(self, real_welcome: Welcome, count: int) -> None:
        self.real = real_welcome
        self.count = count
        self.ctx = zmq.Context()
        self.data = self.ctx.socket(zmq.ROUTER)
        self.results = self.ctx.socket(zmq.ROUTER)
        for s in (self.data, self.results):
            s.setsockopt(zmq.LINGER, 0)
        self.data.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self.results.setsockopt(zmq.ROUTER_MANDATORY, 0)
        port = self.data.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        rport = self.results.bind_to_random_port("tcp://127.0.0.1")
        self.results_endpoint = f"tcp://127.0.0.1:{rport}"
        self.sent = 0
        self.tasks_seen = 0
        self.error: BaseException | None = None
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _welcome(self, session: bytes) -> list[Any]:
        w = Welcome(
            session=session,
            server_id="fake-server",
            dataset_len=self.real.dataset_len,
            fingerprint=self.real.fingerprint,
            workers=2,
            credit=4,
            results=(self.results_endpoint,),
            max_image_side=self.real.max_image_side,
        )
        return w.encode()

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # reported to the test
            self.error = exc
        finally:
            for s in (self.data, self.results):
                s.close(linger=0)
            self.ctx.term()
            self.done.set()

    def _serve(self) -> None:
        identity: bytes | None = None
        session: bytes | None = None
        tasks: list[tuple[int, int]] = []  # (task_id, plan_version) the client sent us
        deadline = time.monotonic() + 120
        while identity is None and time.monotonic() < deadline:
            if not self.data.poll(100):
                continue
            frames = self.data.recv_multipart()
            msg = decode(frames[1:])
            if msg.TYPE is MsgType.HELLO:
                identity, session = frames[0], getattr(msg, "session", None)
                self.data.send_multipart([identity, *self._welcome(session or b"")])
        if identity is None or session is None:
            raise RuntimeError("the client never said HELLO")

        def read_tasks() -> None:
            while True:
                try:
                    frames = self.data.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    return
                try:
                    msg = decode(frames[1:])
                except Exception:
                    continue
                if msg.TYPE is MsgType.TASK:
                    self.tasks_seen += 1
                    tasks.append((getattr(msg, "task_id", 0), getattr(msg, "plan_version", 0)))
                elif msg.TYPE is MsgType.HELLO:
                    self.data.send_multipart([identity, *self._welcome(session)])

        client_types = [
            MsgType.RESULT,
            MsgType.RESULT,
            MsgType.ERROR,
            MsgType.CANCELLED,
            MsgType.WELCOME,
            MsgType.HEARTBEAT,
            MsgType.STATS,
            MsgType.TASK,
            MsgType.SIZES,
        ]

        any_message = messages()

        @_settings(self.count)
        @given(st.data())
        def fuzz(data: st.DataObject) -> None:
            for _ in range(BATCH):
                # Every value is drawn whatever the live state, so that hypothesis sees the
                # same draws for the same example; the state only picks among them.
                mtype = data.draw(st.sampled_from(client_types))
                structured = data.draw(st.booleans())
                header = data.draw(headers(mtype))
                naming = data.draw(st.sampled_from(["task", "session", "as drawn"]))
                pick = data.draw(st.integers(0, 63))
                anything = data.draw(any_message)
                to_results = data.draw(st.booleans())
                read_tasks()
                if structured:  # fields varied from a valid message, often naming real work
                    if naming == "task" and tasks:
                        tid, version = tasks[-1 - pick % min(64, len(tasks))]
                        header.update(session=session, task_id=tid, plan_version=version)
                    elif naming != "as drawn":
                        header["session"] = session
                    arrays: list[bytes] = []
                    if mtype is MsgType.RESULT:
                        header["arrays"] = [["|u1", [2, 3, 32, 32]], ["<f4", [1, 4]], ["<i8", [1]]]
                        arrays = [bytes(2 * 3 * 32 * 32), bytes(16), bytes(8)]
                    elif mtype is MsgType.SIZES:  # a reply: its sizes, a digest
                        header.update(digest=bytes(16), arrays=[["<i4", [pick + 1, 2]]])
                        header["count"] = pick + 1
                        arrays = [np.ones((pick + 1, 2), "<i4").tobytes()]
                    try:
                        packed = msgpack.packb(header, use_bin_type=True)
                    except (OverflowError, TypeError, ValueError):
                        packed = msgpack.packb(VALID[mtype], use_bin_type=True)
                    frames = [MAGIC, bytes([int(mtype)]), packed, *arrays]
                else:  # anything at all
                    frames = anything
                sock = self.results if to_results else self.data
                target = session if to_results else identity
                try:
                    sock.send_multipart([target, *(frames or [b""])], zmq.NOBLOCK)
                except zmq.Again:
                    continue
                except Exception as exc:  # record it; hypothesis must not replay live state
                    self.error = self.error or exc
                    return
                self.sent += 1

        # The client's result socket connects once it saw our WELCOME: give it a moment.
        time.sleep(0.3)
        fuzz()


def welcome_of(address: str) -> Welcome:
    """A real server's WELCOME (for the fake server to mimic)."""
    ctx: zmq.Context[Any] = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(address)
        sock.send_multipart(Hello(session=b"welcome-probe-00", auth=b"welcome-probe-00").encode())
        if not sock.poll(10_000):
            raise TimeoutError(f"no WELCOME from {address}")
        msg = decode(sock.recv_multipart())
        if not isinstance(msg, Welcome):
            raise RuntimeError(f"expected WELCOME, got {msg.TYPE.name}")
        sock.send_multipart(Bye(session=b"welcome-probe-00", auth=b"welcome-probe-00").encode())
        return msg
    finally:
        sock.close(linger=0)
