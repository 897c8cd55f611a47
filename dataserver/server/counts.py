"""Every counter a server keeps, declared once: what ``dataserver stats`` and the metrics
show, and what may be counted (``dataserver.counting.Counts`` takes nothing else).

The front keeps two ``Counts`` and hands them to its collaborators (router, client
handlers, outlet, connection tracker, STATS rate): ``Count``, events of normal work
(``dataserver stats``'s ``counters``), and ``Reject``, messages and connections refused, by
reason (its ``rejected`` and ``rejected_total``, and the metric
``dataserver_rejected_messages_total{reason}``). A worker keeps a ``Counts`` of
``WorkerCount`` for itself (it has no endpoint: what the front must know, a worker tells
it in messages, and the front counts it under its own names), and one of ``Reject`` for
its result connections shut down (``results_<reason>_dropped``, sent in TALLY messages).

A family (one counter per socket or kind) is declared member by member; the function that
names one takes a ``Literal`` of its suffixes, so mypy refuses a suffix not declared.
"""

from __future__ import annotations

from enum import StrEnum, unique
from typing import Literal, get_args

Watched = Literal["data"]  # the front's public socket (its monitor)
Tracked = Literal["data", "results"]  # sockets a ConnTracker judges
Dropped = Literal[
    "idle_dropped",
    "over_limit_dropped",
    "unfinished_dropped",
    "frames_dropped",
    "barred_dropped",
    "claim_dropped",
    "unclaimed_dropped",
]
LandingRefusal = Literal["fd", "peer", "silent", "mac", "budget"]
# ``dataserver.data.remote.FetchError.kind``: why an object was given up on
FetchErrorKind = Literal[
    "not_found",
    "denied",
    "throttled",
    "timeout",
    "server",
    "connection",
    "short",
    "other",
    "missing_library",
]


@unique
class Count(StrEnum):
    """The front's counters of normal work (``dataserver stats``'s ``counters``)."""

    # client messages
    HELLOS = "hellos"
    HEARTBEATS = "heartbeats"
    SESSIONS_CLOSED = "sessions_closed"  # BYE
    SESSIONS_EXPIRED = "sessions_expired"  # silent past the session TTL
    TASKS_RECEIVED = "tasks_received"
    TASKS_REPLACED = "tasks_replaced"  # a queued task asked again with other contents
    TASKS_DUPLICATE = "tasks_duplicate"  # asked again while queued or running
    TASKS_POISONED_AGAIN = "tasks_poisoned_again"  # a copy of a poison task, answered so
    CONTROLS = "controls"
    CONTROLS_OVERTAKEN = "controls_overtaken"  # older than the session's: nothing to do
    SIZE_CHUNKS = "size_chunks"  # SIZES requests answered (``announce.py``)
    # tasks and their answers
    TASKS_DONE = "tasks_done"
    TASKS_FAILED = "tasks_failed"
    TASKS_RETRIED = "tasks_retried"  # its worker died, or dropped it as it raised
    TASKS_POISONED = "tasks_poisoned"  # killed two workers
    TASKS_CANCELLED = "tasks_cancelled"
    TASKS_PACED = "tasks_paced"  # (the scheduler's figure, copied in at each report)
    CONTROLS_RESENT = "controls_resent"  # a worker forgot a session's control values
    IMAGES_DONE = "images_done"  # metric dataserver_samples_served_total
    SOURCES_DECODED = "sources_decoded"  # metric dataserver_cache_misses_total
    SOURCES_REUSED = "sources_reused"  # metric dataserver_cache_hits_total
    RESULTS_DIRECT = "results_direct"  # a worker sent it straight to the client
    RESULTS_VIA_FRONT = "results_via_front"
    RESULTS_ORPHANED = "results_orphaned"  # its session had gone
    # A result not sent for want of room (the client is told, and asks again): by a worker
    # on its direct path, over --max-queued-mb there; by the front's outbox.
    RESULTS_DROPPED_WORKER = "results_dropped_worker"
    RESULTS_DROPPED_FRONT = "results_dropped_front"
    SEND_DROPPED_FULL = "send_dropped_full"  # a peer's pipe full: the message dropped
    SEND_DROPPED_GONE = "send_dropped_gone"  # the peer gone
    # objects fetched by the workers (told by TALLY): GETs answered, their bytes, GETs
    # tried again (throttled, timed out, reset, 5xx, short), objects given up on
    FETCHES = "fetches"
    FETCH_BYTES = "fetch_bytes"
    FETCH_RETRIES = "fetch_retries"
    FETCH_ERRORS = "fetch_errors"
    # ... the objects given up on by kind (``fetch_errors(kind)``; the metric
    # ``dataserver_fetch_errors_total{kind}``)
    FETCH_ERRORS_NOT_FOUND = "fetch_errors_not_found"
    FETCH_ERRORS_DENIED = "fetch_errors_denied"
    FETCH_ERRORS_THROTTLED = "fetch_errors_throttled"
    FETCH_ERRORS_TIMEOUT = "fetch_errors_timeout"
    FETCH_ERRORS_SERVER = "fetch_errors_server"
    FETCH_ERRORS_CONNECTION = "fetch_errors_connection"
    FETCH_ERRORS_SHORT = "fetch_errors_short"
    FETCH_ERRORS_OTHER = "fetch_errors_other"
    FETCH_ERRORS_MISSING_LIBRARY = "fetch_errors_missing_library"
    # workers
    WORKER_DEATHS = "worker_deaths"
    WORKER_ANSWERS_LOST = "worker_answers_lost"  # a later task answered, this one never
    WORKERS_WITHOUT_STORE = "workers_without_store"
    # the front
    DRAINS = "drains"
    DATA_CONNECTIONS = "data_connections"
    DATA_DISCONNECTS = "data_disconnects"


@unique
class Reject(StrEnum):
    """What a server refused, by reason (``dataserver stats``'s ``rejected``, the metric
    ``dataserver_rejected_messages_total{reason}``). Where the refusal is answered, the
    reason is also the ERROR's ``kind`` (``malformed``: ``protocol``)."""

    INTERNAL = "internal"  # a handler raised (a bug): the message dropped
    # the data socket
    MALFORMED = "malformed"
    UNEXPECTED_TYPE = "unexpected_type"
    NOT_OWNER = "not_owner"  # (CURVE) a session id of another key
    NO_SECRET = "no_secret"
    UNKNOWN_SESSION = "unknown_session"
    BAD_SECRET = "bad_secret"
    SESSION_LIMIT = "session_limit"
    CONNECTION_SESSIONS = "connection_sessions"
    SEQUENCE = "sequence"  # a plan or control number the session cannot have reached
    LIMIT = "limit"  # a task over --max-image-side or --max-task-mb
    QUEUE_FULL = "queue_full"
    QUEUE_BYTES = "queue_bytes"
    CONTROL_MISSING = "control_missing"
    STATS_RATE = "stats_rate"
    # SIZES: beyond the session's rate, or its unread results (dropped unanswered: the
    # client asks again); asking for sizes the server does not have (answered)
    SIZES_RATE = "sizes_rate"
    SIZES_RANGE = "sizes_range"
    # the admin socket, the metrics endpoint
    ADMIN_MALFORMED = "admin_malformed"
    ADMIN_UNEXPECTED_TYPE = "admin_unexpected_type"
    ADMIN_RATE = "admin_rate"
    SCRAPE_RATE = "scrape_rate"  # (the scrape server's figure, copied in at each report)
    SCRAPE_TOTAL = "scrape_total"  # ... all peers together over their rate (same)
    # workers (this server's own children)
    WORKER_MALFORMED = "worker_malformed"
    WORKER_UNEXPECTED = "worker_unexpected"
    # handshakes (``not_authorized``, ``bad_handshake``)
    DATA_NOT_AUTHORIZED = "data_not_authorized"
    DATA_BAD_HANDSHAKE = "data_bad_handshake"
    # connections shut down (``dropped``): the front's, and the workers' (told by TALLY)
    DATA_IDLE_DROPPED = "data_idle_dropped"
    DATA_OVER_LIMIT_DROPPED = "data_over_limit_dropped"
    DATA_UNFINISHED_DROPPED = "data_unfinished_dropped"
    DATA_FRAMES_DROPPED = "data_frames_dropped"  # a message of too many frames
    DATA_BARRED_DROPPED = "data_barred_dropped"  # its peer barred for that
    # (the family's two claim reasons, declared for every tracked socket: only a worker's
    # result connections claim, so the front's data connections never count these)
    DATA_CLAIM_DROPPED = "data_claim_dropped"
    DATA_UNCLAIMED_DROPPED = "data_unclaimed_dropped"
    RESULTS_IDLE_DROPPED = "results_idle_dropped"
    RESULTS_OVER_LIMIT_DROPPED = "results_over_limit_dropped"
    RESULTS_UNFINISHED_DROPPED = "results_unfinished_dropped"
    RESULTS_FRAMES_DROPPED = "results_frames_dropped"  # a message of too many frames
    RESULTS_BARRED_DROPPED = "results_barred_dropped"  # its peer barred for that
    # A claim on a worker's result port that no admitted session made (issue 40)
    RESULTS_CLAIM_DROPPED = "results_claim_dropped"
    # A result connection that claimed nothing in time, or beyond the unclaimed budget
    RESULTS_UNCLAIMED_DROPPED = "results_unclaimed_dropped"


@unique
class WorkerCount(StrEnum):
    """A worker process's own counters (not exported: see the module's docstring)."""

    INTERNAL = "internal"  # a handler raised (also told to the front: its ``internal``)
    MALFORMED = "malformed"  # a message from the front that did not decode
    RESULTS_LANDED = "results_landed"  # composed straight into a client's landing buffer
    RESULTS_DROPPED = "results_dropped"  # (the front's ``results_dropped_worker``)
    LANDING_REGISTERED = "landing_registered"
    LANDING_REFUSED_FD = "landing_refused_fd"  # a bad hand-over or buffer
    LANDING_REFUSED_PEER = "landing_refused_peer"  # another user's connection
    LANDING_REFUSED_SILENT = "landing_refused_silent"
    LANDING_REFUSED_MAC = "landing_refused_mac"  # a task naming a buffer without its MAC
    # a buffer past a worker's bytes (or count) of buffers, from the session holding the most
    LANDING_REFUSED_BUDGET = "landing_refused_budget"
    # a task whose control digest is not that of the values held for it (changed on the way)
    CONTROL_MISMATCH = "control_mismatch"


def connections(socket: Watched) -> Count:
    """``<socket>_connections``: connections accepted on the public socket."""
    return Count(f"{socket}_connections")


def disconnects(socket: Watched) -> Count:
    """``<socket>_disconnects``: connections the public socket lost."""
    return Count(f"{socket}_disconnects")


def not_authorized(socket: Watched) -> Reject:
    """``<socket>_not_authorized``: a CURVE handshake refused."""
    return Reject(f"{socket}_not_authorized")


def bad_handshake(socket: Watched) -> Reject:
    """``<socket>_bad_handshake``: a ZMTP handshake that failed (junk, a wrong socket type)."""
    return Reject(f"{socket}_bad_handshake")


def dropped(socket: Tracked, reason: Dropped) -> Reject:
    """``<socket>_<reason>``: a connection a ConnTracker shut down."""
    return Reject(f"{socket}_{reason}")


def landing_refused(kind: LandingRefusal) -> WorkerCount:
    """``landing_refused_<kind>``: a landing hand-over or task a worker refused."""
    return WorkerCount(f"landing_refused_{kind}")


def fetch_errors(kind: str) -> Count:
    """``fetch_errors_<kind>``: objects given up on for that reason (a kind not declared,
    from a newer worker: ``other``)."""
    return Count(f"fetch_errors_{kind if kind in FETCH_ERROR_KINDS else 'other'}")


FETCH_ERROR_KINDS: tuple[str, ...] = get_args(FetchErrorKind)
LANDING_REFUSED = tuple(landing_refused(kind) for kind in get_args(LandingRefusal))
