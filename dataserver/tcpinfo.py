"""What the kernel knows of a connected socket, by fd: its peer, (TCP) how many bytes it
received and when data last came, and (an end on this host: loopback or any of the host's
own addresses) which user holds its other end; and
``malloc_trim``, for the memory a connection held. Shared by the server's connection
tracking (``dataserver.server.conns``) and the client's bound on what a server may hold
unfinished (``dataserver_client.net.inflow.Inflow``): both weigh the bytes a connection
received against the complete messages read from it, since libzmq bounds a frame but not a
message."""

from __future__ import annotations

import ctypes
import ipaddress
import os
import socket
import struct
import threading
import time
from typing import Any

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


class _InfoBuffers(threading.local):
    """Each thread's buffer for ``tcp_info`` (the front reads 4,000 connections' a second:
    no new buffer, no copy)."""

    def __init__(self) -> None:
        self.info = ctypes.create_string_buffer(256)


_buffers = _InfoBuffers()


def tcp_info(fd: int) -> tuple[int, int | None] | None:
    """(ms since data last arrived, bytes received or None on an old kernel) of TCP socket
    ``fd``; None if it is not one."""
    b = _buffers
    size = ctypes.c_uint32(256)
    if libc().getsockopt(fd, socket.IPPROTO_TCP, socket.TCP_INFO, b.info, ctypes.byref(size)):
        return None
    n = size.value
    if n < _TCP_INFO_LAST_DATA_RECV + 4:
        return None
    (last_recv,) = struct.unpack_from("I", b.info, _TCP_INFO_LAST_DATA_RECV)
    received = None
    if n >= _TCP_INFO_BYTES_RECEIVED + 8:
        (received,) = struct.unpack_from("Q", b.info, _TCP_INFO_BYTES_RECEIVED)
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


_NETLINK_SOCK_DIAG = 4  # NETLINK_SOCK_DIAG (linux/netlink.h)
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST = 1
_INET_DIAG_NOCOOKIE = 0xFFFFFFFF
_DIAG_MSG_UID = 16 + 64  # nlmsghdr, then inet_diag_msg's idiag_uid


# Whether an address is one of this host's, asked again after this many seconds (an
# address may be added or removed), for at most this many addresses at once.
LOCAL_ADDRESS_TTL_S = 10.0
LOCAL_ADDRESSES_KEPT = 4096
_local: dict[tuple[int, str], tuple[bool, float]] = {}


def is_local_address(family: int, host: str, scope: int = 0) -> bool:
    """Whether ``host`` is an address of this host (of its network namespace): loopback,
    or one an interface holds, which a socket may bind to (the kernel asked, no list of
    interfaces read); remembered for ``LOCAL_ADDRESS_TTL_S``."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    if ip.is_loopback:
        return True
    now = time.monotonic()
    key = (family, host)
    known = _local.get(key)
    if known is not None and now - known[1] < LOCAL_ADDRESS_TTL_S:
        return known[0]
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.bind((host, 0) if family == socket.AF_INET else (host, 0, 0, scope))
        local = True
    except OSError:  # EADDRNOTAVAIL: not this host's
        local = False
    if len(_local) >= LOCAL_ADDRESSES_KEPT:
        _local.clear()
    _local[key] = (local, now)
    return local


def loopback_uid(fd: int) -> int | None:
    """The uid owning the other end of TCP socket ``fd``, when that end is on this host:
    over loopback or from any of the host's own addresses (issue 40 item 4: uid 65534
    connecting to the host's non-loopback address was everyone there). Its socket is found
    by the connection's addresses through the kernel's sock_diag, as ``ss -e`` does; None
    otherwise, or where the kernel does not say. Every local user shares the host's
    addresses: the uid tells them apart."""
    ends = _tcp_ends(fd)
    return None if ends is None else _local_uid(*ends)


def _ends(fd: int) -> tuple[int, Any, Any] | None:
    """(family, peer address, own address) of connected socket ``fd``; None when it is no
    connected socket."""
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
    with sock:
        try:
            return sock.family, sock.getpeername(), sock.getsockname()
        except OSError:
            return None


def _tcp_ends(fd: int) -> tuple[int, tuple[Any, ...], tuple[Any, ...]] | None:
    """(family, peer address, own address) of TCP socket ``fd``; None when it is not a
    connected IPv4/IPv6 socket."""
    ends = _ends(fd)
    return ends if ends is not None and ends[0] in (socket.AF_INET, socket.AF_INET6) else None


def connection_ends(fd: int) -> tuple[bytes, bytes] | None:
    """(peer end, own end) of connected socket ``fd`` as bytes that name them the same from
    either side: ``HOST:PORT`` (``[HOST]:PORT`` for IPv6; an IPv4 address mapped into IPv6,
    as a dual-stack listener sees it, in its IPv4 form), ``unix:PATH`` for a unix socket
    (an unnamed end: ``unix:``). None when ``fd`` is no connected socket of those families.
    What a server's host proof binds (``dataserver.security.proof_ends``)."""
    ends = _ends(fd)
    if ends is None:
        return None
    family, peer, own = ends
    if family == socket.AF_UNIX:
        return _unix_end(peer), _unix_end(own)
    if family in (socket.AF_INET, socket.AF_INET6):
        return _inet_end(peer), _inet_end(own)
    return None


def _unix_end(name: str | bytes) -> bytes:
    return b"unix:" + (name if isinstance(name, bytes) else os.fsencode(name))


def _inet_end(addr: tuple[Any, ...]) -> bytes:
    host = str(addr[0]).split("%", maxsplit=1)[0]
    v4 = _mapped(host) if ":" in host else host
    return (f"{v4}:{addr[1]}" if v4 is not None else f"[{host}]:{addr[1]}").encode()


def _local_uid(family: int, peer: tuple[Any, ...], ours: tuple[Any, ...]) -> int | None:
    """``loopback_uid`` for a connection's ends."""
    if family == socket.AF_INET6:
        mapped = _mapped(peer[0]), _mapped(ours[0])
        if mapped[0] is not None and mapped[1] is not None:
            # (an IPv4 client of a dual-stack socket: its own socket is an IPv4 one)
            family, peer, ours = socket.AF_INET, (mapped[0], peer[1]), (mapped[1], ours[1])
    scope = peer[3] if len(peer) > 3 else 0
    if not is_local_address(family, peer[0], scope):
        return None
    return _diag_uid(family, peer, ours)


def _mapped(host: str) -> str | None:
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    v4 = getattr(ip, "ipv4_mapped", None)
    return None if v4 is None else str(v4)


def peer_key(fd: int) -> str | None:
    """Who is at the other end of TCP socket ``fd``, for a bound that charges a peer:
    ``uid:N`` for an end on this host (every local user shares 127.0.0.1 and the host's
    other addresses), else its address; None
    when it is not a connected TCP socket."""
    ends = _tcp_ends(fd)
    if ends is None:
        return None
    uid = _local_uid(*ends)
    return str(ends[1][0]) if uid is None else f"uid:{uid}"


def _packed(family: int, host: str) -> bytes:
    return socket.inet_pton(family, host.split("%", maxsplit=1)[0]).ljust(16, b"\x00")


def _diag_uid(family: int, src: tuple[Any, ...], dst: tuple[Any, ...]) -> int | None:
    """The uid of the TCP socket bound at ``src`` connected to ``dst`` (sock_diag)."""
    sockid = (
        struct.pack(">HH", src[1], dst[1])
        + _packed(family, src[0])
        + _packed(family, dst[0])
        + struct.pack("=III", 0, _INET_DIAG_NOCOOKIE, _INET_DIAG_NOCOOKIE)
    )
    req = struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 0, 0, 0xFFFFFFFF) + sockid
    header = struct.pack("=IHHII", 16 + len(req), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, 1, 0)
    try:
        with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG) as nl:
            nl.settimeout(1.0)
            nl.send(header + req)
            reply = nl.recv(8192)
    except (OSError, AttributeError):  # (no netlink: not Linux)
        return None
    if len(reply) < _DIAG_MSG_UID + 4:
        return None
    kind = struct.unpack_from("=H", reply, 4)[0]
    if kind != _SOCK_DIAG_BY_FAMILY:  # NLMSG_ERROR: no such socket (gone, or not ours)
        return None
    return int(struct.unpack_from("=I", reply, _DIAG_MSG_UID)[0])
