"""Guarantee 8: with CURVE a server accepts only known clients, and the traffic is
encrypted; an unknown client gets a clear error, not a hang."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import zmq
from clients import make_client
from fuzzing import task_header

from dataserver import protocol
from dataserver.admin import fetch_stats
from dataserver.protocol import MsgType
from dataserver_client import DataServerError, NotAuthorized

pytestmark = pytest.mark.timeout(120)


def keygen(directory: Path, name: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "dataserver.cli", "keygen", str(directory), "--name", name],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    for name in ("server", "client", "intruder"):
        keygen(tmp_path, name)
    authorized = tmp_path / "authorized"
    authorized.mkdir()
    shutil.copy(tmp_path / "client.key", authorized / "client.key")
    assert "secret-key" not in (tmp_path / "client.key").read_text()
    return tmp_path


class Relay:
    """A TCP relay that records every byte between a client and a server."""

    def __init__(self, target: str) -> None:
        host, port = target.removeprefix("tcp://").rsplit(":", 1)
        self.target = (host, int(port))
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen()
        self.address = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self.captured = bytearray()
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            for a, b in ((conn, upstream), (upstream, conn)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                with self.lock:
                    self.captured += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.listener.close()


def epoch_indices(address: str, **options: Any) -> list[int]:
    """One epoch's indices, sorted, from a client of ``address``."""
    with make_client(address, batch_size=8, image_size=(32, 32), **options) as c:
        c.set_epoch(0)
        return sorted(i for b in c for idx in b.indices for i in idx)


def curve_server(start_server: Any, keys: Path, *dataset: str) -> Any:
    """A server that accepts only the keys in ``keys / "authorized"``."""
    return start_server(
        *dataset,
        "--curve-secret-key",
        str(keys / "server.key_secret"),
        "--curve-authorized-keys",
        str(keys / "authorized"),
    )


def client_keys(keys: Path, name: str = "client") -> dict[str, Any]:
    return {
        "curve_server_key": str(keys / "server.key"),
        "curve_secret_key": str(keys / f"{name}.key_secret"),
    }


def test_authorized_client_gets_its_epoch_encrypted(start_server: Any, keys: Path) -> None:
    server = curve_server(start_server, keys, "--dataset", "synthetic:images=48,seed=1")
    relay = Relay(server.address)
    try:
        got = epoch_indices(relay.address, **client_keys(keys))
    finally:
        relay.close()
    assert got == list(range(48))
    wire = bytes(relay.captured)
    assert len(wire) > 2000  # the tasks went through the relay (results may go direct) ...
    for plaintext in (b"fingerprint", b"synthetic-48-1", b"dataset_len", b"task_id"):
        assert plaintext not in wire  # ...and none of the protocol is readable on the wire
    assert b"CURVE" in wire[:200]  # the ZMTP greeting names the mechanism


class LoopbackCapture:
    """Every TCP payload byte on the loopback interface (AF_PACKET; needs root)."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.ntohs(0x0003))
        self.sock.bind(("lo", 0))
        self.sock.settimeout(0.2)
        self.data = bytearray()
        self.running = True
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while self.running:
            try:
                self.data += self.sock.recv(1 << 17)
            except TimeoutError:
                continue
            except OSError:
                return

    def stop(self) -> bytes:
        self.running = False
        self.thread.join(2)
        self.sock.close()
        return bytes(self.data)


def capture_or_skip() -> LoopbackCapture:
    try:
        return LoopbackCapture()
    except (PermissionError, OSError, AttributeError) as exc:
        pytest.skip(f"cannot capture loopback traffic here: {exc}")


def test_nothing_readable_on_any_port_with_curve(start_server: Any, keys: Path) -> None:
    """All of the traffic (the data connection, CONTROL on it, and the results workers send
    straight to the client) is captured off the loopback interface: with CURVE none of it
    is plaintext."""
    server = curve_server(  # results over TCP, where the capture sees them, not ipc
        start_server,
        keys,
        "--dataset",
        "ds_plugins:flat",
        "--dataset-args",
        '{"n": 48}',
        "--no-local-results",
    )
    capture = capture_or_skip()
    try:  # (and not written straight into the client's memory: shared_memory=False)
        got = epoch_indices(server.address, shared_memory=False, **client_keys(keys))
        assert got == list(range(48))
    finally:
        wire = capture.stop()
    assert len(wire) > 48 * 32 * 32 * 3  # the images were on the wire...
    # (long markers only: a 3-byte one like b"DS1" turns up in ciphertext by chance)
    for plaintext in (b"fingerprint", b"dataset_len", b"task_id", b"plan_version"):
        assert plaintext not in wire  # ...encrypted, like everything else
    stats = fetch_stats(server.address, 5, *client_keys(keys).values())
    assert stats["counters"].get("results_direct", 0) > 0  # the workers' own sockets included


def test_the_capture_sees_plaintext_without_curve(start_server: Any) -> None:
    server = start_server("--dataset", "ds_plugins:flat", "--dataset-args", '{"n": 48}')
    capture = capture_or_skip()
    try:
        assert epoch_indices(server.address, shared_memory=False) == list(range(48))
    finally:
        wire = capture.stop()
    assert b"fingerprint" in wire and b"task_id" in wire


def test_the_same_check_sees_plaintext_without_curve(start_server: Any) -> None:
    server = start_server("--dataset", "synthetic:images=48,seed=1")
    relay = Relay(server.address)
    try:
        assert epoch_indices(relay.address) == list(range(48))
    finally:
        relay.close()
    wire = bytes(relay.captured)
    assert b"fingerprint" in wire and b"synthetic-48-1" in wire


def test_unknown_key_gets_a_clear_error_within_its_timeout(start_server: Any, keys: Path) -> None:
    server = curve_server(start_server, keys, "--dataset", "synthetic:images=48,seed=1")
    start = time.monotonic()
    with pytest.raises(NotAuthorized, match=f"not authorized by {server.address}"):
        make_client(server.address, timeout=10, **client_keys(keys, "intruder"))
    assert time.monotonic() - start < 10
    with pytest.raises(DataServerError, match=server.address.replace(".", r"\.")):
        make_client(server.address, timeout=2)  # no CURVE at all
    assert server.proc.poll() is None  # the server itself is unharmed and serves others
    assert epoch_indices(server.address, **client_keys(keys)) == list(range(48))
    stats = subprocess.run(
        [
            sys.executable,
            "-m",
            "dataserver.cli",
            "stats",
            server.address,
            "--json",
            "--curve-server-key",
            str(keys / "server.key"),
            "--curve-secret-key",
            str(keys / "client.key_secret"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert stats.returncode == 0, stats.stderr
    assert json.loads(stats.stdout)["rejected"].get("data_not_authorized", 0) >= 1


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--curve-secret-key", "nope"], "go together"),
        (
            ["--curve-secret-key", "/nonexistent.key_secret", "--curve-authorized-keys", "/tmp"],
            "no key file",
        ),
    ],
)
def test_bad_key_flags_exit_with_one_line(flags: list[str], message: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "dataserver.cli", "serve", "--workers", "1", *flags],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert message in proc.stderr


def test_a_session_is_bound_to_the_key_that_opened_it(start_server: Any, keys: Path) -> None:
    """With CURVE, a session id carries a tag of its key: another authorized key can neither
    use it on the data port nor take over its results at a worker."""
    shutil.copy(keys / "intruder.key", keys / "authorized" / "intruder.key")
    server = curve_server(
        start_server, keys, "--dataset", "ds_plugins:flat", "--dataset-args", '{"n": 48}'
    )
    victim = make_client(server.address, batch_size=8, image_size=(32, 32), **client_keys(keys))
    session = next(iter(victim._engine.links or ())).session
    welcome = welcome_over_curve(server.address, keys, "intruder")
    ctx = zmq.Context()
    socks = []
    try:
        intruder = curve_dealer(ctx, keys, "intruder")
        socks.append(intruder)
        intruder.connect(server.address)
        task = task_header(session, 1, 99)
        for mtype, header in (
            (MsgType.HELLO, {"session": session}),
            (MsgType.TASK, task),  # would cancel the victim's queued tasks, were it taken
            (MsgType.BYE, {"session": session}),  # would end the victim's session
        ):
            intruder.send_multipart(protocol.pack(mtype, header))
            assert intruder.poll(5000)
            answer = protocol.decode(intruder.recv_multipart())
            assert isinstance(answer, protocol.ErrorMsg) and answer.kind == "not_owner"
        # Taking the victim's name at the workers' result sockets, claiming it with another
        # key: the workers never send it a result (and the victim's own connections, which
        # hold the name, cannot be taken over).
        thieves = []
        for endpoint in welcome.results:
            thief = curve_dealer(ctx, keys, "intruder")
            thief.setsockopt(zmq.ROUTING_ID, session)
            thief.connect(endpoint)
            socks.append(thief)
            thieves.append(thief)
        time.sleep(0.3)
        for thief in thieves:
            for _ in range(5):
                claim = protocol.Hello(session=session, auth=b"a-guessed-secret")
                thief.send_multipart(claim.encode(), zmq.NOBLOCK)
        # The victim is untouched: its epoch is whole, and the refusals are counted.
        victim.set_epoch(0)
        assert sorted(i for b in victim for idx in b.indices for i in idx) == list(range(48))
        for thief in thieves:
            assert not thief.poll(500), "a worker sent the victim's result to another key"
    finally:
        victim.close()
        for s in socks:
            s.close(linger=0)
        ctx.term()
    # The intruder's key works with a session of its own.
    assert epoch_indices(server.address, **client_keys(keys, "intruder")) == list(range(48))
    stats = fetch_stats(server.address, 5, *client_keys(keys).values())
    assert stats["rejected"]["not_owner"] == 3


def curve_dealer(ctx: zmq.Context[Any], keys: Path, name: str) -> zmq.Socket[Any]:
    from dataserver.security import client_curve_keys

    k = client_curve_keys(str(keys / "server.key"), str(keys / f"{name}.key_secret"))
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.curve_serverkey = k["server_public"]
    s.curve_publickey = k["public"]
    s.curve_secretkey = k["secret"]
    return s


def welcome_over_curve(address: str, keys: Path, name: str) -> protocol.Welcome:
    from dataserver.security import client_curve_keys, session_id

    ctx: zmq.Context[Any] = zmq.Context.instance()
    s = curve_dealer(ctx, keys, name)
    try:
        s.connect(address)
        public = client_curve_keys(str(keys / "server.key"), str(keys / f"{name}.key_secret"))
        sid = session_id(public["public"])
        s.send_multipart(protocol.Hello(session=sid, auth=b"welcome-probe-00").encode())
        assert s.poll(10_000)
        msg = protocol.decode(s.recv_multipart())
        assert isinstance(msg, protocol.Welcome)
        s.send_multipart(protocol.Bye(session=sid, auth=b"welcome-probe-00").encode())
        return msg
    finally:
        s.close(linger=100)
