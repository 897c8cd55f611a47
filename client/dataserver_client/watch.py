"""The server side of the client's I/O thread: handshakes, connection events, heartbeats,
and what happens to a server's tasks when it goes silent or comes back.

A mixin of ``Engine`` (engine.py): the methods share the engine's state and run only in
its thread.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import zmq

from dataserver_client.errors import DataServerError, NotAuthorized, ServerUnreachable
from dataserver_client.link import LinkState, ServerLink

if TYPE_CHECKING:
    from collections import deque

    from dataserver_client.config import ClientConfig
    from dataserver_client.plans import TaskRecord

log = logging.getLogger("dataserver_client")


class LinkWatch:
    """Keeps every server link alive, or knows why it is not."""

    if TYPE_CHECKING:
        config: ClientConfig
        links: list[ServerLink]
        handshake: Future[dict[str, Any]]
        tasks: dict[int, TaskRecord]
        pending: deque[TaskRecord]
        last_progress: float
        counters: dict[str, int]
        _closing: bool

        def _fail(self, error: BaseException) -> None: ...

    def _check_handshake(self, started: float) -> None:
        waiting = [link for link in self.links if link.state is not LinkState.READY]
        if not waiting:
            first = self.links[0].info
            for link in self.links[1:]:
                if (link.info["fingerprint"], link.info["dataset_len"]) != (
                    first["fingerprint"],
                    first["dataset_len"],
                ):
                    self.handshake.set_exception(
                        DataServerError(
                            f"servers disagree on the dataset: {self.links[0].address} serves "
                            f"{first['fingerprint']} ({first['dataset_len']} samples), "
                            f"{link.address} serves {link.info['fingerprint']} "
                            f"({link.info['dataset_len']} samples)"
                        )
                    )
                    self._closing = True
                    return
            self.handshake.set_result(dict(first))
            self.last_progress = time.monotonic()
            return
        for link in waiting:
            self._maybe_hello(link)
        if time.monotonic() - started > self.config.timeout:
            names = ", ".join(
                link.address + (f" ({link.last_error})" if link.last_error else "")
                for link in waiting
            )
            self.handshake.set_exception(
                ServerUnreachable(
                    f"no answer from {names} within {self.config.timeout:g} s "
                    "(is `dataserver serve` running there, and reachable?)"
                )
            )
            self._closing = True

    def _maybe_hello(self, link: ServerLink) -> None:
        """(Re)send HELLO to a server we have no session with: soon after a failed send (not
        connected yet), once a second while a sent HELLO waits for its WELCOME."""
        wait = 1.0 if link.connected else 0.2
        if time.monotonic() - link.last_hello > wait:
            link.hello()

    def _on_link_events(self, link: ServerLink) -> None:
        for event in link.events():
            kind = event["event"]
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                link.connected = True
                link.last_error = ""
                if link.state is not LinkState.READY:
                    link.hello()
            elif kind == zmq.EVENT_DISCONNECTED:
                link.connected = False
                if link.state is LinkState.READY:
                    self._lost(link, "disconnected")
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                self._fail(
                    NotAuthorized(
                        f"not authorized by {link.address}: the server does not accept this "
                        "client's CURVE key (is its public key in --curve-authorized-keys?)"
                    )
                )
            elif kind in (
                zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
            ):
                link.last_error = (
                    "the connection handshake failed: a CURVE setting on one side only, "
                    "or not a dataserver"
                )

    def _liveness(self) -> None:
        now = time.monotonic()
        cfg = self.config
        for link in self.links:
            if link.state is LinkState.READY:
                if now - link.last_sent > cfg.heartbeat_interval:
                    link.heartbeat()
                if now - link.last_heard > cfg.heartbeat_timeout:
                    self._lost(link, f"silent for {now - link.last_heard:.1f} s")
            else:
                self._maybe_hello(link)
        waiting = bool(self.pending) or any(link.outstanding for link in self.links)
        wanted = bool(self.tasks)
        if not (waiting and wanted):
            self.last_progress = now
            return
        if now - self.last_progress > cfg.timeout:
            parts = []
            for link in self.links:
                mine = sum(1 for t in link.outstanding if t in self.tasks)
                why = f", {link.last_error}" if link.last_error else ""
                parts.append(
                    f"{link.address} ({link.state.name.lower()}, {mine} task(s) outstanding{why})"
                )
            self._fail(
                DataServerError(
                    f"no progress for {cfg.timeout:g} s; waiting for: "
                    + ", ".join(parts)
                    + (f"; {len(self.pending)} task(s) not yet sent" if self.pending else "")
                )
            )
            self.last_progress = now

    def _lost(self, link: ServerLink, why: str) -> None:
        """A server stopped answering: its tasks go to the others, or wait for it."""
        log.warning("%s lost (%s)", link.address, why)
        link.state = LinkState.LOST
        link.was_lost = True
        link.last_error = why
        if any(lk.state is LinkState.READY for lk in self.links):
            self._reissue(link)

    def _reissue(self, link: ServerLink) -> None:
        recs = sorted(
            (self.tasks[t] for t in link.outstanding if t in self.tasks),
            key=lambda r: (r.step, r.slot),
        )
        link.outstanding.clear()
        for rec in reversed(recs):
            rec.link = None
            self.pending.appendleft(rec)
        self.counters["reissued"] += len(recs)
