"""Every counter a client keeps, declared once: what ``client.stats()`` shows, and what may
be counted (``dataserver.counting.Counts`` takes nothing else).

The engine keeps two ``Counts`` and hands them to its ``Handlers``: ``Count``, events of
normal work (``client.stats()``'s top level; those in ``SHOWN`` from the start, at 0),
and ``Reject``, messages refused, by reason (``client.stats()["rejected"]``). The
lookahead keeps a third, ``Flip``: what the mode flips did (``client.stats()["flips"]``).
"""

from __future__ import annotations

from enum import StrEnum, unique


@unique
class Count(StrEnum):
    """The client's counters of normal work (``client.stats()``)."""

    LATE = "late"  # an answer no longer wanted (superseded plan, a second answer)
    CANCELLED = "cancelled"  # tasks a server answered CANCELLED
    RESULTS = "results"
    REISSUED = "reissued"  # tasks moved off a server that left, was lost or banned
    SERVERS_JOINED = "servers_joined"  # (discovery)
    SERVERS_LEFT = "servers_left"  # (discovery)
    SERVERS_DRAINED = "servers_drained"  # said BYE (SIGTERM)
    SERVERS_LOST = "servers_lost"
    RESULTS_LANDED = "results_landed"  # composed straight into our landing buffer
    # tasks asked again: a server's ERROR said so (``ASKED_AGAIN``), a result connection
    # broke, the deadline passed
    ASKED_AGAIN_MAYBE_LOST = "asked_again_maybe_lost"
    ASKED_AGAIN_DROPPED = "asked_again_dropped"
    ASKED_AGAIN_RESULTS_BROKEN = "asked_again_results_broken"
    ASKED_AGAIN_DEADLINE = "asked_again_deadline"
    # an answer from a server that had the task, come while it waited to be sent again
    # (after a dropped result connection): taken, the re-send saved
    ANSWERED_WHILE_ASKED_AGAIN = "answered_while_asked_again"
    # a server's WELCOME said again with nothing new (a comparison, nothing redone), and
    # one that changed something held back by its server's handshake rate (``handshakes``)
    WELCOME_UNCHANGED = "welcome_unchanged"
    WELCOME_HELD = "welcome_held"
    # a slow server's task sent to a second server too (``hedging.py``), and how often the
    # second copy answered first
    HEDGED = "hedged"
    HEDGE_WON = "hedge_won"


# Shown in ``client.stats()`` from the start, at 0.
SHOWN = (
    Count.LATE,
    Count.CANCELLED,
    Count.RESULTS,
    Count.REISSUED,
    Count.SERVERS_JOINED,
    Count.SERVERS_LEFT,
    Count.SERVERS_DRAINED,
    Count.SERVERS_LOST,
    Count.HEDGED,
    Count.HEDGE_WON,
)

# An ERROR's ``kind`` that asks the client to ask again, and what it counts.
ASKED_AGAIN = {
    "maybe_lost": Count.ASKED_AGAIN_MAYBE_LOST,  # its worker died right after sending it
    "dropped": Count.ASKED_AGAIN_DROPPED,  # the server would not hold it for us
}


@unique
class Reject(StrEnum):
    """What the client refused, by reason (``client.stats()["rejected"]``)."""

    INTERNAL = "internal"  # a handler raised (a bug): the message dropped
    MALFORMED = "malformed"
    UNEXPECTED_TYPE = "unexpected_type"
    OTHER_SESSION = "other_session"
    FROM_BANNED_SERVER = "from_banned_server"
    UNFINISHED_MESSAGE = "unfinished_message"  # a server's message over our bound
    TOO_MANY_FRAMES = "too_many_frames"  # a message of more than MAX_FRAMES (left unread)
    # a server's answer that is wrong (the server is banned: ``bad_server``)
    WRONG_ANSWER = "wrong_answer"
    LANDED_UNSEALED = "landed_unsealed"
    BAD_BOXES = "bad_boxes"
    # composed with other control values than its task's (a CONTROL changed on the way)
    WRONG_CONTROL = "wrong_control"
    BAD_SERVER = "bad_server"
    # a server asked for a heartbeat interval beyond the client's bounds (``beats``): kept its own
    HEARTBEAT_INTERVAL = "heartbeat_interval"


@unique
class Flip(StrEnum):
    """What the mode flips did (``client.stats()["flips"]``, every one from the start)."""

    PROMOTED = "promoted"  # served by the lookahead batch
    PROMOTED_READY = "promoted_ready"  # ... which was complete already
    REPLANNED = "replanned"  # no lookahead batch: planned again
