"""Where the client's servers are: DNS names among its addresses resolved to one address
per host, at the start and again in a thread of its own (``Discovery``), while the client
runs (a Kubernetes headless Service, a server that joins or leaves).

A lookup may block for seconds, so only the discovery thread makes them while the client
runs; the I/O thread takes what it found (``take``) and the engine adds and removes links
(``Links``) to match. A Ray data tier's address, ``ray://NAME``, is a name too: resolving it
asks the tier's named actor (``dataserver.raytier.tier_addresses``, ray imported only then)
for its servers now.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
from collections.abc import Callable, Sequence

from dataserver.endpoint import tcp_endpoint
from dataserver_client.errors import DataServerError

RAY = "ray://"  # a Ray data tier's name (dataserver_client.integrations.ray)


def expand_addresses(addresses: str | Sequence[str]) -> list[str]:
    """Server addresses, with DNS names that resolve to several hosts (a Kubernetes headless
    Service) expanded into one address per host. IPv4 answers are preferred when a name has
    both, since a server bound to an IPv4 interface never answers on IPv6. A name that does
    not resolve stays as it is (ZeroMQ keeps trying it)."""
    items = [addresses] if isinstance(addresses, str) else list(addresses)
    out: list[str] = []
    for addr in items:
        out.extend(first_answer(addr))
    return list(dict.fromkeys(out))


def first_answer(addr: str) -> list[str]:
    """What ``addr`` stands for when the client starts: ``resolve``'s answer, or ``addr``
    itself when a DNS lookup fails; a Ray data tier that cannot be asked is an error (it
    has no address ZeroMQ could keep trying), one with no server up yet stands for none."""
    found = resolve(addr)
    if found is None and addr.startswith(RAY):
        raise DataServerError(
            f"{addr}: no such Ray data tier reachable from this process (start it with "
            "dataserver_client.integrations.ray.DataTier.start, inside this Ray cluster)"
        )
    return [addr] if found is None else found


def is_name(addr: str) -> bool:
    """Whether ``addr`` names its host by a DNS name, or is a Ray data tier (``ray://NAME``):
    what discovery re-resolves."""
    if addr.startswith(RAY):
        return True
    m = tcp_endpoint(addr)
    return m is not None and not _is_ip(m.address) and m.host != "localhost"


def resolve(addr: str) -> list[str] | None:
    """The addresses ``addr`` stands for now: itself unless its host is a DNS name, else
    one per host the name resolves to (a Ray tier: its servers that are up); None when the
    lookup fails."""
    if addr.startswith(RAY):
        try:
            from dataserver.raytier import tier_addresses
        except ImportError as exc:
            raise DataServerError(f"{addr} needs ray: pip install 'dataserver[ray]'") from exc
        return tier_addresses(addr[len(RAY) :])
    m = tcp_endpoint(addr)
    if m is None or not is_name(addr):
        return [addr]
    try:
        infos = socket.getaddrinfo(m.host, int(m.port), type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return None
    v4 = sorted({str(i[4][0]) for i in infos if i[0] == socket.AF_INET})
    v6 = sorted({str(i[4][0]) for i in infos if i[0] == socket.AF_INET6})
    hosts = v4 or [f"[{h}]" for h in v6]
    return [f"tcp://{h}:{m.port}" for h in hosts] or None


class Discovery:
    """Re-resolves the DNS names among the client's addresses every ``interval`` seconds,
    in a thread of its own; ``take()`` returns the full address list when it changed.

    A name whose lookup fails keeps its last answer (a DNS hiccup must not drop every
    server); a name that never resolved stands for itself."""

    def __init__(self, specs: Sequence[str], interval: float, wake: Callable[[], None]) -> None:
        self.specs = list(specs)
        self.interval = interval
        self._wake = wake
        self._answers: dict[str, list[str]] = {a: first_answer(a) for a in self.specs}
        self.current = self._flatten()
        self._found: list[str] | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _flatten(self) -> list[str]:
        return list(dict.fromkeys(a for spec in self.specs for a in self._answers[spec]))

    def start(self) -> None:
        if self.interval > 0 and any(is_name(a) for a in self.specs):
            self._thread = threading.Thread(
                target=self._run, name="dataserver-client-discovery", daemon=True
            )
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            for spec in self.specs:
                if is_name(spec):
                    found = resolve(spec)
                    if found is not None:
                        self._answers[spec] = found
            now = self._flatten()
            if now != self.current:
                self.current = now
                with self._lock:
                    self._found = now
                self._wake()

    def take(self) -> list[str] | None:
        """The addresses, if they changed since the last call."""
        with self._lock:
            found, self._found = self._found, None
        return found

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
