"""Per-sample sizes beyond 65,536 (issue 35, point 6): WELCOME announces their count and
digest, the table comes on request in chunks (SIZES), checked on both sides: Ultralytics'
rect validation on an 80,000-image val set end to end (``ds_plugins:sized``), 2^24 sizes
from a real server, SIZES' bounds and rate on the server, and a hostile server that answers
with other sizes refused."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
from clients import make_client
from ds_plugins import sized_shapes
from fuzz_targets import welcome_of
from fuzzing import AUTH, SID

from dataserver.protocol import (
    MAGIC,
    Heartbeat,
    Hello,
    MsgType,
    ProtocolError,
    SampleSizes,
    Welcome,
    decode,
    sizes_digest,
)
from dataserver.protocol.messages import (
    MAX_ANNOUNCED_SIZES,
    SIZES_BURST,
    SIZES_CHUNK,
)
from dataserver.server.front.announce import Announced
from dataserver_client import DataServerError

pytestmark = pytest.mark.timeout(300)

OBJECTS365_VAL = 80_000  # Objects365's val split: more than the 65,536 WELCOME once carried


def _sized(n: int, sort: bool = True, imgsz: int = 64) -> tuple[str, ...]:
    args = {"n": n, "imgsz": imgsz, "sort": sort}
    return ("--dataset", "ds_plugins:sized", "--dataset-args", json.dumps(args))


# ---------------------------------------------------------------- the message


def _frames(header: dict[str, Any], arrays: list[np.ndarray] = ()) -> list[Any]:  # type: ignore[assignment]
    specs = [[a.dtype.str, list(a.shape)] for a in arrays]
    packed = msgpack.packb({**header, "arrays": specs} if arrays else header, use_bin_type=True)
    return [MAGIC, bytes([MsgType.SIZES]), packed, *(a.tobytes() for a in arrays)]


def test_sizes_request_and_reply_round_trip_and_are_checked() -> None:
    table = np.array([[3, 4], [5, 6], [7, 8]], np.int32)
    ask = decode(SampleSizes(session=SID, auth=AUTH, start=0, count=3).encode())
    assert isinstance(ask, SampleSizes) and ask.hw is None and (ask.start, ask.count) == (0, 3)
    digest = sizes_digest(table)
    reply = decode(SampleSizes(session=SID, start=0, count=3, digest=digest, hw=table).encode())
    assert isinstance(reply, SampleSizes) and reply.hw.tolist() == table.tolist()
    ok = {"session": SID, "start": 0, "count": 3, "digest": digest}
    bad: list[tuple[dict[str, Any], list[np.ndarray], str]] = [
        ({**ok, "count": 2}, [table], r"int32 \(2, 2\)"),
        (ok, [table.astype(np.int64)], "int32"),
        (ok, [table[:, :1].copy()], r"int32 \(3, 2\)"),
        (ok, [table * 0], "a side"),
        (ok, [table, table], "one array"),
        ({**ok, "digest": b"x"}, [table], "digest"),
        ({**ok, "count": SIZES_CHUNK + 1}, [], "count"),
        ({**ok, "count": 0}, [], "count"),
        ({**ok, "start": MAX_ANNOUNCED_SIZES - 2}, [], "exceed"),
        ({**ok, "start": -1}, [], "start"),
    ]
    for header, arrays, problem in bad:
        with pytest.raises(ProtocolError, match=problem):
            decode(_frames(header, arrays))
    # The digest is of the whole table: its length too.
    assert sizes_digest(table) != sizes_digest(table[:2]) != sizes_digest(table[::-1])


def test_the_server_side_bounds_what_a_session_may_ask() -> None:
    """``Announced``: a chunk is a view (no copy), a range beyond the table or of a dataset
    without sizes is refused, and a session gets ``SIZES_BURST`` answers at once, then
    ``SIZES_RATE`` a second; another session has its own bucket."""
    table = np.arange(2 * 100_000, dtype=np.int32).reshape(-1, 2) % 500 + 1
    announced = Announced(table)
    assert announced.count == 100_000 and announced.digest == sizes_digest(table)
    reply = announced.chunk(b"s" * 16, 65_536, 100_000 - 65_536)
    assert np.shares_memory(reply.hw, table) and reply.hw.shape == (100_000 - 65_536, 2)
    assert announced.problem(65_536, SIZES_CHUNK) is not None
    assert announced.problem(0, SIZES_CHUNK) is None
    assert "no sizes" in str(Announced(None).problem(0, 1))
    now = time.monotonic() + 0.01  # (after the buckets are made)
    granted = sum(announced.allow(b"a" * 16, now) for _ in range(1000))
    assert granted == SIZES_BURST
    assert announced.allow(b"b" * 16, now)  # (its own bucket)
    assert not announced.allow(b"a" * 16, now) and announced.allow(b"a" * 16, now + 1.0)


# ---------------------------------------------------------------- end to end


def test_rect_validation_on_an_80000_image_val_set(start_server: Any) -> None:
    """``val_loader`` (DataServerTrainer's validation) on 80,000 images: the rect plan
    over all of them equals ``set_rectangle``'s rule on the dataset's own sizes, and the
    first val batches come at the plan's shapes with the right images. Before issue 35 the
    server refused to start (at most 65,536 sizes)."""
    pytest.importorskip("ultralytics")
    os.environ.setdefault("YOLO_OFFLINE", "1")
    from ultralytics.cfg import get_cfg

    from dataserver_client.integrations.ultralytics import served_data, val_loader

    imgsz, batch, stride = 64, 16, 32
    server = start_server(*_sized(OBJECTS365_VAL, imgsz=imgsz), workers=1)
    pool = {"train": server.address, "val": server.address}
    data = served_data(pool)
    args: Any = get_cfg(overrides={"imgsz": imgsz, "data": pool})
    loader: Any = val_loader(pool["val"], data, args, batch, rank=-1, stride=stride)
    try:
        assert loader.rect is not None
        shapes, _ = loader.rect
        own = sized_shapes(OBJECTS365_VAL)
        assert shapes == _set_rectangle(own, batch, imgsz, stride)
        assert len(shapes) == -(-OBJECTS365_VAL // batch) and len(set(shapes)) >= 3
        assert loader.client.size_array().tolist() == own.tolist()
        served = 0
        for k, out in enumerate(loader):
            assert tuple(out["img"].shape[2:]) == shapes[k]
            names = [int(os.path.basename(f).split(".")[0]) for f in out["im_file"]]
            assert names == list(range(k * batch, (k + 1) * batch))
            assert out["ori_shape"] == tuple(tuple(int(v) for v in own[i]) for i in names)
            served += 1
            if served == 3:
                break
        assert served == 3
    finally:
        loader.close()
    assert server.stats()["counters"]["size_chunks"] >= 2  # (asked for, not in WELCOME)


def _set_rectangle(sizes: np.ndarray, batch: int, imgsz: int, stride: int) -> list[Any]:
    """``YOLODataset.set_rectangle``'s batch shapes (its loop, as Ultralytics writes it)."""
    ar = sizes[:, 0].astype(np.float64) / sizes[:, 1]
    nb = -(-len(ar) // batch)
    shapes = [[1, 1]] * nb
    for i in range(nb):
        ari = ar[i * batch : (i + 1) * batch]  # (its ar[bi == i])
        mini, maxi = ari.min(), ari.max()
        if maxi < 1:
            shapes[i] = [maxi, 1]
        elif mini > 1:
            shapes[i] = [1, 1 / mini]
    out = np.ceil(np.array(shapes) * imgsz / stride + 0.5).astype(int) * stride
    return [(int(h), int(w)) for h, w in out]


def test_two_to_the_24_sizes_come_in_chunks(start_server: Any) -> None:
    """A server of 2^24 samples starts, its WELCOME stays small, and a client gets every
    size (the dataset's own table, 256 chunks) and plans rect batches from them; a
    2^24-sample order, not a 2^24 list of tuples."""
    from dataserver_client.integrations.ultralytics_val import rect_plan

    n = MAX_ANNOUNCED_SIZES
    server = start_server(*_sized(n, sort=False), workers=1, ready_timeout=180)
    welcome = welcome_of(server.address)
    assert welcome.dataset_len == welcome.sizes_count == n
    assert len(Welcome.encode(welcome)[2]) < 4096
    own = sized_shapes(n, sort=False)
    assert welcome.sizes_digest == sizes_digest(own)
    with make_client(server.address, batch_size=8, image_size=(64, 64), timeout=120) as client:
        table = client.size_array()
        assert table.shape == (n, 2) and np.array_equal(table, own)
        assert client.size_array() is table  # asked once
        shapes = rect_plan(table, seed=0, rank=5, world=64, batch=32, imgsz=640, stride=32)
    mine = np.arange(5, n, 64)
    assert shapes == _set_rectangle(own[mine], 32, 640, 32)
    assert server.stats()["counters"]["size_chunks"] == n // SIZES_CHUNK


def test_a_client_flooding_sizes_requests_gets_its_rate_and_no_more(start_server: Any) -> None:
    """A session asking for 512 KiB chunks in a tight loop (1,000 requests, read as they
    come) is answered at its rate (``SIZES_BURST`` at once, ``SIZES_RATE`` a second), the
    rest dropped and counted; a request without the session's secret is refused; the
    server serves on."""
    from dataserver.protocol.messages import SIZES_RATE

    server = start_server(*_sized(70_000), workers=1)
    ctx: zmq.Context[Any] = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.address)
    try:
        sock.send_multipart(Hello(session=SID, auth=AUTH).encode())
        assert sock.poll(10_000) and isinstance(decode(sock.recv_multipart()), Welcome)
        ask = SampleSizes(session=SID, auth=AUTH, start=0, count=SIZES_CHUNK).encode()
        started = time.monotonic()
        got, sent = 0, 0
        while time.monotonic() - started < 2.0:
            if sent < 1000:
                sock.send_multipart(ask)
                sent += 1
            while sock.poll(0 if sent < 1000 else 50):
                msg = decode(sock.recv_multipart())
                assert isinstance(msg, SampleSizes) and msg.hw.shape == (SIZES_CHUNK, 2)
                got += 1
        took = time.monotonic() - started
        assert 1 <= got <= SIZES_BURST + SIZES_RATE * took + 1
        forged = SampleSizes(session=SID, auth=b"x" * 16, start=0, count=1).encode()
        sock.send_multipart(forged)
        while sock.poll(5_000):
            msg = decode(sock.recv_multipart())
            if not isinstance(msg, SampleSizes):
                break
            got += 1  # (answered before the loop above ended)
        assert getattr(msg, "kind", None) == "bad_secret"
    finally:
        sock.close()
    stats = server.stats()
    assert stats["counters"]["size_chunks"] == got
    assert stats["rejected"]["sizes_rate"] == sent - got
    assert stats["workers_alive"] == 1


# ---------------------------------------------------------------- hostile servers

Lie = Callable[[SampleSizes, np.ndarray, bytes], SampleSizes]


class LyingServer:
    """A server that mimics a real one's WELCOME (same dataset, sizes count and digest)
    and answers SIZES through ``lie(request, table, digest)``."""

    def __init__(self, real: Welcome, table: np.ndarray, lie: Lie) -> None:
        self.real, self.table, self.lie = real, table, lie
        self.asked = 0
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.data = self.ctx.socket(zmq.ROUTER)
        self.data.setsockopt(zmq.LINGER, 0)
        self.address = f"tcp://127.0.0.1:{self.data.bind_to_random_port('tcp://127.0.0.1')}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.data.poll(50):
                continue
            identity, *frames = self.data.recv_multipart()
            msg = decode(frames)
            if isinstance(msg, Hello):
                w = Welcome(
                    session=msg.session,
                    server_id="liar",
                    dataset_len=self.real.dataset_len,
                    fingerprint=self.real.fingerprint,
                    workers=1,
                    credit=2,
                    categories=self.real.categories,
                    sizes_count=self.real.sizes_count,
                    sizes_digest=self.real.sizes_digest,
                )
                self.data.send_multipart([identity, *w.encode()])
            elif isinstance(msg, Heartbeat):
                self.data.send_multipart([identity, *Heartbeat(server_id="liar").encode()])
            elif isinstance(msg, SampleSizes):
                self.asked += 1
                reply = self.lie(msg, self.table, self.real.sizes_digest)
                self.data.send_multipart([identity, *reply.encode()])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.data.close()
        self.ctx.term()


def _honest(ask: SampleSizes, table: np.ndarray, digest: bytes) -> SampleSizes:
    hw = table[ask.start : ask.start + ask.count]
    return SampleSizes(session=ask.session, start=ask.start, count=ask.count, digest=digest, hw=hw)


def _other_digest(ask: SampleSizes, table: np.ndarray, digest: bytes) -> SampleSizes:
    reply = _honest(ask, table, digest)
    return SampleSizes(**{**_fields(reply), "digest": bytes(16)})


def _short(ask: SampleSizes, table: np.ndarray, digest: bytes) -> SampleSizes:
    reply = _honest(ask, table, digest)
    return SampleSizes(**{**_fields(reply), "count": ask.count - 1, "hw": reply.hw[:-1]})


def _other_sizes(ask: SampleSizes, table: np.ndarray, digest: bytes) -> SampleSizes:
    reply = _honest(ask, table, digest)
    return SampleSizes(**{**_fields(reply), "hw": reply.hw[:, ::-1].copy()})


def _fields(msg: SampleSizes) -> dict[str, Any]:
    return {name: getattr(msg, name) for name in ("session", "start", "count", "digest", "hw")}


@pytest.mark.parametrize(
    ("lie", "why"),
    [
        (_other_digest, "not the .* its WELCOME announced"),
        (_short, "not a chunk this client asks"),
        (_other_sizes, "do not make the digest its WELCOME announced"),
    ],
)
def test_a_server_lying_about_sizes_is_refused(start_server: Any, lie: Lie, why: str) -> None:
    """A server answering SIZES with another digest, another range or sizes that are not
    the announced ones is banned, and the sizes come from the honest server; alone, the
    client's ``size_array()`` raises naming what was wrong (not a wait for ``timeout``)."""
    n = 70_000  # two chunks
    real = start_server(*_sized(n), workers=1)
    welcome = welcome_of(real.address)
    own = sized_shapes(n)
    liar = LyingServer(welcome, own, lie)
    try:
        with make_client([liar.address, real.address], batch_size=8, image_size=(64, 64)) as c:
            assert np.array_equal(c.size_array(), own)
            stats = c.stats()
            states = {s["address"]: s["state"] for s in stats["servers"]}
            assert states == {liar.address: "banned", real.address: "ready"}
            assert stats["rejected"]["bad_server"] == 1 and liar.asked >= 1
        alone = make_client(liar.address, batch_size=8, image_size=(64, 64), timeout=60)
        with alone, pytest.raises(DataServerError, match=why):
            alone.size_array()
    finally:
        liar.close()
