"""How many sessions a server takes: derived from its file descriptors (issue 28, item 2).

A session costs fds, not much else: on the front its client's data connection, which carries
its CONTROL too (``dataserver bench --only scale``, (c): 1.0 fd a session; 2.0 while clients
also published CONTROL on a connection of its own), on each worker its result connection
(1.0). The cap is what the front's fd limit (``serve`` raised the soft
limit to the hard one) allows: the limit, less what the front keeps for itself and its
workers (``conns.FDS_BASE``, ``conns.FDS_PER_WORKER``), less a spare share for connections
that are no session's yet (a reconnect before the old connection is seen gone, a probe, a
newcomer the connection cap sheds another for), over ``FDS_PER_SESSION``; and no more than
a worker's result budget (``conns.results_budget``: one connection a session) keeps.

``--max-sessions N`` still sets it; an N above what the fds allow is clamped to that, with a
warning that names the fd limit: a cap the fds cannot keep would refuse the next honest
connection with ``EMFILE`` instead of a session with a reason. STATS says the cap and why
(``limits.max_sessions``, ``limits.max_sessions_why``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from dataserver.server.conns import FDS_BASE, FDS_PER_WORKER, WORKER_FDS

log = logging.getLogger("dataserver.front")

FDS_PER_SESSION = 1  # the front's: a client's data connection (measured, see above)
SPARE_SHARE = 8  # 1/8 of the fds left for the sessions is kept for connections of none


@dataclass(frozen=True)
class SessionCap:
    """The most sessions this server takes, and why that many."""

    max_sessions: int
    allowed: int  # what the fds allow
    why: str


def fds_allow(soft_limit: int, workers: int) -> int:
    """The sessions an fd limit of ``soft_limit`` allows a server of ``workers`` workers:
    on the front, the limit less its own and its workers' reserve, less the spare share,
    at ``FDS_PER_SESSION`` each; on a worker (the same limit: it inherits the front's), one
    result connection each within ``results_budget``'s reserve."""
    room = soft_limit - FDS_BASE - FDS_PER_WORKER * workers
    front = (room - room // SPARE_SHARE) // FDS_PER_SESSION
    worker = soft_limit - max(WORKER_FDS, soft_limit // 4)
    return max(1, min(front, worker))


def session_cap(soft_limit: int, workers: int, asked: int | None) -> SessionCap:
    """The cap for a front whose fd limit is ``soft_limit``, running ``workers`` workers,
    told ``--max-sessions asked`` (None: not told)."""
    allowed = fds_allow(soft_limit, workers)
    basis = (
        f"fd limit {soft_limit} less {FDS_BASE + FDS_PER_WORKER * workers} for the front "
        f"and its {workers} worker(s) and 1/{SPARE_SHARE} spare, {FDS_PER_SESSION} fd a session"
    )
    if asked is None:
        return SessionCap(allowed, allowed, f"derived: {basis}")
    if asked <= allowed:
        return SessionCap(asked, allowed, f"--max-sessions {asked}; the fds would allow {allowed}")
    log.warning(
        "--max-sessions %d: this process's fds allow %d sessions (%s); serving at most %d "
        "(raise the hard fd limit, e.g. LimitNOFILE= or ulimit -Hn, for more)",
        asked,
        allowed,
        basis,
        allowed,
    )
    return SessionCap(allowed, allowed, f"--max-sessions {asked} clamped to {allowed}: {basis}")
