"""The data tier on a Ray cluster (``pip install "dataserver[ray]"``).

    import ray
    from dataserver_client import DataServerClient
    from dataserver_client.integrations.ray import DataTier

    ray.init()
    tier = DataTier.start("dataserver", servers=4, workers=8, dataset="coco:/data/ann.json",
                          resources={"data": 1})
    # in any process of the cluster (a Ray Train worker, another job):
    client = DataServerClient("ray://dataserver", batch_size=16)
    tier.scale(6)      # two more servers join the running epoch
    tier.scale(3)      # three drain (SIGTERM); their tasks move, nothing is lost
    tier.shutdown()

Each server is a Ray actor (``dataserver.raytier.TierServer``, in a module that imports
neither torch nor this package) that runs and supervises a real ``dataserver serve`` on its
node, bound to the node's Ray address on a free port: the servers never import torch, as
everywhere else. The tier's state is a named actor (namespace ``dataserver``), so
``DataTier.get(name)`` and ``DataServerClient("ray://NAME")`` work from any process of the
cluster; the client's discovery asks it for the current addresses every
``discovery_interval`` seconds, exactly as it re-resolves a DNS name, so servers added or
lost under a running epoch are used or forgotten at once and every guarantee holds
(exactly once, immediate feedback, bit-identical batches).

Guarantees of the tier itself:

- ``start`` returns once every server is ready (serve's ready line read), or raises with
  serve's own error line (a bad dataset spec) or ``TimeoutError`` (no node has the
  resources);
- servers are spread over the nodes that have ``resources`` (Ray's ``SPREAD`` strategy:
  one per node first, when they fit);
- a server process that dies is restarted by its actor, on the same ports when it can have
  them (clients reconnect; while it is down they move its tasks or wait, as with any server
  restart); a server actor that dies (``ray.kill``, a lost node) is replaced by a new one on
  a node with room, and its server gets SIGTERM from the kernel when the actor's process
  dies (``PR_SET_PDEATHSIG``), so none is left behind;
- ``scale(n)`` starts the missing servers or drains the newest ones: SIGTERM, as on
  Kubernetes (the server tells its clients, finishes its running work and exits within
  ``--drain-seconds``), and the address leaves ``addresses()`` at once; each drained actor
  ends once its server has exited;
- ``shutdown()`` drains every server, waits for them to exit (SIGKILL past the drain's
  limit) and ends every actor of the tier: no ``dataserver serve`` process is left.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import ray

from dataserver.raytier import NAMESPACE, PREFIX, ServerSpec, TierActor, connect, tier_actor

__all__ = ["DataTier"]

_SPECIAL = {"CPU": "num_cpus", "GPU": "num_gpus", "memory": "memory"}


def _actor_options(resources: Mapping[str, float] | None) -> dict[str, Any]:
    """A server actor's Ray options from ``resources`` (per server): "CPU", "GPU" and
    "memory" become ``num_cpus``/``num_gpus``/``memory``, the rest custom resources. The
    actor itself reserves no CPU unless "CPU" is given (give ``{"CPU": W}`` to keep a node's
    CPUs for its server's W workers)."""
    opts: dict[str, Any] = {"num_cpus": 0, "scheduling_strategy": "SPREAD"}
    custom: dict[str, float] = {}
    for key, value in (resources or {}).items():
        if key in _SPECIAL:
            opts[_SPECIAL[key]] = value
        else:
            custom[key] = float(value)
    if custom:
        opts["resources"] = custom
    return opts


def _get(ref: Any, timeout: float | None = None) -> Any:
    """``ray.get``, raising what the tier's actor raised (not Ray's wrapper of it)."""
    try:
        return ray.get(ref, timeout=timeout)
    except ray.exceptions.RayTaskError as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, Exception):
            raise cause from None
        raise


class DataTier:
    """A handle on a data tier running on the Ray cluster (picklable: pass it to tasks).

    Make one with ``DataTier.start(...)`` or find a running one with ``DataTier.get(name)``;
    clients connect to ``tier.address`` (``"ray://NAME"``)."""

    def __init__(self, name: str, actor: Any) -> None:
        self.name = name
        self._actor = actor

    @property
    def address(self) -> str:
        """What ``DataServerClient`` takes: ``"ray://NAME"``."""
        return PREFIX + self.name

    @classmethod
    def start(
        cls,
        name: str = "dataserver",
        servers: int = 1,
        workers: int | None = None,
        dataset: str = "synthetic",
        dataset_args: Mapping[str, Any] | str | None = None,
        resources: Mapping[str, float] | None = None,
        *,
        serve_args: Sequence[str] = (),
        drain_seconds: float = 30.0,
        detached: bool = False,
        timeout: float = 120.0,
    ) -> DataTier:
        """Start ``servers`` servers of ``dataserver serve --dataset DATASET
        [--dataset-args JSON] --workers WORKERS [SERVE_ARGS...]`` spread over the nodes that
        have ``resources`` (per server, e.g. ``{"data": 1}``), and return once all are ready.

        ``workers``: worker processes per server (None: serve's default, the node's CPUs).
        ``serve_args``: more ``serve`` flags (``--cache-gb 4``, CURVE keys...).
        ``drain_seconds``: serve's ``--drain-seconds``, what a scale-down or shutdown waits.
        ``detached``: the tier outlives the job that started it (until ``shutdown()``);
        otherwise it ends with that job's driver. A tier of the same name must not exist.
        """
        if not name or "/" in name:
            raise ValueError(f"DataTier: a name must be non-empty, without '/': {name!r}")
        if servers < 0:
            raise ValueError(f"DataTier: servers must be >= 0, got {servers}")
        if isinstance(dataset_args, Mapping):
            dataset_args = json.dumps(dict(dataset_args))
        spec = ServerSpec(
            dataset=dataset,
            dataset_args=dataset_args,
            workers=workers,
            extra=tuple(serve_args),
            drain_seconds=float(drain_seconds),
        )
        connect()
        actor: Any = (  # (ray's types know no .remote on its methods)
            ray.remote(TierActor)
            .options(
                name=name,
                namespace=NAMESPACE,
                lifetime="detached" if detached else None,
                num_cpus=0,
                max_concurrency=64,
            )
            .remote(name, spec, _actor_options(resources))
        )
        tier = cls(name, actor)
        try:
            _get(actor.scale.remote(servers))
            _get(actor.wait_ready.remote(timeout))
        except BaseException:
            tier.shutdown()
            raise
        return tier

    @classmethod
    def get(cls, name: str = "dataserver") -> DataTier:
        """The running tier ``name``, from any process of the cluster (``ValueError`` when
        there is none)."""
        try:
            return cls(name, tier_actor(name))
        except ValueError:
            raise ValueError(f"no data tier named {name!r} on this Ray cluster") from None

    def addresses(self) -> list[str]:
        """The servers that are up and not draining (``tcp://NODE_IP:PORT`` each)."""
        return list(_get(self._actor.addresses.remote()))

    def servers(self) -> list[dict[str, Any]]:
        """Every server of the tier: ``address``, ``node_id``, ``pid`` (its serve process),
        ``actor_pid``, ``restarts``, ``draining``, ``actor`` (the actor's handle)."""
        return list(_get(self._actor.servers.remote()))

    def scale(self, n: int, timeout: float = 120.0) -> list[str]:
        """Run ``n`` servers: start the missing ones and wait until they are ready
        (``TimeoutError`` past ``timeout``: those not placed yet stay wanted and join when
        Ray places them), or drain the newest beyond ``n`` (SIGTERM; they leave
        ``addresses()`` at once and exit within ``--drain-seconds``). Returns the addresses."""
        _get(self._actor.scale.remote(int(n)))
        return list(_get(self._actor.wait_ready.remote(timeout)))

    def shutdown(self, timeout: float | None = None) -> None:
        """Drain every server, wait until each has exited (SIGKILL past ``timeout``, by
        default the drain's limit and a margin), then end every actor of the tier. A tier
        already shut down is left as it is."""
        try:
            _get(self._actor.shutdown.remote(timeout))
        except ray.exceptions.RayActorError:
            return  # its actor is gone: shut down already (its servers went with it)
        finally:
            ray.kill(self._actor)

    def __repr__(self) -> str:
        return f"DataTier({self.address!r})"
