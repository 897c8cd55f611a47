"""Issue 40, item 5: planted operator paths. Another local user (uid 65534, a real process:
a fork that speaks ZMTP over a plain socket, ``zmtp.py``) makes the admin registry
directory first, or recreates a killed server's state directory (a tmp cleaner removed
it) and answers at its ``admin`` socket, or takes over a dead server's TCP port: the
server says so and keeps serving, and ``dataserver stats --check`` never exits 0 on a
planted answer."""

from __future__ import annotations

import encodings.idna  # noqa: F401  (uid 65534's child may not read the venv)
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import Server, server_env, wait_until
from test_bounds import SAMPLES, host_port
from zmtp import accept_as, read_message, send_message

from dataserver.protocol import Stats, decode

pytestmark = pytest.mark.timeout(180)

NOBODY = 65534
PLANTED_ID = "planted00000"


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A directory like /tmp (1777: every user may make names in it), removed after."""
    if os.getuid() != 0:
        pytest.skip("needs root to act as uid 65534")
    path = Path(tempfile.mkdtemp(prefix="ds-planted-", dir="/tmp"))
    os.chmod(path, 0o1777)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _as_nobody(action: Any, wait: bool) -> int:
    """``action()`` in a child of uid 65534; its pid (``wait``: reaped, and it succeeded)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            action()
            code = 0
        finally:
            os._exit(code)
    if wait:
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    return pid


def _fake_stats(listener: socket.socket) -> None:
    """Answer every STATS on ``listener`` (ZMTP, as a ROUTER) with a healthy server's
    counters under ``PLANTED_ID``."""
    stats = {
        "server_id": PLANTED_ID,
        "workers": 1,
        "workers_alive": 1,
        "uptime_s": 1,
        "counters": {},
        "rejected": {},
    }
    listener.settimeout(None)
    while True:
        try:
            conn = accept_as(listener, b"ROUTER")
        except OSError:  # (a probe that only connected)
            continue
        try:
            request = decode(read_message(conn))
            if isinstance(request, Stats):
                send_message(conn, [bytes(memoryview(f)) for f in Stats(stats=stats).encode()])
        except (OSError, ConnectionError):
            pass
        finally:
            conn.close()


def _stats_check(address: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dataserver.cli", "stats", address, "--check", "--json",
         "--timeout", "3"],
        capture_output=True, text=True, timeout=60, env=server_env(env),
    )  # fmt: skip


def _entry_of(server: Server, registries: list[Path]) -> tuple[Path, dict[str, Any]]:
    port = host_port(server.address)[1]
    for where in registries:
        path = where / f"port-{port}.{server.pid}"
        if path.exists():
            return path, json.loads(path.read_text())
    raise AssertionError(f"no registry entry for {server.address} in {registries}")


def test_a_planted_registry_directory_is_refused_and_said(
    start_server: Any, shared_tmp: Path
) -> None:
    """uid 65534 makes the registry directory (0777, its own) before the operator's server
    starts: the server used nothing there and said nothing. It refuses it with an error
    naming the directory and its owner, writes nothing into it, and serves; the operator's
    `stats --check` is answered over the data port by the real server."""
    registry = shared_tmp / "dataserver-0"

    def plant() -> None:
        registry.mkdir()
        os.chmod(registry, 0o777)

    _as_nobody(plant, wait=True)
    env = {"DATASERVER_REGISTRY": str(registry), "TMPDIR": str(shared_tmp)}
    server = start_server("--dataset", f"synthetic:images={SAMPLES}", workers=1, env=env)
    assert wait_until(lambda: "not this user's own" in server.read_stderr(), 10), (
        server.read_stderr()
    )
    said = server.read_stderr()
    assert str(registry) in said and f"owned by uid {NOBODY}" in said, said
    assert os.listdir(registry) == []
    out = _stats_check(server.address, env)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["server_id"] == server.stats()["server_id"]


def test_a_recreated_state_directory_is_not_believed(start_server: Any, shared_tmp: Path) -> None:
    """A server is SIGKILLed (its registry entry stays), a tmp cleaner removes its state
    directory, and uid 65534 recreates it and answers STATS at ``admin`` as a healthy
    server: root's `stats --check` exited 0 with the planted ``server_id``. The directory is
    not root's, 0700, and the socket's listener is not the registered pid: not asked, and
    the dead server's port does not answer: exit 1."""
    registry = shared_tmp / "registry"
    env = {"DATASERVER_REGISTRY": str(registry), "TMPDIR": str(shared_tmp)}
    server = start_server("--dataset", f"synthetic:images={SAMPLES}", workers=1, env=env)
    _, entry = _entry_of(server, [registry, Path(f"/tmp/dataserver-{os.getuid()}")])
    admin = Path(entry["admin"].removeprefix("ipc://"))
    os.kill(server.pid, signal.SIGKILL)
    server.proc.wait(30)
    shutil.rmtree(admin.parent)  # the tmp cleaner

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)

    def plant() -> None:
        admin.parent.mkdir(mode=0o700)
        listener.bind(str(admin))
        listener.listen(16)
        _fake_stats(listener)

    liar = _as_nobody(plant, wait=False)
    try:
        assert wait_until(admin.exists, 10)
        out = _stats_check(server.address, env)
    finally:
        os.kill(liar, signal.SIGKILL)
        os.waitpid(liar, 0)
        listener.close()
    assert out.returncode != 0, out.stdout
    assert PLANTED_ID not in out.stdout


def test_a_dead_servers_port_taken_over_is_not_believed(
    start_server: Any, shared_tmp: Path
) -> None:
    """A server is SIGKILLed and uid 65534 takes its TCP port, answering STATS as a healthy
    server: `stats --check` exited 0 with the foreign ``server_id``. The server registered at
    that port here is another (and gone): the answer is refused, exit 1, naming both."""
    registry = shared_tmp / "registry"
    env = {"DATASERVER_REGISTRY": str(registry), "TMPDIR": str(shared_tmp)}
    server = start_server("--dataset", f"synthetic:images={SAMPLES}", workers=1, env=env)
    real_id = server.stats()["server_id"]
    host, port = host_port(server.address)
    os.kill(server.pid, signal.SIGKILL)
    server.proc.wait(30)
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)

    def take_over() -> None:
        listener.bind((host, port))
        listener.listen(16)
        _fake_stats(listener)

    liar = _as_nobody(take_over, wait=False)
    try:
        assert wait_until(lambda: _listening(host, port), 10)
        out = _stats_check(server.address, env)
    finally:
        os.kill(liar, signal.SIGKILL)
        os.waitpid(liar, 0)
        listener.close()
    assert out.returncode != 0, out.stdout
    assert PLANTED_ID not in out.stdout
    assert real_id in out.stderr and "another process holds the port" in out.stderr, out.stderr


def _listening(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False
