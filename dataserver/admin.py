"""Asking a live server for its counters: what ``dataserver stats``, the bench and the tests
use (here, below both, so that neither imports the other)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import zmq

from dataserver import adminsock
from dataserver.protocol import ProtocolError, Stats, decode


def fetch_stats(
    address: str,
    timeout: float,
    curve_server_key: str | None = None,
    curve_secret_key: str | None = None,
) -> dict[str, Any]:
    """Ask a live server for its counters (raises TimeoutError when it does not answer).
    On the server's own host, as its user, over its admin socket (``adminsock``: never
    crowded out by other users' STATS; trusted only when verified, and its answer only
    with the ``server_id`` registered), else, or when that does not answer, over
    ``address``. Where a server of this user is registered at that port here, an answer
    over ``address`` with another ``server_id`` is refused (``ProtocolError``): another
    process holds the port of a server that is gone."""
    expected = adminsock.registered(address)
    for found in expected:
        if not found.live:
            continue
        try:
            stats = _ask(found.admin, timeout, None, None)
        except (TimeoutError, ProtocolError, zmq.ZMQError):
            continue  # (a server that just went, or is replaced: ask over the address)
        if stats.get("server_id") != found.server_id:
            raise ProtocolError(
                f"the admin socket of server {found.server_id} (pid {found.pid}) answered "
                f"as {stats.get('server_id')!r}"
            )
        return stats
    stats = _ask(address, timeout, curve_server_key, curve_secret_key)
    ids = {found.server_id for found in expected}
    if expected and stats.get("server_id") not in ids:
        named = ", ".join(
            f"{f.server_id} (pid {f.pid}, {'running' if f.live else 'gone'})" for f in expected
        )
        raise ProtocolError(
            f"{address} answered as server {stats.get('server_id')!r}, but the server "
            f"registered at that port on this host is {named}: another process holds the port"
        )
    return stats


def _ask(
    address: str,
    timeout: float,
    curve_server_key: str | None,
    curve_secret_key: str | None,
) -> dict[str, Any]:
    ctx: zmq.Context[Any] = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if curve_server_key or curve_secret_key:
        from dataserver.security import client_curve_keys

        if not (curve_server_key and curve_secret_key):
            raise ValueError("--curve-server-key and --curve-secret-key go together")
        keys = client_curve_keys(curve_server_key, curve_secret_key)
        sock.curve_serverkey = keys["server_public"]
        sock.curve_publickey = keys["public"]
        sock.curve_secretkey = keys["secret"]
    try:
        sock.connect(address)
        sock.send_multipart(Stats().encode())
        if not sock.poll(int(timeout * 1000)):
            raise TimeoutError(f"no answer from {address} within {timeout:g} s")
        msg = decode(sock.recv_multipart())
        if not isinstance(msg, Stats) or msg.stats is None:
            raise ProtocolError(f"expected a STATS reply, got {msg.TYPE.name}")
        return dict(msg.stats)
    finally:
        sock.close(linger=0)


def child_pids(pid: int) -> list[int]:
    """The children of process ``pid`` on this host (a server's workers), from /proc: the
    server does not tell its pids to whoever asks for its counters."""
    children: set[int] = set()
    for path in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            children.update(int(p) for p in path.read_text().split())
        except (OSError, ValueError):  # (a thread that ended while we looked)
            continue
    return sorted(children)
