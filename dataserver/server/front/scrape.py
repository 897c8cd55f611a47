"""A small HTTP server for metrics scrapes: one thread, no thread per client.

``prometheus_client``'s own servers start a thread per connection, so slow or idle clients
hold threads and fds without bound. This one runs a ``selectors`` loop in one thread:

- at most ``MAX_CONNS`` connections open; one more closes the oldest at once (or itself,
  when the oldest is younger than ``EVICT_AGE_S``);
- a connection has ``TIMEOUT_S`` seconds for its whole request and our whole answer, then
  it is closed (a client that trickles its request, or never reads, costs no more);
- the body is rendered by ``render()`` at most every ``RENDER_EVERY_S`` seconds: a flood
  of scrapes costs the front's state one read per period, not one per scrape;
- each peer (the uid at the other end of a connection from this host, else the address:
  ``tcpinfo.peer_key``; uid 65534 scraping from 127.0.0.1 halved the operator's scrapes,
  and scraping from 240 loopback addresses cost +0.45-0.81 of a core) is answered at most
  ``PEER_RATE`` times a second (bursts of ``PEER_BURST``; Prometheus scrapes every 15 s),
  and all peers together at most ``TOTAL_RATE`` (``TOTAL_BURST``), a peer not seen for
  ``QUIET_S`` (a scraper, not a flood: Prometheus comes every 15 s) from a small reserve of
  its own when that is spent (``QUIET_RATE``); a connection over a rate is closed as it is accepted, nothing
  read or written (``rate_refused``, ``total_refused``), and past
  ``REFUSED_PAUSE`` of those in a second the listener is left alone for ``PAUSE_S`` (the
  kernel's backlog holds or refuses the rest), so a flood costs the front's process a
  bounded share of a core whatever its rate: 16 threads scraping as fast as they could
  took +0.41 of a core (~6,900 answers a second), now +0.006 (~100 answered).

It answers ``GET`` / ``HEAD`` of any path but ``/favicon.ico`` with the metrics, one
request per connection (``Connection: close``).
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from dataserver.ratelimit import TokenBucket
from dataserver.tcpinfo import peer_key

log = logging.getLogger("dataserver.metrics")

MAX_CONNS = 32
TIMEOUT_S = 5.0
EVICT_AGE_S = 0.5
RENDER_EVERY_S = 0.5
MAX_REQUEST = 8192  # bytes of request line and headers
PEER_RATE = 50.0  # scrapes answered a second, per peer (a test polling at 20 Hz fits) ...
PEER_BURST = 100.0  # ... at most this many at once
TOTAL_RATE = 100.0  # scrapes answered a second, all peers together ...
TOTAL_BURST = 200.0  # ... at most this many at once
QUIET_RATE = 10.0  # ... and beyond, for peers not seen for QUIET_S (bursts of 20)
QUIET_S = 2.0
MAX_PEERS = 4096  # peers whose rate is remembered (the least recently seen go)
REFUSED_PAUSE = 50  # connections refused for their rate in a second before a pause
PAUSE_S = 0.25
TICK_S = 0.25  # how long stop() may wait for the loop


@dataclass
class _Conn:
    sock: socket.socket
    deadline: float
    inbuf: bytearray = field(default_factory=bytearray)
    out: memoryview | None = None


def _reply(status: str, content_type: str, body: bytes, head: bool = False) -> bytes:
    header = (
        f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    return header if head else header + body


class ScrapeServer:
    """Serves ``render()`` (bytes, content type) on ``host:port`` until ``stop()``."""

    def __init__(self, host: str, port: int, render: Callable[[], tuple[bytes, str]]) -> None:
        self._render = render
        info = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE | socket.AI_NUMERICSERV
        )[0]
        self._listener = socket.socket(info[0], socket.SOCK_STREAM)
        try:
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listener.bind(info[4])
            self._listener.listen(128)
        except OSError:
            self._listener.close()
            raise
        self._listener.setblocking(False)
        self.port = int(self._listener.getsockname()[1])
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ)
        self._conns: dict[socket.socket, _Conn] = {}
        self._cache: tuple[float, bytes, str] | None = None
        self._accept_paused_until = 0.0
        self._stopping = threading.Event()
        self.refused = 0  # connections closed for a newer one: over MAX_CONNS
        self.timed_out = 0
        self.rate_refused = 0  # connections closed at once: their peer over PEER_RATE
        self.total_refused = 0  # ... all peers together over TOTAL_RATE
        self._total = TokenBucket(TOTAL_RATE, TOTAL_BURST)
        self._quiet = TokenBucket(QUIET_RATE, 2 * QUIET_RATE)
        # Each peer's rate, and when a connection of it was last accepted.
        self._peers: OrderedDict[str, tuple[TokenBucket, list[float]]] = OrderedDict()
        self._window = (0.0, 0)  # (its start, connections refused for their rate in it)
        self._thread = threading.Thread(target=self._run, name="metrics-http", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ loop

    def _run(self) -> None:
        """The loop (the one idiom, for a selector): until the stop event, wait at most
        ``TICK_S``; one place catches what ends it, ``finally`` closes every socket."""
        try:
            while not self._stopping.is_set():
                now = time.monotonic()
                if self._accept_paused_until and now >= self._accept_paused_until:
                    self._accept_paused_until = 0.0
                    self._sel.register(self._listener, selectors.EVENT_READ)
                for key, events in self._sel.select(TICK_S):
                    if key.fileobj is self._listener:
                        self._accept(now)
                    else:
                        self._serve(self._conns[key.fileobj], events)  # type: ignore[index]
                now = time.monotonic()
                for conn in [c for c in self._conns.values() if now > c.deadline]:
                    self.timed_out += 1
                    self._close(conn)
        except Exception:  # a bug here must not take the front down with it
            log.exception("the metrics server stopped")
        finally:
            for conn in list(self._conns.values()):
                self._close(conn)
            self._sel.close()
            self._listener.close()

    def _accept(self, now: float) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:  # out of fds: stop listening a moment, or this spins
                log.warning("metrics: accept failed (%s); pausing 0.5 s", exc.strerror or exc)
                self._pause(now + 0.5)
                return
            if not self._within_rate(sock, now):
                sock.close()
                if self._accept_paused_until:
                    return
                continue
            if len(self._conns) >= MAX_CONNS:
                # The oldest goes if it is past EVICT_AGE_S (a scrape takes milliseconds:
                # one that old is slow or idle on purpose), else the newcomer.
                self.refused += 1
                oldest = min(self._conns.values(), key=lambda c: c.deadline)
                if oldest.deadline - TIMEOUT_S > now - EVICT_AGE_S:
                    sock.close()
                    continue
                self._close(oldest)
            sock.setblocking(False)
            conn = _Conn(sock, now + TIMEOUT_S)
            self._conns[sock] = conn
            self._sel.register(sock, selectors.EVENT_READ)

    def _pause(self, until: float) -> None:
        """Stop accepting until ``until`` (the loop listens again then)."""
        self._sel.unregister(self._listener)
        self._accept_paused_until = until

    def _within_rate(self, sock: socket.socket, now: float) -> bool:
        """Whether the peer of the connection just accepted may be answered now (its
        rate, and all peers' together); past ``REFUSED_PAUSE`` refusals in a second,
        accepting pauses for ``PAUSE_S``."""
        peer = peer_key(sock.fileno())
        if peer is None:
            return False
        known = self._peers.get(peer)
        if known is None:
            known = self._peers[peer] = (TokenBucket(PEER_RATE, PEER_BURST), [-QUIET_S])
            if len(self._peers) > MAX_PEERS:
                self._peers.popitem(last=False)
        else:
            self._peers.move_to_end(peer)
        bucket, seen = known
        quiet, seen[0] = now - seen[0] >= QUIET_S, now
        if bucket.take(now):
            if self._total.take(now) or (quiet and self._quiet.take(now)):
                return True
            self.total_refused += 1
        else:
            self.rate_refused += 1
        start, refused = self._window
        if now - start >= 1.0:
            start, refused = now, 0
        self._window = (start, refused + 1)
        if refused + 1 >= REFUSED_PAUSE:
            self._pause(now + PAUSE_S)
        return False

    def _serve(self, conn: _Conn, events: int) -> None:
        try:
            if events & selectors.EVENT_READ and conn.out is None:
                data = conn.sock.recv(4096)
                if not data:
                    self._close(conn)
                    return
                conn.inbuf += data
                if b"\r\n\r\n" in conn.inbuf:
                    self._answer(conn)
                elif len(conn.inbuf) > MAX_REQUEST:
                    self._respond(
                        conn, _reply("431 Request Header Fields Too Large", "text/plain", b"")
                    )
            if events & selectors.EVENT_WRITE and conn.out is not None:
                self._write(conn)
        except OSError:
            self._close(conn)

    def _answer(self, conn: _Conn) -> None:
        line = bytes(conn.inbuf.split(b"\r\n", 1)[0]).decode("latin-1")
        parts = line.split()
        method, path = (parts[0], parts[1]) if len(parts) >= 2 else ("", "")
        if method not in ("GET", "HEAD"):
            self._respond(conn, _reply("405 Method Not Allowed", "text/plain", b""))
        elif path.split("?", 1)[0] == "/favicon.ico":
            self._respond(conn, _reply("404 Not Found", "text/plain", b"", method == "HEAD"))
        else:
            body, content_type = self._body()
            self._respond(conn, _reply("200 OK", content_type, body, method == "HEAD"))

    def _body(self) -> tuple[bytes, str]:
        now = time.monotonic()
        if self._cache is None or now - self._cache[0] >= RENDER_EVERY_S:
            body, content_type = self._render()
            self._cache = (now, body, content_type)
        return self._cache[1], self._cache[2]

    def _respond(self, conn: _Conn, data: bytes) -> None:
        conn.out = memoryview(data)
        self._sel.modify(conn.sock, selectors.EVENT_WRITE)
        self._write(conn)

    def _write(self, conn: _Conn) -> None:
        if conn.out is None:
            return
        sent = conn.sock.send(conn.out)
        conn.out = conn.out[sent:]
        if not conn.out:
            self._close(conn)

    def _close(self, conn: _Conn) -> None:
        if self._conns.pop(conn.sock, None) is None:
            return
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()

    # ------------------------------------------------------------ control

    def stop(self, timeout: float = 5.0) -> bool:
        """Stop serving, close every connection and the listener (idempotent): whether
        the thread ended within ``timeout`` (it sees the stop within ``TICK_S``; if it
        did not, that is logged: it is a daemon thread and goes with the process)."""
        self._stopping.set()
        if self._thread is threading.current_thread():
            return False
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("the metrics server did not stop within %g s", timeout)
            return False
        return True
