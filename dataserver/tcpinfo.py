"""What the kernel knows of a connected socket, by fd: its peer, and (TCP) how many bytes it
received and when data last came; and ``malloc_trim``, for the memory a connection held. Shared by the server's connection tracking
(``dataserver.server.conns``) and the client's bound on what a server may hold unfinished
(``dataserver_client.links.Inflow``): both weigh the bytes a connection received against
the complete messages read from it, since libzmq bounds a frame but not a message."""

from __future__ import annotations

import ctypes
import socket
import struct

_TCP_INFO_LAST_DATA_RECV = 52  # offsets in the kernel's struct tcp_info (linux/tcp.h)
_TCP_INFO_BYTES_RECEIVED = 128
_SOCKADDR_MAX = 128

_libc: ctypes.CDLL | None = None


def libc() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        # The process's own symbols (libc's among them): no ``find_library``, which runs
        # ldconfig in a subprocess.
        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc


def peer_of(fd: int) -> bytes | None:
    """The raw peer address of socket ``fd`` (None: not a connected socket)."""
    buf = ctypes.create_string_buffer(_SOCKADDR_MAX)
    size = ctypes.c_uint32(_SOCKADDR_MAX)
    if libc().getpeername(fd, buf, ctypes.byref(size)) != 0:
        return None
    return buf.raw[: size.value]


def tcp_info(fd: int) -> tuple[int, int | None] | None:
    """(ms since data last arrived, bytes received or None on an old kernel) of TCP socket
    ``fd``; None if it is not one."""
    buf = ctypes.create_string_buffer(256)
    size = ctypes.c_uint32(256)
    if libc().getsockopt(fd, socket.IPPROTO_TCP, socket.TCP_INFO, buf, ctypes.byref(size)) != 0:
        return None
    n = size.value
    if n < _TCP_INFO_LAST_DATA_RECV + 4:
        return None
    (last_recv,) = struct.unpack_from("I", buf.raw, _TCP_INFO_LAST_DATA_RECV)
    received = None
    if n >= _TCP_INFO_BYTES_RECEIVED + 8:
        (received,) = struct.unpack_from("Q", buf.raw, _TCP_INFO_BYTES_RECEIVED)
    return int(last_recv), received


def bytes_received(fd: int) -> int | None:
    """The bytes TCP socket ``fd`` received so far (None: not a TCP socket, or an old
    kernel)."""
    info = tcp_info(fd)
    return None if info is None else info[1]


def malloc_trim() -> bool:
    """Give the heap's free pages back to the kernel (glibc); False where there is none."""
    try:
        return bool(libc().malloc_trim(0))
    except AttributeError:
        return False
