"""Guarantee 7 (second part): garbage on every socket is rejected and counted, and the
server keeps serving every other client."""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any

import msgpack
import pytest
import zmq
from clients import make_client
from conftest import wait_until
from fuzzing import AUTH, task_header

from dataserver import protocol
from dataserver.protocol import MAGIC, MsgType

pytestmark = pytest.mark.timeout(120)


def host_port(endpoint: str) -> tuple[str, int]:
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    return host, int(port)


def raw_tcp(endpoint: str, payload: bytes) -> None:
    with socket.create_connection(host_port(endpoint), timeout=5) as s:
        try:
            s.sendall(payload)
            time.sleep(0.05)
        except OSError:
            pass  # the server may hang up first: that is the point


HOSTILE_FRAMES: list[list[bytes]] = [
    [os.urandom(40)],  # one frame of noise
    [os.urandom(3), os.urandom(1), os.urandom(30)],  # three frames of noise
    [MAGIC],  # truncated
    [MAGIC, bytes([MsgType.HELLO])],  # truncated after the type
    [b"DS9", bytes([MsgType.HELLO]), msgpack.packb({"session": b"s" * 16})],  # wrong version
    [MAGIC, bytes([200]), msgpack.packb({})],  # unknown type
    [MAGIC, bytes([MsgType.HELLO]), b"\xdd\xff\xff\xff\xff"],  # msgpack bomb: 4G-element array
    [MAGIC, bytes([MsgType.HELLO]), b"\x81\xa1a" + b"\x91" * 100_000 + b"\x00"],  # deep nesting
    [MAGIC, bytes([MsgType.TASK]), msgpack.packb({**task_header(b"x" * 16), "grid": 99})],
    [
        MAGIC,
        bytes([MsgType.TASK]),
        msgpack.packb({**task_header(b"x" * 16), "images": [[[[[[[[[[[1]]]]]]]]]]]}),
    ],
    # a valid header whose buffers lie about their size
    [
        MAGIC,
        bytes([MsgType.RESULT]),
        msgpack.packb(
            {
                "session": b"x" * 16,
                "task_id": 1,
                "plan_version": 1,
                "images": [[1]],
                "box_counts": [0],
                "failed": [],
                "arrays": [["|u1", [3, 100, 100]], ["<f4", [0, 4]], ["<i8", [0]]],
            }
        ),
        b"\x00" * 10,
        b"",
        b"",
    ],
    [
        MAGIC,
        bytes([MsgType.CANCELLED]),
        msgpack.packb({"session": b"x" * 16, "task_ids": []}),
    ],  # not for servers
]


def test_hostile_traffic_is_rejected_counted_and_the_server_keeps_serving(
    start_server: Any,
) -> None:
    server = start_server("--dataset", "synthetic:images=48,seed=1")
    # A well-behaved client is in the middle of an epoch while the attack runs.
    good = make_client(server.address, batch_size=4, image_size=(32, 32))
    good.set_epoch(0)
    good_iter = iter(good)
    first = [next(good_iter) for _ in range(3)]

    # 1. Raw TCP junk on the data port (no ZMTP greeting, an HTTP request, a fake greeting).
    for payload in (
        os.urandom(2000),
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        b"\xff" + bytes(8) + b"\x7f" + os.urandom(64),
    ):
        raw_tcp(server.address, payload)

    ctx = zmq.Context()
    socks = []
    try:
        # 2. Wrong socket types on the data port: a PUB, a SUB.
        for kind, endpoint in ((zmq.PUB, server.address), (zmq.SUB, server.address)):
            s = ctx.socket(kind)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(endpoint)
            socks.append(s)
        # 3. Malformed, truncated, hostile and lying messages on the data port.
        attacker = ctx.socket(zmq.DEALER)
        attacker.setsockopt(zmq.LINGER, 0)
        attacker.connect(server.address)
        socks.append(attacker)
        for frames in HOSTILE_FRAMES:
            attacker.send_multipart(frames)
        # 4. Unknown session; then replayed and out-of-order traffic from a real session.
        attacker.send_multipart(protocol.pack(MsgType.TASK, task_header(b"u" * 16)))
        session = b"a" * 16
        attacker.send_multipart(protocol.pack(MsgType.HELLO, {"session": session, "auth": AUTH}))
        attacker.send_multipart(protocol.pack(MsgType.TASK, task_header(session, 1, 5)))
        attacker.send_multipart(protocol.pack(MsgType.TASK, task_header(session, 1, 5)))  # replay
        attacker.send_multipart(
            protocol.pack(MsgType.TASK, task_header(session, 2, 2))
        )  # overtaken
        # 5. An oversized frame (beyond the server's MAXMSGSIZE): the connection is dropped.
        big = ctx.socket(zmq.DEALER)
        big.setsockopt(zmq.LINGER, 0)
        big.connect(server.address)
        socks.append(big)
        big.send(b"x" * (4 << 20))
        answers = []
        while attacker.poll(1000):
            answers.append(protocol.decode(attacker.recv_multipart()))
        kinds = [(m.TYPE, getattr(m, "kind", None)) for m in answers]
        assert (MsgType.ERROR, "protocol") in kinds  # malformed messages are answered, not ignored
        assert (MsgType.ERROR, "unknown_session") in kinds
        assert any(isinstance(m, protocol.Welcome) for m in answers)
        assert any(isinstance(m, protocol.Cancelled) and m.task_ids == (2,) for m in answers)

        # 6. The workers' result sockets, announced in WELCOME: junk, noise and oversized
        # messages (workers never read them; anything over 1 KiB cuts the connection).
        welcome = next(m for m in answers if isinstance(m, protocol.Welcome))
        worker_ports = welcome.results
        assert len(worker_ports) == 2
        for endpoint in worker_ports:
            raw_tcp(endpoint, os.urandom(3000))
            noisy = ctx.socket(zmq.DEALER)
            noisy.setsockopt(zmq.LINGER, 0)
            noisy.connect(endpoint)
            socks.append(noisy)
            for frames in HOSTILE_FRAMES[:4]:
                noisy.send_multipart(frames)
            noisy.send(os.urandom(1 << 20))

        def counted() -> bool:
            r = server.stats()["rejected"]
            return (
                r.get("malformed", 0) >= 10
                and r.get("unexpected_type", 0) >= 1
                and r.get("unknown_session", 0) >= 1
                and r.get("data_bad_handshake", 0) >= 2
            )

        assert wait_until(counted, 10), json.dumps(server.stats()["rejected"])
        stats = server.stats()
        assert stats["counters"]["data_disconnects"] >= 3  # junk, fake greeting, oversized
    finally:
        for s in socks:
            s.close(linger=0)
        ctx.term()

    # The client that was mid-epoch finishes it, exactly once; a new client gets a full epoch.
    rest = list(good_iter)
    good.close()
    assert sorted(i for b in first + rest for idx in b.indices for i in idx) == list(range(48))
    with make_client(server.address, batch_size=8, image_size=(32, 32)) as c:
        c.set_epoch(1)
        assert sorted(i for b in c for idx in b.indices for i in idx) == list(range(48))
    assert server.proc.poll() is None and server.stats()["workers_alive"] == 2
