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
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import socket
import stat
from pathlib import Path
from typing import Any

from dataserver.endpoint import tcp_endpoint
from dataserver.security import read_own_file

log = logging.getLogger("dataserver.admin")

ADMIN_NAME = "admin"


def registry_dir(create: bool = False) -> Path | None:
    """The user's own registry directory (made 0700 when ``create``), or None when there
    is none that is safely this user's alone."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    candidates = []
    if base and _own_private(Path(base)):
        candidates.append(Path(base, "dataserver"))
    candidates.append(Path("/tmp", f"dataserver-{os.getuid()}"))
    for path in candidates:
        if create:
            try:
                path.mkdir(mode=0o700, exist_ok=True)
            except OSError:
                continue
        if _own_private(path):
            return path
    return None


def _own_private(path: Path) -> bool:
    """A real directory (not a link) of this user that no one else may enter or list."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077


def port_of(address: str) -> int | None:
    """The TCP port of a ``tcp://HOST:PORT`` address, else None."""
    tcp = tcp_endpoint(address)
    return int(tcp.port) if tcp else None


def register(data_endpoint: str, admin_endpoint: str) -> Path | None:
    """Record that the server whose data socket is ``data_endpoint`` answers the operator
    at ``admin_endpoint`` (an ipc address); the file written, or None (logged).

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
    entry = json.dumps({"admin": admin_endpoint, "host": tcp.address, "netns": _netns()})
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
    """The admin endpoint of the server at ``address`` when it runs on this host as this
    user (its registry file, its socket present), else None: a server in this network
    namespace bound to the port on one of ``address``'s IPs, or on every address."""
    tcp = tcp_endpoint(address)
    if tcp is None:
        return None
    host = tcp.address
    where = registry_dir()
    if where is None or not _is_this_host(host):
        return None
    ips = _ips_of(host)
    here = _netns()
    for path in sorted(where.glob(f"port-{tcp.port}.*")):
        entry = _read_entry(path)
        if entry is None or entry.get("netns") != here:
            continue
        bound = str(entry.get("host", ""))
        if bound not in ("*", "0.0.0.0", "::") and not ips & _ips_of(bound):
            continue
        endpoint = str(entry.get("admin", ""))
        if not endpoint.startswith("ipc://"):
            continue
        if _listening(endpoint[len("ipc://") :]):
            return endpoint
        try:
            path.unlink()  # that server is gone (killed: it could not say so)
        except OSError:
            pass
    return None


def _listening(path: str) -> bool:
    """Whether a live process listens on the unix socket at ``path``."""
    try:
        if not stat.S_ISSOCK(os.stat(path).st_mode):
            return False
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(1.0)
            probe.connect(path)
        return True
    except OSError:
        return False


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
