"""How the batches planned from now on become tasks: how finely a batch is cut (``Pacing``,
pacing.py: the servers' slots at once and the output a task may carry) and which server
each run of images is meant for (``Affinity``, affinity.py: where a key's sources went), the
tasks then added to the ledger. The plan book owns one (book.py): it tells it of the servers
(``servers``), of a new epoch (``new_epoch``) and hands it each batch to cut (``cut``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from dataserver_client.plan.affinity import Affinity
from dataserver_client.plan.epoch import BatchPlan
from dataserver_client.plan.pacing import Pacing
from dataserver_client.session.inflight import InflightBatch
from dataserver_client.session.ledger import TaskLedger

if TYPE_CHECKING:
    from dataserver_client.net.serverlink import ServerLink


class Cutting:
    """Cuts batches into tasks for the ready servers; its own ``Pacing``, the engine's
    ``Affinity`` and ``TaskLedger`` (shared: the sender reads them too)."""

    def __init__(self, world_size: int, ledger: TaskLedger, affinity: Affinity[ServerLink]) -> None:
        self._pacing = Pacing(world_size)
        self._ledger = ledger
        self._affinity = affinity

    def servers(self, ready: list[ServerLink], slots: int, task_bytes: int | None) -> None:
        """The ready servers are ``ready`` now, working on ``slots`` tasks at once and taking
        at most ``task_bytes`` of output a task (None: none announced it): the cut of the
        batches planned from now on; keys route among them (tasks preferring a server gone
        prefer none)."""
        self._pacing.servers(slots, task_bytes)
        self._affinity.set_ready(ready)
        self._ledger.unprefer(set(self._affinity.live()))

    def new_epoch(self) -> None:
        """A new epoch: no key belongs to a server any more."""
        self._affinity.clear()

    def share(self) -> int:
        """The tasks the ready servers run at once (``Pacing.share``)."""
        return self._pacing.share()

    def cut(
        self,
        batch: InflightBatch,
        plan: BatchPlan,
        key: Callable[[int], int],
        depth: int,
        plan_version: int,
    ) -> None:
        """``batch``'s tasks (of ``plan``, under ``plan_version``) into the ledger: runs of
        consecutive images, cut where the server their sources belong to changes (several
        servers: image ``j``'s routed by ``key(j)``), else evenly; ``depth``: the batches
        planned ahead (``Pacing.cut``)."""
        images = plan.images
        n = len(images)
        if self._affinity.routes():
            keys = [key(j) for j in range(n)]
            servers = [self._affinity.server_for(k) for k in keys]
        else:  # one server: no key goes anywhere in particular
            keys, servers = [], [None] * n
        busy = len(self._ledger) > 0
        for run in self._pacing.cut(servers, plan.sizes.out, depth, busy):
            prefer = servers[run.start]
            self._ledger.add(
                batch,
                tuple(run),
                tuple(images[j].indices for j in run),
                images[0].grid,
                plan.sizes,
                plan_version,
                prefer=prefer,
                keys=tuple(keys[j] for j in run) if prefer is not None else (),
            )
