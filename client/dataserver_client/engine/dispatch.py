"""What the client sends: tasks to the servers with free credit (landing straight into our
buffer where a worker on this host can), cancels of tasks the plan no longer wants, and
the session's CONTROL. Decides nothing about the plan: it reads the plan book and the
ledger (the engine's ``Parts``, with the affinity that picks a task's server) through
their methods and tells the ledger and the links what went where."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec

from dataserver.landing import land_mac
from dataserver.protocol import Control, Task
from dataserver_client.config import ClientConfig
from dataserver_client.engine.parts import Parts
from dataserver_client.net.links import Links
from dataserver_client.net.serverlink import LinkState, ServerLink
from dataserver_client.session.ledger import TaskRecord

MAX_CANCEL = 4096  # task ids per CONTROL
# Samples past the batches planned that a server is told its plan asks next (``Task.ahead``:
# it fetches their bytes ahead when its dataset is in object storage): at 30 ms a request
# and a thousand images a second, some thirty are out at once; this covers stalls of the
# store of about a quarter of a second beyond that, and ``--max-fetch-mb`` bounds the bytes.
AHEAD = 256


class Sender:
    """Sends what the plan book wants sent, over ``links``."""

    def __init__(self, config: ClientConfig, parts: Parts, links: Links) -> None:
        self._config = config
        self._hedging = parts.hedging
        self._book = parts.book
        self._ledger = parts.ledger
        self._affinity = parts.affinity
        self._links = links
        self._buffers = parts.buffers
        self._landing = parts.landing
        # The plan's next samples for each server (``_ahead``): the mark they were cut at,
        # and each server's share not yet sent to it.
        self._ahead_mark: tuple[int, int, int] | None = None
        self._ahead: dict[ServerLink, tuple[int, ...]] = {}

    def dispatch(self) -> None:
        """Send waiting tasks while some server has free credit for them. A slow outlier
        (``hedging.py``) takes one now and then, as a probe; a server behind (a task out
        past its hedge delay) takes none until it catches up."""
        ledger = self._ledger
        # links with nothing they should take now (a slow outlier: copies only; a server
        # behind: nothing more to hold, hedging.py)
        skip = set(self._hedging.aside)
        while ledger.pending:
            link = self._links.best(skip)
            if link is None:
                return
            rec = ledger.pop_pending(link, self._affinity)
            if rec is None:
                skip.add(link)
                continue
            task, generation = self._task(rec, link)
            if not link.send(task.encode()):
                ledger.unsent(rec)  # not connected after all: try again shortly
                return
            link.sent(rec.task_id, len(rec.images) * rec.sizes.image_bytes)
            ledger.sent(rec, link, generation)

    def hedge(self, rec: TaskRecord, link: ServerLink, probe: bool = False) -> bool:
        """Send a second copy of ``rec`` (out with a slow server; with ``probe``, out with
        a healthy one, and ``link`` the slow server probed) to ``link``; False when it could
        not go. The copy never lands: its pixels come over the socket, received only while
        the task is still wanted, so the copy that loses writes nothing. A hedge (not a
        probe) goes with ``priority``: the server queues it ahead of this session's other
        tasks (the trainer waits on its batch sooner than on theirs)."""
        task, _ = self._task(rec, link, landing=False, priority=not probe)
        if not link.send(task.encode()):
            return False
        link.sent(rec.task_id, len(rec.images) * rec.sizes.image_bytes)
        self._ledger.hedged(rec, link, probe)
        return True

    def _task(
        self, rec: TaskRecord, link: ServerLink, landing: bool = True, priority: bool = False
    ) -> tuple[Task, int | None]:
        """The TASK for ``rec`` on ``link``, and the landing generation it names (None: its
        images come back over the socket; always without ``landing``)."""
        book, cfg = self._book, self._config
        where = self._landing_place(rec, link) if landing else None
        land: dict[str, Any] = {}
        if where is not None:
            region, generation, offset = where
            assert self._landing is not None
            land = {
                "land_token": self._landing.token,
                "land_region": region,
                "land_gen": generation,
                "land_offset": offset,
            }
        batch = rec.batch
        plan = batch.plan
        task = Task(
            session=link.session,
            auth=link.secret,
            task_id=rec.task_id,
            plan_version=rec.plan_version,
            epoch=plan.epoch,
            seed=plan.seed,
            images=rec.images,
            grid=rec.grid,
            on_error=batch.on_error or cfg.on_error,
            control_seq=book.control_seq,
            control=batch.control if batch.inline else None,
            control_digest=batch.control_digest,
            exclude=rec.exclude,
            step=plan.step,
            mode=plan.mode,
            # (a probe composes one source alone, whatever its batch's layout)
            layout=plan.layout if rec.probe_of is None else "grid",
            partners=int(plan.partners and rec.probe_of is None),
            recent=int(book.planning_both_modes),
            pad_value=plan.pad_value,
            letterbox=plan.letterbox,
            fit=plan.fit,
            augment=int(plan.augment),
            priority=int(priority),
            ahead=self._ahead_for(link) if landing else (),
            **rec.sizes.wire(),
            **land,
        )
        if land:
            assert self._landing is not None
            task = msgspec.structs.replace(task, land_mac=land_mac(self._landing.key, task))
        return task, where[1] if where is not None else None

    def _ahead_for(self, link: ServerLink) -> tuple[int, ...]:
        """The plan's next samples that ``link``'s server will be asked for (by their
        route; all of them with one server), once for each time the plan moves on: empty
        when it was told them already, or when it fetches nothing ahead (its WELCOME)."""
        welcome = link.welcome_msg
        if welcome is None or not welcome.fetch_ahead:
            return ()
        mark, upcoming = self._book.upcoming(AHEAD)
        if mark != self._ahead_mark:
            self._ahead_mark = mark
            self._ahead = {}
            affinity = self._affinity
            if not affinity.routes():
                self._ahead[link] = tuple(upcoming.tolist())
            else:
                shares: dict[ServerLink, list[int]] = {}
                for index in upcoming.tolist():
                    server = affinity.server_for(index)
                    if server is not None:
                        shares.setdefault(server, []).append(index)
                self._ahead = {s: tuple(v) for s, v in shares.items()}
        return self._ahead.pop(link, ())

    def _landing_place(self, rec: TaskRecord, link: ServerLink) -> tuple[int, int, int] | None:
        """Where ``rec``'s images may land (region, generation, file offset): the server's
        workers took our buffer (so it is on this host), its batch's buffer is a landing
        region, and the task's slots are consecutive. None: not landed."""
        batch = self._book.batch_of(rec)
        if self._landing is None or batch is None or not rec.consecutive or not link.can_land:
            return None
        where = self._buffers.landing_of(batch.host)
        if where is None:
            return None
        region, generation, offset = where
        return region, generation, offset + rec.slots[0] * rec.sizes.image_bytes

    def cancel(self) -> None:
        """Ask servers to drop queued tasks the plan no longer wants (by id: the rest of
        the plan stands, so its version does not change)."""
        by_link: dict[ServerLink, list[int]] = {}
        for link, task_id in self._ledger.take_cancels():
            if link.owes(task_id):
                by_link.setdefault(link, []).append(task_id)
        for link, ids in by_link.items():
            for start in range(0, len(ids), MAX_CANCEL):
                link.send(self.control_msg(link, ids[start : start + MAX_CANCEL]).encode())

    def control_msg(self, link: ServerLink, cancel: Iterable[int] = ()) -> Control:
        """The session's CONTROL for ``link``'s data connection (with its secret)."""
        book = self._book
        fields: dict[str, Any] = {
            "plan_version": book.plan_version,
            "control_seq": book.control_seq,
            "control": book.control,
            "mode": book.mode,
            "cancel": tuple(cancel),
        }
        return Control(session=link.session, auth=link.secret, **fields)

    def send_control(self, link: ServerLink | None) -> None:
        """The session's control values and plan to one server (``link``), or to every
        server, on its data connection: reliable, ahead of any task that needs them, and
        no second connection a session on the server (see the design notes, "CONTROL on
        the data connection")."""
        if link is not None:
            link.send(self.control_msg(link).encode())
            return
        for each in self._links:
            if each.state is LinkState.READY:
                each.send(self.control_msg(each).encode())
