"""A raw ZMTP 3.0 peer over a plain TCP socket (NULL mechanism): what a hostile client
written without libzmq does -- finish the handshake and idle, or send frames that never
end a message. One fd per connection, nothing answered by itself (no PONGs)."""

from __future__ import annotations

import socket
import struct
import time

MORE, LONG, COMMAND = 0x01, 0x02, 0x04


def _greeting() -> bytes:
    # signature (10) + version 3.0 (2) + mechanism "NULL" padded to 20 + as-server 0 + filler 31
    return b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" * 32


def _command(name: bytes, body: bytes) -> bytes:
    payload = bytes([len(name)]) + name + body
    return bytes([COMMAND, len(payload)]) + payload


def _ready(socket_type: bytes, identity: bytes = b"") -> bytes:
    props = [(b"Socket-Type", socket_type)] + ([(b"Identity", identity)] if identity else [])
    body = b"".join(bytes([len(k)]) + k + struct.pack(">I", len(v)) + v for k, v in props)
    return _command(b"READY", body)


def frame_header(size: int, more: bool) -> bytes:
    """The header of one message frame of ``size`` bytes."""
    flags = MORE if more else 0
    if size < 256:
        return bytes([flags, size])
    return bytes([flags | LONG]) + struct.pack(">Q", size)


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ConnectionError("peer closed during the handshake")
        out += chunk
    return out


def handshake(
    host: str,
    port: int,
    socket_type: bytes = b"DEALER",
    timeout: float = 10.0,
    identity: bytes = b"",
) -> socket.socket:
    """A TCP connection that has finished the ZMTP handshake with a ROUTER/SUB there (as
    ``identity``: the name a ROUTER knows it by)."""
    sock = socket.create_connection((host, port), timeout=timeout)
    try:
        sock.sendall(_greeting())
        _read_exactly(sock, 64)
        sock.sendall(_ready(socket_type, identity))
        flags, size = _read_exactly(sock, 2)
        if flags & LONG:
            size = struct.unpack(">Q", bytes([size]) + _read_exactly(sock, 7))[0]
        _read_exactly(sock, size)  # the server's READY
    except BaseException:
        sock.close()
        raise
    return sock


def closed_by_peer(sock: socket.socket, timeout: float) -> bool:
    """Whether the other side closed ``sock`` within ``timeout`` (PINGs it sends are read
    and ignored)."""
    deadline = time.monotonic() + timeout
    try:
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            if not sock.recv(4096):
                return True
    except TimeoutError:
        return False
    except OSError:
        return True
    return False


def read_frame(sock: socket.socket) -> tuple[int, bytes]:
    """One frame (or command) off ``sock``: (flags, body)."""
    flags, size = _read_exactly(sock, 2)
    if flags & LONG:
        size = struct.unpack(">Q", bytes([size]) + _read_exactly(sock, 7))[0]
    return flags, _read_exactly(sock, size)


def accept_as(listener: socket.socket, socket_type: bytes = b"ROUTER") -> socket.socket:
    """The next connection to ``listener``, its ZMTP handshake done as a ``socket_type``
    (what a hostile server written without libzmq does)."""
    sock, _ = listener.accept()
    try:
        sock.sendall(_greeting())
        _read_exactly(sock, 64)
        flags, _ = read_frame(sock)  # the peer's READY
        if not flags & COMMAND:
            raise ConnectionError("expected the peer's READY")
        sock.sendall(_ready(socket_type))
    except BaseException:
        sock.close()
        raise
    return sock


def read_message(sock: socket.socket) -> list[bytes]:
    """The next message's frames (commands, e.g. PINGs, skipped)."""
    frames: list[bytes] = []
    while True:
        flags, body = read_frame(sock)
        if flags & COMMAND:
            continue
        frames.append(body)
        if not flags & MORE:
            return frames


def send_message(sock: socket.socket, frames: list[bytes]) -> None:
    out = b""
    for i, frame in enumerate(frames):
        out += frame_header(len(frame), i < len(frames) - 1) + frame
    sock.sendall(out)
