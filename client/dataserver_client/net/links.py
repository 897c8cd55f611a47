"""Every server link of one client (``Links``): making and forgetting them (within the
descriptor budget), what their connections' events mean, heartbeats, HELLOs and silence
(each link checked in turn, in shares past ``LINK_CHECKS_PER_S``), the byte check of their
connections (``Inflow``), the one WELCOME check (``welcome.welcome_problem``) with the
dataset it fixes, the best link and the late tasks (from the ``LinkIndex``). One link's
sockets, state and tasks are ``serverlink.py``'s.

Created, used and closed only in the I/O thread. ``Links`` reports what happened
(``LinkEvent``s) and the engine decides what that does to tasks; nothing here knows about
batches. The session's CONTROL goes on each link's data connection (``Sender``).

Which addresses the links are made for is ``discovery.py``'s: the first are its answer at
the start (``expand_addresses``), and the engine adds and removes links from what it finds
later.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

from dataserver.landing import LandingArea
from dataserver.protocol import Welcome
from dataserver.security import CLAIM_S, session_id
from dataserver_client.errors import DataServerError
from dataserver_client.net.discovery import expand_addresses
from dataserver_client.net.fds import FdBudget, FdStats
from dataserver_client.net.inflow import INFLOW_FDS_PER_S, INFLOW_S
from dataserver_client.net.linkindex import LinkIndex
from dataserver_client.net.serverlink import (
    EventKind,
    LinkCommons,
    LinkEvent,
    LinkState,
    ServerLink,
    no_touch,
)
from dataserver_client.net.sockets import monitor_events
from dataserver_client.net.welcome import DatasetInfo, WelcomeProblem, welcome_problem

if TYPE_CHECKING:
    from dataserver_client.config import ClientConfig  # (torch: the buffers' layer)

log = logging.getLogger("dataserver_client")

# ``Links.tick`` checks every link each tick up to this many links a second; past it, a
# share of them each tick, each link at least every ``SWEEP_MAX_S`` (heartbeats, HELLOs,
# silence), so the timers cost per server, not per server and tick.
LINK_CHECKS_PER_S = 10_000
SWEEP_MAX_S = 0.1


class Links:
    """Every server link of one client, and what their connections are doing."""

    def __init__(
        self,
        ctx: zmq.Context[Any],
        config: ClientConfig,
        curve: dict[str, bytes] | None,
        steering: Callable[[], tuple[int, int]] = lambda: (0, 0),
        landing: LandingArea | None = None,
        budget: FdBudget | None = None,
        touched: Callable[[zmq.Socket[Any]], None] = no_touch,
    ) -> None:
        self.config = config
        self._ctx, self._curve = ctx, curve
        self._steering = steering
        self._landing = landing
        addresses = expand_addresses(config.addresses)
        budget = budget if budget is not None else FdBudget.of_process(ServerLink.FDS)
        problem = budget.problem(len(addresses))
        if problem is not None:
            raise DataServerError(f"not enough file descriptors: {problem}")
        self.commons = LinkCommons(LinkIndex(), budget, touched)
        self._sweep: deque[ServerLink] = deque()  # the links in the order ``tick`` checks them
        self._swept = 0.0  # when ``tick`` last checked links
        self._due = 0.0  # links it owes a check (a fraction carried over)
        self._inflow_fds = 0  # connections weighed on the last round (``Inflow``) ...
        self._round = [0, 0]  # ... and on this one so far, with the links checked
        self.dataset: DatasetInfo | None = None  # from the first WELCOME accepted
        self.links: list[ServerLink] = []
        for address in addresses:
            self.add(address)

    def add(self, address: str) -> ServerLink | None:
        """A link to a server found at ``address``; its HELLO is on its way. None: its
        sockets do not fit the descriptor limit (logged, with the limit to raise)."""
        problem = self.commons.budget.join()
        if problem is not None:
            log.error("%s: not using it: not enough file descriptors: %s", address, problem)
            return None
        # A session id of its own on each server: no server learns an id that names the
        # session anywhere else (one that forgot the session could otherwise be told that
        # id first, by whoever learnt it from another server).
        session = session_id(self._curve["public"] if self._curve else None)
        cfg = self.config
        link = ServerLink(
            self._ctx,
            address,
            session,
            self._curve,
            self._steering,
            self._landing,
            self.commons,
            beat_s=cfg.heartbeat_interval,
        )
        self.links.append(link)
        self._sweep.append(link)
        link.hello()
        return link

    def remove(self, link: ServerLink) -> None:
        """Forget a server (its address is gone): close its sockets."""
        self.links.remove(link)
        self._sweep.remove(link)
        link.close()
        self.commons.index.forget(link)
        self.commons.budget.leave()

    def __iter__(self) -> Iterator[ServerLink]:
        return iter(self.links)

    def ready(self) -> list[ServerLink]:
        return [link for link in self.links if link.state is LinkState.READY]

    def any_ready(self, besides: ServerLink | None = None) -> bool:
        return any(lk.state is LinkState.READY and lk is not besides for lk in self.links)

    def met(self) -> list[ServerLink]:
        """The servers that welcomed this session at least once."""
        return [link for link in self.links if link.welcome_msg is not None]

    def stores(self) -> bool:
        """Whether every server met keeps a store of decoded sources."""
        return all(lk.welcome_msg.store_bytes > 0 for lk in self.met() if lk.welcome_msg)

    def best(
        self, skip: set[ServerLink] | frozenset[ServerLink] = frozenset()
    ) -> ServerLink | None:
        """The link with the most free credit (leaving out ``skip``), or None when none
        has any: from the index's heap, whatever the number of links."""
        return self.commons.index.best(skip)

    def expire(self, now: float, limit: float) -> list[tuple[ServerLink, list[int]]]:
        """The tasks outstanding for ``limit`` seconds or more on ready links, forgotten
        there: each link with their ids, oldest first. Those of links not ready now wait
        until their link is (it may come back, or its tasks move when it is lost)."""
        out = []
        for link, ids in self.commons.index.late(now - limit).items():
            if link.state is LinkState.READY:
                gone = link.forget_tasks(ids)
                if gone:
                    out.append((link, gone))
            else:
                self.commons.index.park(link, ids)
        return out

    def owing(self) -> bool:
        """Whether any link has a task outstanding."""
        return self.commons.index.outstanding > 0

    def fds(self) -> FdStats:
        return self.commons.budget.stats()

    def check(self, link: ServerLink, msg: Welcome) -> WelcomeProblem | None:
        """The one check of a WELCOME (``welcome_problem``); the first accepted fixes the
        dataset the session serves."""
        problem = welcome_problem(link.address, msg, self.dataset, self.config)
        if problem is None and self.dataset is None:
            categories = tuple((int(label), str(name)) for label, name in msg.categories)
            self.dataset = DatasetInfo(
                msg.dataset_len,
                msg.fingerprint,
                link.address,
                categories,
                msg.sizes_count,
                msg.sizes_digest,
            )
        return problem

    def shared(self, msg: Welcome) -> Welcome:
        """``msg`` (a WELCOME that passed the check) holding the dataset's categories, not a
        copy: each link keeps its server's WELCOME, and every server of the job announces
        the same categories (4,096 names of 256 characters: ~1.2 MiB decoded, each link)."""
        dataset = self.dataset
        if dataset is None or msg.categories is dataset.categories or not msg.categories:
            return msg
        return msgspec.structs.replace(msg, categories=dataset.categories)

    def handshake(self) -> DatasetInfo | None:
        """The dataset once every server answered (None until then)."""
        waiting = [
            lk for lk in self.links if lk.state not in (LinkState.DRAINING, LinkState.BANNED)
        ]
        if any(link.welcome_msg is None for link in waiting):
            return None
        return self.dataset if any(lk.state is not LinkState.BANNED for lk in self.met()) else None

    def waiting_names(self) -> str:
        return ", ".join(
            link.address + (f" ({link.last_error})" if link.last_error else "")
            for link in self.links
            if link.welcome_msg is None
        )

    def on_monitor(self, link: ServerLink) -> list[LinkEvent]:
        """What the front connection's events mean."""
        out = []
        for event in monitor_events(link.monitor):
            kind = event["event"]
            if kind == zmq.EVENT_CONNECTED:
                link.inflow.connected(event["value"])
            elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                link.on_handshake()
            elif kind == zmq.EVENT_DISCONNECTED:
                link.inflow.disconnected(event["value"])
                lost = link.on_disconnect()
                if lost is not None:
                    out.append(lost)
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                out.append(
                    LinkEvent(
                        EventKind.NOT_AUTHORIZED,
                        link,
                        f"not authorized by {link.address}: the server does not accept this "
                        "client's CURVE key (is its public key in --curve-authorized-keys?)",
                    )
                )
            elif kind in (
                zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
            ):
                link.failed_handshake(
                    "the connection handshake failed: a CURVE setting on one side only, "
                    "or not a dataserver"
                )
        return out

    def on_results_monitor(self, link: ServerLink) -> list[LinkEvent]:
        """A direct-result connection came up (claim the session on it), or dropped (results
        on their way in it are gone)."""
        events = monitor_events(link.results_monitor)
        for e in events:
            if e["event"] == zmq.EVENT_CONNECTED:
                link.inflow.connected(e["value"])
            elif e["event"] == zmq.EVENT_DISCONNECTED:
                link.inflow.disconnected(e["value"])
        if any(e["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED for e in events):
            link.claim()
        dropped = [e for e in events if e["event"] == zmq.EVENT_DISCONNECTED]
        if dropped and link.state in (LinkState.READY, LinkState.DRAINING):
            endpoints = {str(e.get("endpoint", b""), "utf-8", "replace") for e in dropped}
            return [LinkEvent(EventKind.RESULTS_BROKEN, link, ", ".join(sorted(endpoints)))]
        return []

    def _due_links(self, now: float) -> list[ServerLink]:
        """The links to check this tick (``_share``), their connections counted: a round
        over every link gives the count ``Inflow`` is paced by."""
        due = self._share(now)
        self._round[0] += sum(len(lk.inflow.marks) for lk in due)
        self._round[1] += len(due)
        if self._round[1] >= len(self.links):
            self._inflow_fds, self._round = self._round[0], [0, 0]
        return due

    def _share(self, now: float) -> list[ServerLink]:
        """All links while they are few; past ``LINK_CHECKS_PER_S`` checks a second, the
        next share in turn, each link at least every ``SWEEP_MAX_S``."""
        n = len(self._sweep)
        period = max(0.0, min(SWEEP_MAX_S, n / LINK_CHECKS_PER_S))
        elapsed, self._swept = now - self._swept, now
        if period <= 0.0 or elapsed >= period:
            self._due = 0.0
            return list(self._sweep)
        self._due = min(float(n), self._due + n * elapsed / period)
        k = math.floor(self._due)
        self._due -= k
        out = []
        for _ in range(k):
            link = self._sweep.popleft()
            self._sweep.append(link)
            out.append(link)
        return out

    def tick(self, now: float) -> list[LinkEvent]:
        """Heartbeats, HELLOs to servers without a session, and silence past the timeout:
        of the links due a check (``_due_links``)."""
        out = []
        cfg = self.config
        due = self._due_links(now)
        every = max(INFLOW_S, self._inflow_fds / INFLOW_FDS_PER_S)
        for link in due:
            if link.open and link.inflow.due(now, every):
                held, budget = link.inflow.largest(), link.inflow_budget()
                if held > budget:
                    why = (
                        f"it sent {held >> 20} MiB of a message it did not finish (more than "
                        f"the {budget >> 20} MiB its outstanding answers can take)"
                    )
                    out.append(LinkEvent(EventKind.OVERFLOW, link, why))
                    continue
            if link.state in (LinkState.READY, LinkState.DRAINING):
                if now - link.last_sent > link.pace.interval_s:
                    link.heartbeat()
                if now - link.last_claim > CLAIM_S:
                    link.claim()
                if now - link.last_heard > link.pace.silence_s(cfg.heartbeat_timeout):
                    out.append(link.lose(f"silent for {now - link.last_heard:.1f} s"))
            elif link.state is not LinkState.BANNED:
                # Soon after a failed send (not connected yet); once a second while a sent
                # HELLO waits for its WELCOME.
                wait = 1.0 if link.connected else 0.2
                if now - link.last_hello > wait:
                    link.hello()
        return out

    def close(self) -> None:
        for link in self.links:
            link.close()
