"""The engine's parts as its sender and handlers get them, grouped: ``Parts``, what the
engine makes once for the session and shares (each changed only through its own methods),
and ``LoopHooks``, what the handlers ask of the engine's loop. The engine builds both
(``Parts.of_session`` as it is made, the hooks in its thread with the links and the
sender: engine.py); the handlers and the sender keep the members they use."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from dataserver.counting import Counts
from dataserver.landing import LandingArea
from dataserver_client.buffers.assembly import DeviceMover, HostBuffers, landing_area
from dataserver_client.buffers.handoff import Handoff
from dataserver_client.config import ClientConfig
from dataserver_client.counts import SHOWN, Count, Reject
from dataserver_client.engine.book import PlanBook
from dataserver_client.net.serverlink import ServerLink
from dataserver_client.net.welcome import DatasetInfo
from dataserver_client.plan.affinity import Affinity
from dataserver_client.plan.hedging import Hedging
from dataserver_client.session.inflight import Delivery
from dataserver_client.session.ledger import TaskLedger


@dataclass(frozen=True)
class Parts:
    """The session's parts, made by the engine: the plan book, the task ledger, the
    affinity (which server a key's sources went to), the hedging (slow servers and their
    outliers), the host buffers and the landing area (None: no worker lands on this host),
    and the counters (``client.stats()``'s counts and ``rejected``)."""

    book: PlanBook
    ledger: TaskLedger
    affinity: Affinity[ServerLink]
    hedging: Hedging[ServerLink]
    buffers: HostBuffers
    landing: LandingArea | None
    counters: Counts[Count]
    rejected: Counts[Reject]

    @classmethod
    def of_session(
        cls, config: ClientConfig, handoff: Handoff[Delivery], mover: DeviceMover
    ) -> Parts:
        """A session's parts, new: the book delivers to ``handoff`` through ``mover``."""
        landing = landing_area(config)
        buffers = HostBuffers(config.device, keep=config.prefetch + 4, landing=landing)
        ledger = TaskLedger()
        affinity: Affinity[ServerLink] = Affinity()
        return cls(
            PlanBook(config, handoff, mover, buffers, ledger, affinity),
            ledger,
            affinity,
            Hedging(config.hedge),
            buffers,
            landing,
            Counts(Count, shown=SHOWN),
            Counts(Reject),
        )


@dataclass(frozen=True)
class LoopHooks:
    """What the handlers ask of the engine's loop: the handshake's Future (the loop sets it
    once every server answered), ``fail(error)`` (stops the trainer and, before the
    handshake, the loop), ``watch``/``unwatch`` (add or remove a link's sockets from the
    loop's poller)."""

    handshake: Future[DatasetInfo]
    fail: Callable[[BaseException], None]
    watch: Callable[[ServerLink], None]
    unwatch: Callable[[ServerLink], None]
