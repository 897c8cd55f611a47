"""Server affinity with several servers: which server an affinity key (a sample that starts
an image) belongs to, and which server its sources already went to.

A key goes first to the server that already took it this epoch (its store holds the
sources, or is decoding them), else to the ready server weighted rendezvous hashing picks.
With one server (or none) nothing is routed: every key is for "any". No sockets; the I/O
thread is the only caller, and tests drive it directly.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Generic, Protocol, TypeVar

import numpy as np

from dataserver.hashing import MASK64, mix64

_SPAN = float(1 << 64) + 2.0  # (mix64 + 1) / _SPAN lies in (0, 1): its log is finite
# From this many ready servers a key's route is scored with numpy, all servers at once
# (the same winner: near-ties are settled by ``rendezvous`` itself). Below, plain Python
# is quicker; at 1,024 servers numpy scores a key in ~30 us instead of ~1.5 ms.
VECTOR_MIN = 32
_TIE = 1e-9  # scores this close to the best are scored again exactly


class Server(Protocol):
    """What routing needs of a server: a stable salt (from its address), its workers."""

    @property
    def salt(self) -> int: ...

    @property
    def workers(self) -> int: ...


S = TypeVar("S", bound=Server)


def rendezvous(servers: Iterable[S], key: int) -> S:
    """Weighted rendezvous hashing: the server ``key`` belongs to, each server winning keys
    in proportion to its workers. A server joining or leaving moves only the keys it wins
    or held."""
    return max(servers, key=lambda s: s.workers / -math.log((mix64(s.salt ^ key) + 1) / _SPAN))


def _mix64(x: np.ndarray) -> np.ndarray:
    """``mix64`` of each uint64 of ``x`` (numpy's uint64 arithmetic wraps as ``& MASK64``)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class Scores(Generic[S]):
    """``rendezvous`` over a fixed list of servers, scored with numpy: the same server."""

    def __init__(self, servers: list[S]) -> None:
        self.servers = servers
        self._salts = np.array([s.salt & MASK64 for s in servers], np.uint64)
        self._workers = np.array([float(s.workers) for s in servers], np.float64)

    def route(self, key: int) -> S:
        with np.errstate(over="ignore"):
            h = _mix64(self._salts ^ np.uint64(key & MASK64))
        top = h == np.uint64(MASK64)  # (h + 1 wraps to 0 there: 2^64 as a float)
        p = np.where(top, float(1 << 64), (h + np.uint64(1)).astype(np.float64)) / _SPAN
        score = self._workers / -np.log(p)
        best = float(score.max())
        near = np.flatnonzero(score >= best * (1.0 - _TIE))
        if len(near) == 1:
            return self.servers[int(near[0])]
        return rendezvous([self.servers[int(j)] for j in near], key)


class Affinity(Generic[S]):
    """Owners of affinity keys (the server each key's sources went to this epoch) and the
    ready servers keys are routed over."""

    def __init__(self) -> None:
        self._ready: list[S] = []  # routed over; empty with fewer than two servers
        self._scores: Scores[S] | None = None  # (numpy) with ``VECTOR_MIN`` ready or more
        self._owner: dict[int, S] = {}  # key -> the server its sources went to

    def set_ready(self, ready: list[S]) -> None:
        """The servers that are ready now. Keys owned by servers gone are forgotten."""
        self._ready = list(ready) if len(ready) > 1 else []
        self._scores = Scores(self._ready) if len(self._ready) >= VECTOR_MIN else None
        live = set(map(id, self._ready))
        if any(id(s) not in live for s in self._owner.values()):
            self._owner = {k: s for k, s in self._owner.items() if id(s) in live}

    def live(self) -> list[S]:
        """The servers routed over (empty: one server, route nothing)."""
        return list(self._ready)

    def routes(self) -> bool:
        """Whether any key goes to a server in particular (``server_for`` is never None
        without: fewer than two servers ready, and no owners left)."""
        return bool(self._ready or self._owner)

    def route(self, key: int) -> S | None:
        """The ready server ``key`` hashes to (None with fewer than two)."""
        if self._scores is not None:
            return self._scores.route(key)
        return rendezvous(self._ready, key) if self._ready else None

    def server_for(self, key: int) -> S | None:
        """Where ``key``'s sources should be composed: where they went, else its route."""
        return self._owner.get(key) or self.route(key)

    def claim(self, keys: Iterable[int], server: S) -> None:
        """``server`` takes the tasks of ``keys``: their sources are decoded there."""
        for key in keys:
            self._owner[key] = server

    def movable(self, keys: Iterable[int], server: S) -> bool:
        """Whether tasks of ``keys`` may go to ``server``: no other server began on them."""
        return all(self._owner.get(k, server) is server for k in keys)

    def owner(self, key: int) -> S | None:
        return self._owner.get(key)

    def clear(self) -> None:
        """A new epoch: no server holds anything of it yet."""
        self._owner.clear()
