"""What each message from a server, and each change in the set of servers, does to the
session: the handlers the engine routes messages, link events and discovery changes to.

``Handlers`` decides; the owners apply. It gets its collaborators as arguments (the engine's
``Parts``: the plan book, the task ledger, the buffers, the counters; the links, the sender;
``LoopHooks``: what it asks of the engine's loop) and changes them only through their
methods; the counters it is given it increments. It owns the answer ``Deadlines`` and the
time of the last progress (the "no progress for ``timeout``" check), and its ``Hedges``
(hedges.py: second copies of slow servers' tasks). No thread of its own: every method runs
in the engine's I/O thread.

Over the house's ~500 lines (about 580) on purpose: one short method per message type, link
event and timer, which share one set of checks of an answer (which link, which task, still
wanted, banned or not: ``_destinations``, ``_accepted``, ``_settle``, ``_bad_server``);
split by message, those checks would be spread over modules or passed around. What stands
apart went out: the hedging (hedges.py), the answer checks without state
(session/answers.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from functools import partial
from typing import Any

import numpy as np
import zmq

from dataserver.protocol import (
    Cancelled,
    ErrorMsg,
    Message,
    ProtocolError,
    Result,
    SampleSizes,
    Welcome,
    decode,
)
from dataserver.tcpinfo import malloc_trim
from dataserver_client.config import ClientConfig
from dataserver_client.counts import ASKED_AGAIN, Count, Reject
from dataserver_client.engine.dispatch import Sender
from dataserver_client.engine.hedges import Hedges
from dataserver_client.engine.parts import LoopHooks, Parts
from dataserver_client.errors import DataServerError, NotAuthorized
from dataserver_client.net.handshakes import HeldWelcome, WelcomeMemo
from dataserver_client.net.links import Links
from dataserver_client.net.receive import TooManyFrames, WrongAnswer, receive
from dataserver_client.net.serverlink import EventKind, LinkEvent, LinkState, ServerLink
from dataserver_client.net.welcome import WelcomeProblem, WelcomeRefusal
from dataserver_client.session.announce import SizeFetch
from dataserver_client.session.answers import Deadlines, left_out, result_problem, task_error
from dataserver_client.session.ledger import TaskRecord

log = logging.getLogger("dataserver_client")

DRAIN = 256  # messages read off one socket per pass, so one busy server cannot starve the rest
TRIM_AFTER = 16 << 20  # a link closed holding more than this: the heap is trimmed after
TRIM_DELAY_S = 0.5


class Handlers:
    """The session's answers to what servers say and do. ``fail(error)`` stops the trainer
    (and, before the handshake, the engine's loop); ``watch``/``unwatch`` add or remove a
    link's sockets from the engine's poller."""

    def __init__(
        self, config: ClientConfig, parts: Parts, links: Links, sender: Sender, loop: LoopHooks
    ) -> None:
        self.config = config
        self.book = parts.book
        self.ledger = parts.ledger
        self.links = links
        self.sender = sender
        self.buffers = parts.buffers
        self.landing = parts.landing
        self.handshake = loop.handshake
        self.counters = parts.counters
        self.rejected = parts.rejected
        self._fail = loop.fail
        self._watch = loop.watch
        self._resets: list[ServerLink] = []  # links whose sockets go (``reset_links``)
        self._trim_at: float | None = None  # when to give a closed link's memory back
        self._unwatch = loop.unwatch
        self._held: set[ServerLink] = set()  # links holding a WELCOME back (``welcomes_due``)
        self.hedging = parts.hedging  # (the engine's: the sender reads its outliers too)
        self._hedges = Hedges(parts, links, sender, partial(self._servers_changed, lookahead=False))
        self.deadlines = Deadlines(floor=1.0, initial=max(1.0, config.timeout / 3))
        self._last_progress = time.monotonic()

    # ------------------------------------------------------------ reading a socket

    def messages(self, link: ServerLink, sock: zmq.Socket[Any], direct: bool) -> Iterator[Message]:
        """The messages waiting on ``sock`` (at most ``DRAIN``), decoded and meant for this
        session, one at a time: the next is read only once the engine handled this one
        (whether a result is still wanted depends on what came before). What does not
        decode, comes from a banned server or belongs elsewhere is counted and left out."""
        for _ in range(DRAIN):
            try:
                msg = receive(
                    sock,
                    lambda result: self._destinations(link, result),
                    link.came_by,
                    None if direct else link.welcomes,
                )
            except zmq.Again:
                return
            except HeldWelcome:  # its handshakes come too fast: acted on in its turn
                link.heard()
                self.counters.count(Count.WELCOME_HELD)
                self._held.add(link)
                continue
            except TooManyFrames as exc:  # the socket is in the middle of it: closed
                self.rejected.count(Reject.TOO_MANY_FRAMES)
                if link.state is LinkState.BANNED:  # (banned before: closed all the same)
                    self._resets.append(link)
                self._bad_server(link, f"it sent {exc}")
                return
            except WrongAnswer as exc:  # well-formed, for a task we want, and wrong
                link.heard()
                self.rejected.count(Reject.WRONG_ANSWER)
                self._bad_server(link, str(exc))
                continue
            except ProtocolError as exc:
                link.heard()
                self.rejected.count(Reject.MALFORMED)
                # The first few are worth a warning; a flood is counted (client.stats()).
                level = (
                    logging.WARNING if self.rejected.get(Reject.MALFORMED) <= 5 else logging.DEBUG
                )
                log.log(level, "dropped a bad message from %s: %s", link.address, exc)
                if link.server_id:  # after its handshake: a faulty or hostile server
                    self._bad_server(link, f"it sent a message that breaks the protocol: {exc}")
                continue
            link.heard()
            if self._accepted(link, msg, direct):
                yield msg

    def _accepted(self, link: ServerLink, msg: Message, direct: bool) -> bool:
        if link.state is LinkState.BANNED:
            self.rejected.count(Reject.FROM_BANNED_SERVER)
        elif direct and not isinstance(msg, Result):
            self.rejected.count(Reject.UNEXPECTED_TYPE)  # workers send nothing else
        elif getattr(msg, "session", link.session) not in (link.session, None):
            self.rejected.count(Reject.OTHER_SESSION)
        else:
            return True
        return False

    def _destinations(self, link: ServerLink, result: Result) -> np.ndarray | None:
        """Where the images of ``result`` from ``link`` go (``PlanBook.destination``), if its
        task is still wanted and was sent to that server; None otherwise (the pixels are
        read off and dropped: a server reaches only the slots of tasks it was given)."""
        if result.session != link.session or link.state is LinkState.BANNED:
            return None
        rec = self.ledger.wanted(result.task_id, result.plan_version)
        if rec is None or (not rec.sent_to(link) and not self.ledger.waiting_from(rec, link)):
            return None
        if len(result.images) != len(rec.slots):
            raise WrongAnswer(
                f"{len(result.images)} images for task {rec.task_id} of {len(rec.slots)}"
            )
        return self.book.destination(rec)

    # ------------------------------------------------------------ messages

    def _answered(self, link: ServerLink, task_id: int) -> None:
        sent = link.release(task_id)
        if sent is not None:
            now = time.monotonic()
            self.deadlines.observe(now - sent)
            self.hedging.observe(link, sent, now)

    def on_result(self, link: ServerLink, msg: Result) -> None:
        self._answered(link, msg.task_id)
        link.answered()
        rec = self.ledger.wanted(msg.task_id, msg.plan_version)
        waiting = rec is not None and self.ledger.waiting_from(rec, link)
        if rec is None or (
            not rec.sent_to(link)
            and not waiting
            and (link in rec.had or rec.avoid is link)
            and not msg.landed
        ):
            # A superseded plan, a second answer after asking again, or the answer of a
            # server that had the task before it was sent elsewhere (it expired, or a result
            # connection dropped; its pixels were not received: ``_destinations``): late,
            # not wrong. (A landed one is in our buffer under the task's seal: it is checked
            # and taken as before.)
            self.counters.count(Count.LATE)
            return
        # Nothing counts as progress before the answer is checked: a server answering
        # what it was not asked must not keep an epoch that goes nowhere alive.
        problem = result_problem(rec, msg, lambda: self._sealed(rec))
        if problem is not None:
            self.rejected.count(problem[0])
            self._refuse(link, rec, problem[1])
            return
        self.progressed()
        if waiting:
            # Asked again and not sent yet: this answer is the one wanted (its pixels were
            # received, checked like any other), and the re-send is saved.
            self.counters.count(Count.ANSWERED_WHILE_ASKED_AGAIN)
        if msg.failed and self.config.on_error == "raise":
            self.book.on_failure(rec, "sample", left_out(link.address, msg))
            return
        self.counters.count(Count.RESULTS)
        if rec.hedge is not None:
            self._settle(rec, link)
        if msg.landed:
            self.counters.count(Count.RESULTS_LANDED)
        self.book.on_result(rec, msg)

    def _settle(self, rec: TaskRecord, link: ServerLink) -> None:
        """``link`` answered the hedged ``rec`` first: the other copy is cancelled (unless
        it is a probe: its answer time is what it is for), and the batch is told that copy
        may still be writing the same bytes (``PlanBook`` then copies the batch out rather
        than wait for that writer)."""
        batch = self.book.batch_of(rec)
        if batch is not None:
            batch.race_settled()
        if self.ledger.settle(rec, link):
            self.counters.count(Count.HEDGE_WON)

    def _sealed(self, rec: TaskRecord) -> bool:
        """Whether every image of ``rec`` carries the seal record (generation, task id) a
        worker writes after composing it into our landing buffer: two words an image."""
        batch = self.book.batch_of(rec)
        where = self.buffers.landing_of(batch.host) if batch is not None else None
        if where is None or rec.land_gen is None or self.landing is None:
            return False
        return self.landing.sealed(where[0], rec.slots, rec.land_gen, rec.task_id)

    def _refuse(self, link: ServerLink, rec: TaskRecord, why: str) -> None:
        """``link`` answered ``rec`` wrongly: it is dropped (``_bad_server``) and ``rec``
        asked again elsewhere, unless it is out with another server or waiting to be sent
        (a forged answer to a task sent elsewhere, or asked again already)."""
        self._bad_server(link, why)
        if rec.sent_to(link):
            self.ledger.ask_again([rec], lost=link)

    def on_error(self, link: ServerLink, msg: ErrorMsg) -> None:
        if msg.task_id is None:
            self._on_session_error(link, msg)
            return
        self._answered(link, msg.task_id)
        rec = self.ledger.wanted(msg.task_id, msg.plan_version)
        if rec is None or not rec.sent_to(link):
            self.counters.count(Count.LATE)  # (or about a task it was not given: not its to fail)
            return
        if msg.kind in ASKED_AGAIN:
            # A result that may never arrive (its worker died right after sending it), or
            # one the server would not hold for us: ask again (a late copy is dropped).
            self.counters.count(ASKED_AGAIN[msg.kind])
            self.ledger.ask_again([rec], lost=link)
        elif msg.kind == "control_missing":  # it never had our control values: send them
            self.sender.send_control(link)
            self.ledger.ask_again([rec], lost=link)
        elif msg.kind == "control_mismatch":  # it holds other values than ours: changed on
            self.rejected.count(Reject.WRONG_CONTROL)  # the way (a relay): never composed
            self._refuse(link, rec, msg.message)
        elif msg.kind == "unknown_session":  # the server restarted or forgot us: handshake again
            self.ledger.ask_again([rec], lost=link)
            link.forget_session()
        elif msg.kind in ("sample", "poison") and msg.index not in (None, *rec.indices):
            self.rejected.count(Reject.WRONG_ANSWER)  # it blamed a sample the task lacks
            self._refuse(link, rec, f"blamed sample {msg.index} for task {msg.task_id}")
        else:
            self.progressed()
            self.book.on_failure(rec, msg.kind, task_error(link.address, msg), msg.image)

    def _on_session_error(self, link: ServerLink, msg: ErrorMsg) -> None:
        """An ERROR about this session and no task: the server forgot the session (say
        HELLO again), or refuses it (limits, a key that does not own it, a message it cannot
        read). A refusal is final for this client when no other server can go on without
        that one (waiting would not help, and the server's words say why); with others
        ready, that server alone is dropped, so one server cannot end a job by saying so."""
        if msg.kind == "unknown_session":
            link.forget_session()
            return
        if msg.kind == "not_authorized":
            error: DataServerError = NotAuthorized(
                f"not authorized by {link.address}: {msg.message}"
            )
        else:
            error = DataServerError(f"{link.address}: {msg.message}")
        if self.links.any_ready(besides=link) and self.handshake.done():
            self._bad_server(link, f"it refused this session: {msg.message}")
        else:
            self._fail(error)

    def on_cancelled(self, link: ServerLink, msg: Cancelled) -> None:
        for tid in msg.task_ids:
            if link.release(tid) is not None:
                self.counters.count(Count.CANCELLED)
                self.hedging.freed(link, time.monotonic())
            rec = self.ledger.get(tid)
            if rec is not None and rec.sent_to(link):
                # Cancelled though still wanted: send it again, to another server if any.
                self.ledger.ask_again([rec], away_from=link)

    def on_sizes(self, link: ServerLink, msg: SampleSizes, fetch: SizeFetch | None) -> None:
        """A chunk of the per-sample sizes (``announce.py``): kept by ``fetch``; a server
        asked for them that answers other chunks than asked, or lies about them, is refused
        for good; one never asked is counted and dropped (it costs nothing else)."""
        if fetch is None or not fetch.asked(link):
            self.rejected.count(Reject.UNEXPECTED_TYPE)
            return
        problem = fetch.on_chunk(link, msg, time.monotonic())
        if problem is not None:
            self.rejected.count(Reject.WRONG_ANSWER)
            self._bad_server(link, problem)

    def on_bye(self, link: ServerLink) -> None:
        """The server is draining (SIGTERM: a scale-down, a rolling update): send it nothing
        more. What it had queued for us comes back CANCELLED and goes to the others; what
        it runs, it finishes."""
        if link.state is not LinkState.DRAINING:
            self.counters.count(Count.SERVERS_DRAINED)
        link.drain()
        self._servers_changed(lookahead=False)

    def on_welcome(self, link: ServerLink, msg: Welcome, fd: int | None = None) -> None:
        """A WELCOME that came by connection ``fd`` (None: the last message's)."""
        if link.welcome_unchanged(msg):
            # Said again, same process, nothing new (a flapping link): a comparison, no
            # check, no re-send, no re-plan.
            self.counters.count(Count.WELCOME_UNCHANGED)
            if not link.paced(msg.heartbeat_ms):
                self.rejected.count(Reject.HEARTBEAT_INTERVAL)
            return
        problem = self.links.check(link, msg)
        if problem is not None:
            self._unfit(link, msg, problem)
            return
        kept, msg = msg, self.links.shared(msg)
        link.welcomes.swap(kept, msg)
        was_lost = link.was_lost
        restarted = link.welcome(msg, fd)
        if not link.paced(msg.heartbeat_ms):
            self.rejected.count(Reject.HEARTBEAT_INTERVAL)
        if self.book.control_seq or self.book.plan_version:
            self.sender.send_control(link)  # a server met anew learns the session's values first
        self._servers_changed()
        if restarted or was_lost:
            # A restarted server lost what it held; after a lost connection, answers in
            # flight may be gone. Send again; an answer that comes twice is dropped by id.
            moved = self._move_tasks(link)
            log.warning("%s is back: asking again for its %d task(s)", link.address, moved)
        for other in self.links:  # servers still gone: their tasks come to those back
            if other.state is LinkState.LOST and other.owed():
                self._move_tasks(other)

    def welcomes_due(self, now: float) -> None:
        """Decode and act on the WELCOMEs held back by their server's handshake rate
        (``handshakes.WelcomeMemo``), once due."""
        for link in list(self._held):
            due = link.welcomes.due(now)
            if due is not None or not link.welcomes.holding:
                self._held.discard(link)
            if due is None or link not in self.links.links or link.state is LinkState.BANNED:
                continue
            frames, fd = due
            try:
                msg = decode([memoryview(f) for f in frames])
            except ProtocolError as exc:
                self.rejected.count(Reject.MALFORMED)
                self._bad_server(link, f"it sent a message that breaks the protocol: {exc}")
                continue
            if isinstance(msg, Welcome):
                link.welcomes.keep(WelcomeMemo.digest(frames), msg)
                self.on_welcome(link, msg, fd)

    def _unfit(self, link: ServerLink, msg: Welcome, problem: WelcomeProblem) -> None:
        """A WELCOME that fails the check. A server that cannot compose our image size is
        only declined when others serve the session; anything else stops it."""
        if problem.kind is WelcomeRefusal.TOO_LARGE:
            self._bad_server(link, problem.why)
            self._fail(
                DataServerError(
                    f"{link.address}: {problem.why} (a dataset that large needs "
                    "DataServerClient(max_dataset_len=...))"
                )
            )
        elif (
            problem.kind is WelcomeRefusal.IMAGE_SIDE
            and self.handshake.done()
            and self.links.any_ready(link)
        ):
            link.decline(msg, problem.why)
            self._servers_changed()
        elif (
            problem.kind is WelcomeRefusal.OTHER_DATASET
            and self.handshake.done()
            and self.links.any_ready(link)
        ):
            # A server that announces another dataset once the job runs (re-announced, or
            # restarted on another) is dropped; the others finish the epoch.
            self._bad_server(link, problem.why)
        else:
            link.decline(msg, problem.why)  # (it holds a session for us: BYE frees it at close)
            self._fail(DataServerError(problem.why))

    # ------------------------------------------------------------ links and tasks

    def discovered(self, addresses: list[str]) -> None:
        """DNS says the servers are now ``addresses``: greet the new ones (they get tasks once
        they answer), let go of those that left (their tasks move at once)."""
        known = {link.address: link for link in self.links}
        for address in addresses:
            if address not in known:
                link = self.links.add(address)
                if link is None:  # (no descriptors left for it: logged)
                    continue
                log.info("%s joined (discovery)", address)
                self.counters.count(Count.SERVERS_JOINED)
                self._watch(link)
        for address, link in known.items():
            if address in addresses:
                continue
            log.info("%s left (discovery): moving its %d task(s)", address, len(link.owed()))
            self.counters.count(Count.SERVERS_LEFT)
            self._unwatch(link)
            self.links.remove(link)
            self.hedging.forget(link)
            self._servers_changed(lookahead=False)
            self._move_tasks(link)
        self._servers_changed()

    def on_events(self, events: list[LinkEvent]) -> None:
        for event in events:
            if event.kind is EventKind.NOT_AUTHORIZED:
                self._fail(NotAuthorized(event.why))
            elif event.kind is EventKind.OVERFLOW:
                self.rejected.count(Reject.UNFINISHED_MESSAGE)
                if event.link.server_id:  # after its handshake: a faulty or hostile server
                    self._bad_server(event.link, event.why)
                else:
                    log.warning("%s: %s; connecting again", event.link.address, event.why)
                    event.link.failed_handshake(event.why)
                    self._resets.append(event.link)
            elif event.kind is EventKind.LOST:
                self._resets.append(event.link)  # (what its connections held goes with them)
                self.counters.count(Count.SERVERS_LOST)
                self._servers_changed(lookahead=False)
                if self.links.any_ready():
                    self._move_tasks(event.link)
            elif event.kind is EventKind.RESULTS_BROKEN:
                # Results on their way in that connection are gone; which tasks they were
                # for, only the server knew. Ask again for what this server still owes.
                n = self._move_tasks(event.link, Count.ASKED_AGAIN_RESULTS_BROKEN)
                if n:
                    log.info(
                        "%s: a result connection dropped (%s); asked again for %d task(s)",
                        event.link.address,
                        event.why,
                        n,
                    )

    def _bad_server(self, link: ServerLink, why: str) -> None:
        """``link`` answered what it was not asked or claimed what it did not do: a faulty
        or hostile server. It is dropped for good (``LinkState.BANNED``), counted in
        ``rejected["bad_server"]``, and what it held moves to the other servers (with none
        left, the epoch stops at ``timeout`` with this reason)."""
        if link.state is LinkState.BANNED:
            return
        self.rejected.count(Reject.BAD_SERVER)
        link.ban(why)
        self._resets.append(link)  # its sockets are closed (``reset_links``)
        self._servers_changed()
        self._move_tasks(link)

    def reset_links(self) -> None:
        """Close the sockets of the links banned or lost since the last call, once nothing
        reads them any more (the engine calls this after each pass over its sockets): a
        banned server's for good, a lost one's for new ones."""
        while self._resets:
            link = self._resets.pop()
            if link not in self.links.links:
                continue
            if link.open and link.inflow.largest() > TRIM_AFTER:
                # libzmq frees what the connection held as it closes it (its reaper
                # thread): the heap's free pages go back to the kernel a little later.
                self._trim_at = time.monotonic() + TRIM_DELAY_S
            self._unwatch(link)
            if link.state is LinkState.BANNED:
                link.shut()
            else:
                link.reopen()
                self._watch(link)

    def trim(self, now: float) -> None:
        """Trim the heap when a link that held much was closed a little while ago."""
        if self._trim_at is not None and now >= self._trim_at:
            self._trim_at = None
            malloc_trim()

    def _servers_changed(self, lookahead: bool = True) -> None:
        """The ready servers changed: how many tasks they can work on at once (the book
        cuts batches into enough tasks to keep them all busy), where keys route; and
        (``lookahead``) whether the lookahead is still worth it."""
        ready = self.hedging.usable(self.links.ready())  # (a slow outlier: probes only)
        # A server's credit (WELCOME) is what its workers run plus as many again queued
        # there for them: half of it runs at once.
        slots = sum(lk.credit // 2 for lk in ready)
        budgets = [lk.welcome_msg.max_task_bytes for lk in ready if lk.welcome_msg is not None]
        stores = self.links.stores() if lookahead else None
        self.book.servers_changed(ready, slots, min(budgets) if budgets else None, stores)

    def _move_tasks(self, link: ServerLink, why: Count = Count.REISSUED) -> int:
        """Ask again for what ``link`` owes; counted once, under ``why`` (``reissued``: the
        server left; ``asked_again_results_broken``: only a result connection dropped)."""
        n = self.ledger.ask_again(self.ledger.records(link.take_outstanding()), lost=link)
        self.counters.count(why, n)
        return n

    # ------------------------------------------------------------ timers

    def expire(self, now: float) -> None:
        """Tasks unanswered past the deadline are asked again (their credit is let go: the
        server either lost the answer, or will answer twice and the copy is dropped)."""
        limit = self.deadlines.value
        for link, late in self.links.expire(now, limit):
            n = self.ledger.ask_again(self.ledger.records(late), link)
            if n:
                self.counters.count(Count.ASKED_AGAIN_DEADLINE, n)
                log.info(
                    "%s: %d task(s) unanswered for %.1f s; asked again", link.address, n, limit
                )

    def progressed(self) -> None:
        """Something moved the epoch on (a checked answer, a task's failure, a new epoch)."""
        self._last_progress = time.monotonic()

    def check_progress(self, now: float) -> None:
        """Stop the trainer when tasks are waiting and nothing progressed for ``timeout``,
        naming what each server still owes."""
        ledger = self.ledger
        waiting = bool(ledger.pending) or self.links.owing()
        if not (waiting and len(ledger)):
            self._last_progress = now
            return
        if now - self._last_progress <= self.config.timeout:
            return
        parts = []
        for link in self.links:
            mine = sum(1 for t in link.owed() if t in ledger)
            why = f", {link.last_error}" if link.last_error else ""
            if link.store_stall:  # (the server says its object store is the cause)
                why += f"; the cause: its {link.store_stall}"
            parts.append(
                f"{link.address} ({link.state.name.lower()}, {mine} task(s) outstanding{why})"
            )
        pending = ledger.pending
        self._fail(
            DataServerError(
                f"no progress for {self.config.timeout:g} s; waiting for: "
                + ", ".join(parts)
                + (f"; {pending} task(s) not yet sent" if pending else "")
            )
        )
        self._last_progress = now

    def hedge(self, now: float) -> None:
        """Each tick: slow servers judged, late tasks queued for a second copy, outliers
        probed (``Hedges.tick``)."""
        self._hedges.tick(now)

    def send_hedges(self) -> None:
        """The queued second copies sent (``Hedges.send``): before new tasks go out."""
        self._hedges.send()
