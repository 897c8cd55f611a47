"""The operator's way in: an admin socket other users cannot reach.

The public STATS on the data port is rate-limited per peer (20/s on this host, as much again
for the rest), so a local user sending STATS 100 times a second left `dataserver stats
--check` (a Kubernetes probe) answered 2 times of 10. A server also answers STATS on an ipc
socket, ``admin``, in its private state directory (mode 0700: only its own user gets in),
with a rate of its own. ``dataserver stats ADDR`` finds it from ADDR on the server's host:
the server writes where it is in a registry, one file per server (its data port's address and
network namespace), in a directory only its user can read (``$XDG_RUNTIME_DIR/dataserver``
when that is the user's own, else ``/tmp/dataserver-UID``; a directory that is not exactly
the user's own, 0700, is not used, so nobody can plant one for it). The command asks there
when ADDR names this host and a live server of this network namespace is bound to ADDR's
port there; otherwise, or when that fails, over ADDR as before.

Planted paths (issue 40): another user who makes ``/tmp/dataserver-UID`` first, or who
recreates a dead server's state directory (a tmp cleaner removed it) and listens at its
``admin``, or who takes over a dead server's TCP port, must not be believed. So the server
refuses a registry directory that is not its user's own, 0700, with an error that says so
(it serves on its data port all the same); an entry names the server's pid and
``server_id``; the command trusts an admin socket only in a directory of its user's, 0700,
a socket of its user's whose listener (``SO_PEERCRED``) is that pid of that user, and an
answer only with that ``server_id``. An entry whose server is gone stays (the next server
on the port replaces it): over ADDR, an answer with another ``server_id`` than a server
registered there is refused (``Expected``), so ``stats --check`` fails.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import socket
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dataserver.endpoint import tcp_endpoint
from dataserver.security import read_own_file

log = logging.getLogger("dataserver.admin")

ADMIN_NAME = "admin"
# Where the registry is instead of ``/tmp/dataserver-UID`` (the same checks apply).
REGISTRY_ENV = "DATASERVER_REGISTRY"
_SO_PEERCRED = getattr(socket, "SO_PEERCRED", 17)


class PlantedError(RuntimeError):
    """A path the server or the command would trust is not its user's own."""


@dataclass(frozen=True)
class Expected:
    """What a server registered at a port on this host is: its ``server_id`` and pid, its
    admin endpoint, and whether that pid still holds it (``live``)."""

    admin: str
    server_id: str
    pid: int
    live: bool


def registry_dir(create: bool = False) -> Path | None:
    """The user's own registry directory (made 0700 when ``create``), or None when there
    is none that is safely this user's alone. With ``create`` (the server), a directory
    there that is not this user's own, 0700 (someone planted it) is logged as an error."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    candidates = []
    if base and _own_private(Path(base)):
        candidates.append(Path(base, "dataserver"))
    override = os.environ.get(REGISTRY_ENV)
    candidates.append(Path(override) if override else Path("/tmp", f"dataserver-{os.getuid()}"))
    for path in candidates:
        if create:
            try:
                path.mkdir(mode=0o700, exist_ok=True)
            except OSError:
                continue
        problem = _not_own_private(path)
        if problem is None:
            return path
        if create and problem != "missing":
            log.error(
                "the admin registry %s is not this user's own: %s (planted by another user?); "
                "not used: this server keeps no registry and `dataserver stats` asks it over "
                "its data port. Remove it, or set %s to a directory of your own",
                path,
                problem,
                REGISTRY_ENV,
            )
    return None


def _not_own_private(path: Path) -> str | None:
    """What keeps ``path`` from being a real directory (not a link) of this user that no
    one else may enter or list; None when it is one."""
    try:
        st = os.lstat(path)
    except OSError:
        return "missing"
    if not stat.S_ISDIR(st.st_mode):
        return "not a directory"
    if st.st_uid != os.getuid():
        return f"owned by uid {st.st_uid}, not {os.getuid()}"
    if st.st_mode & 0o077:
        return f"mode {stat.S_IMODE(st.st_mode):04o}, not 0700"
    return None


def _own_private(path: Path) -> bool:
    return _not_own_private(path) is None


def port_of(address: str) -> int | None:
    """The TCP port of a ``tcp://HOST:PORT`` address, else None."""
    tcp = tcp_endpoint(address)
    return int(tcp.port) if tcp else None


def register(data_endpoint: str, admin_endpoint: str, server_id: str = "") -> Path | None:
    """Record that the server whose data socket is ``data_endpoint`` answers the operator
    at ``admin_endpoint`` (an ipc address) as ``server_id``; the file written, or None
    (logged). Entries of that port whose server is gone are removed.

    One file per server (``port-PORT.PID``), saying where its data socket is bound and in
    which network namespace: two servers may hold one port number on two addresses of a
    host, or in two namespaces (nodes played by namespaces share the file system)."""
    tcp = tcp_endpoint(data_endpoint)
    where = registry_dir(create=True)
    if tcp is None or where is None:
        log.info(
            "no admin registry for %s: `dataserver stats` asks over the data port", data_endpoint
        )
        return None
    entry = json.dumps(
        {
            "admin": admin_endpoint,
            "host": tcp.address,
            "netns": _netns(),
            "pid": os.getpid(),
            "server_id": server_id,
        }
    )
    for old in where.glob(f"port-{tcp.port}.*"):  # (servers gone: killed, they could not say)
        found = _read_entry(old)
        if found is not None and found.get("netns") == _netns() and not _alive(found.get("pid")):
            try:
                old.unlink()
            except OSError:
                pass
    path = where / f"port-{tcp.port}.{os.getpid()}"
    tmp = where / f".port-{tcp.port}.{os.getpid()}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(entry)
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("cannot write the admin registry %s: %s", path, exc)
        return None
    return path


def unregister(path: Path | None, admin_endpoint: str) -> None:
    """Remove the registry file, if it still names this server's admin socket."""
    if path is None:
        return
    entry = _read_entry(path)
    if entry is not None and entry.get("admin") == admin_endpoint:
        try:
            path.unlink()
        except OSError:
            pass


def lookup(address: str) -> str | None:
    """The admin endpoint of the live server at ``address`` (``registered``), or None."""
    for found in registered(address):
        if found.live:
            return found.admin
    return None


def registered(address: str) -> list[Expected]:
    """The servers registered at ``address``'s port on this host as this user: a server in
    this network namespace bound to the port on one of ``address``'s IPs, or on every
    address; ``live`` where its admin socket is verified (``admin_problem``)."""
    tcp = tcp_endpoint(address)
    if tcp is None:
        return []
    host = tcp.address
    where = registry_dir()
    if where is None or not _is_this_host(host):
        return []
    ips = _ips_of(host)
    here = _netns()
    out = []
    for path in sorted(where.glob(f"port-{tcp.port}.*")):
        entry = _read_entry(path)
        if entry is None or entry.get("netns") != here:
            continue
        bound = str(entry.get("host", ""))
        if bound not in ("*", "0.0.0.0", "::") and not ips & _ips_of(bound):
            continue
        endpoint = str(entry.get("admin", ""))
        pid = entry.get("pid")
        if not endpoint.startswith("ipc://") or not isinstance(pid, int):
            continue
        problem = admin_problem(endpoint[len("ipc://") :], pid)
        if problem is not None:
            log.info("%s: not asked (%s)", endpoint, problem)
        out.append(Expected(endpoint, str(entry.get("server_id", "")), pid, problem is None))
    return out


def admin_problem(path: str, pid: int) -> str | None:
    """Why the unix socket at ``path`` is not server ``pid``'s admin socket, or None: its
    directory must be this user's, 0700 (no one else can replace what is in it), the
    socket this user's, and the process listening on it (``SO_PEERCRED``) ``pid`` of this
    user."""
    problem = _not_own_private(Path(path).parent)
    if problem is not None:
        return f"its directory is {problem}"
    try:
        st = os.lstat(path)
    except OSError:
        return "no socket"
    if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.getuid():
        return "not a socket of this user's"
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(1.0)
            probe.connect(path)
            creds = probe.getsockopt(socket.SOL_SOCKET, _SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return "nobody listens"
    their_pid, uid, _ = struct.unpack("3i", creds)
    if uid != os.getuid() or their_pid != pid:
        return f"it is held by pid {their_pid} of uid {uid}, not the registered pid {pid}"
    return None


def _alive(pid: object) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read_entry(path: Path) -> dict[str, Any] | None:
    """A registry file's entry: a regular file of this user's holding a JSON object."""
    raw = read_own_file(path, 4096)
    if raw is None:
        return None
    try:
        entry = json.loads(raw)
    except ValueError:
        return None
    return entry if isinstance(entry, dict) else None


def _netns() -> str | None:
    """This process's network namespace (where a TCP port is bound), or None off Linux."""
    try:
        st = os.stat("/proc/self/ns/net")
    except OSError:
        return None
    return f"{st.st_dev}:{st.st_ino}"


def _ips_of(host: str) -> set[str]:
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_DGRAM)
    except OSError:
        return set()
    return {str(ipaddress.ip_address(info[4][0])) for info in infos}


def _is_this_host(host: str) -> bool:
    """Whether ``host`` (a name or an address) is an address of this machine: one a socket
    can be bound to here."""
    if host in ("localhost", "*"):
        return True
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_DGRAM)
    except OSError:
        return False
    for family, _, _, _, sockaddr in infos:
        ip = ipaddress.ip_address(sockaddr[0])
        if ip.is_loopback or ip.is_unspecified:
            return True
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.bind((sockaddr[0], 0))
            return True
        except OSError:
            continue
    return False
