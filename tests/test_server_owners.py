"""The server's owners alone, without sockets: a worker's configuration written once, the
read model STATS and the metrics share, a worker handle's tasks, the store's claim rule, the
client messages' checks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import zmq
from fuzzing import AUTH, SID, task_header

from dataserver.counting import Counts
from dataserver.hashing import mix64
from dataserver.protocol import Bye, ErrorMsg, Hello, Task, Welcome
from dataserver.server.config import ServerConfig, WorkerConfig
from dataserver.server.counts import Count, Reject
from dataserver.server.front.clients import Clients, FrontSide
from dataserver.server.front.metrics import ViewCollector
from dataserver.server.front.outlet import Outlet
from dataserver.server.front.pool import WorkerHandle
from dataserver.server.front.routing import WorkerRouter
from dataserver.server.front.sessions import Scheduler, TaskEntry
from dataserver.server.front.statsview import StatsView
from dataserver.server.front.view import Limits, ServerView, StoreUsage
from dataserver.server.running import RunningSlot

pytestmark = pytest.mark.timeout(60)


def test_worker_config_round_trips_and_reads_flags() -> None:
    config = WorkerConfig(
        backend="ipc:///tmp/x/backend",
        state_dir="/tmp/x",
        dataset="synthetic:images=8",
        store_fds=(5, 6),
        store_bytes=1 << 24,
        results_bind="tcp://127.0.0.1:*",
        local_results=True,
        curve=("secret", "authorized"),
    )
    slot = config.for_slot(3, 1234)
    assert (slot.worker_id, slot.parent_pid) == (3, 1234)
    assert WorkerConfig.from_argv([slot.to_json()]) == slot
    ipc = WorkerConfig("b", "d", "ds", results_bind="ipc:///r-{slot}").for_slot(2, 1)
    assert ipc.results_bind == "ipc:///r-2"
    flags = "--backend b --state-dir d --dataset ds --worker-id 1 --store-fds 3,4"
    by_hand = WorkerConfig.from_argv(flags.split())
    assert by_hand.store_fds == (3, 4) and by_hand.worker_id == 1 and not by_hand.local_results


def _view(**over: object) -> ServerView:
    counters, rejected = Counts(Count), Counts(Reject)
    counters.count(Count.SOURCES_DECODED, 1)
    counters.count(Count.SOURCES_REUSED, 3)
    rejected.count(Reject.MALFORMED, 2)
    base: dict[str, object] = {
        "server_id": "s",
        "started": 100.0,
        "taken": 112.34,
        "metrics_port": None,
        "dataset_len": 8,
        "fingerprint": "f",
        "workers": 2,
        "workers_alive": 2,
        "workers_ready": 2,
        "workers_busy": 1,
        "workers_started": 3,
        "worker_spawn_failures": 0,
        "queue_depth": 4,
        "queued_bytes": 40,
        "results_unread_bytes": 0,
        "sessions": 1,
        "sessions_evicted": 0,
        "connections": 2,
        "draining_for_s": None,
        "limits": Limits(1024, 4096, 256, 100, 30.0, 64),
        "store": StoreUsage(1, 10, 1 << 20),
        "sources": "stored",
        "counters": ServerView.frozen(counters),
        "rejected": ServerView.frozen(rejected),
    }
    base.update(over)
    return ServerView(**base)  # type: ignore[arg-type]


def test_one_view_serves_stats_and_metrics() -> None:
    view = _view()
    stats = view.as_stats()
    assert stats["uptime_s"] == 12.3 and stats["store"]["hit_rate"] == 0.75
    assert stats["rejected_total"] == 2 and stats["draining"] is None
    assert view.worker_restarts == 1
    with pytest.raises(TypeError):
        view.counters["x"] = 1  # type: ignore[index]
    fams = {m.name: m for m in ViewCollector(lambda: view).collect()}
    assert fams["dataserver_worker_restarts"].samples[0].value == 1
    assert fams["dataserver_cache_hits"].samples[0].value == 3
    assert not list(ViewCollector(lambda: None).collect())  # nothing published yet
    assert "dataserver_cache_bytes" not in {
        m.name for m in ViewCollector(lambda: _view(store=None)).collect()
    }


def test_a_handle_gives_up_entries_answered_before_the_one_answered(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    slot = RunningSlot.open(str(tmp_path), 0)
    handle = WorkerHandle(0, proc, None, 0.0, slot)
    a, b, c = (TaskEntry(b"s" * 16, tid, 1, ((tid,),), []) for tid in (1, 2, 3))
    for entry in (a, b, c):
        handle.give(entry)
    assert all(e.held_by is handle for e in (a, b, c))
    assert handle.answered(b"s" * 16, 9) is None
    lost, got = handle.answered(b"s" * 16, 2) or ([], None)
    assert lost == [a] and got is b and a.held_by is None and b.held_by is None
    assert handle.drop_all() == [c] and c.held_by is None and not handle.tasks
    handle.learned_control(b"s" * 16, 4)
    assert handle.has_control(b"s" * 16, 4)
    handle.forgot_control(b"s" * 16)
    assert not handle.has_control(b"s" * 16, 4)
    slot.close()


def test_mix64_is_splitmix64() -> None:
    # (the finaliser's published first outputs for seed 0: state 0x9E3779B97F4A7C15)
    assert mix64(0) == 0xE220A8397B1DCDAF


class FakeOutlet:
    """Records what the front would send (``Outlet.send_to`` / ``cancel``)."""

    def __init__(self) -> None:
        self.sent: list[tuple[bytes, Any]] = []

    def send_to(self, identity: bytes, msg: Any) -> None:
        self.sent.append((identity, msg))

    def cancel(self, session: Any, entries: list[Any]) -> None:
        pass


class FakeRouter:
    def result_endpoints(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return (), ()

    def is_running(self, entry: Any) -> bool:
        return False


def _welcome(session: bytes, nonce: bytes = b"", fd: int = -1) -> Welcome:
    return Welcome(
        session=session,
        server_id="server-1",
        dataset_len=10,
        fingerprint="f",
        workers=2,
        credit=8,
    )


def _clients(draining: bool = False) -> tuple[Clients, FakeOutlet, Counts[Reject]]:
    outlet, counters, rejected = FakeOutlet(), Counts(Count), Counts(Reject)
    config = SimpleNamespace(
        curve=None,
        max_sessions=4,
        max_image_side=4096,
        max_queued_mb=64,
        max_task_mb=64,
        max_task_bytes=64 << 20,
    )
    clients = Clients(
        cast(ServerConfig, config),
        Scheduler(4, 64, 1 << 20, 1 << 24),
        cast(Outlet, outlet),
        cast(WorkerRouter, FakeRouter()),
        StatsView(rejected, None),
        counters,
        rejected,
        FrontSide("server-1", welcome=_welcome, stats=dict, draining=lambda: draining),
    )
    return clients, outlet, rejected


def _frames(msg: Any) -> list[Any]:
    return [zmq.Frame(b"peer"), *(zmq.Frame(bytes(f)) for f in msg.encode())]


def test_clients_refuse_a_task_before_hello_and_greet_with_the_fronts_welcome() -> None:
    clients, outlet, rejected = _clients()
    clients.on_data(_frames(Task(**task_header(SID))))
    ((identity, refusal),) = outlet.sent
    assert identity == b"peer" and isinstance(refusal, ErrorMsg)
    assert refusal.kind == "unknown_session" and refusal.task_id == 1
    assert rejected.get(Reject.UNKNOWN_SESSION) == 1
    clients.on_data(_frames(Hello(session=SID, auth=AUTH)))
    assert outlet.sent[-1] == (b"peer", _welcome(SID))  # the front's, as it is
    clients.on_data(_frames(Task(**task_header(SID))))
    assert len(outlet.sent) == 2  # taken: no answer yet


def test_clients_send_bye_to_a_hello_while_draining() -> None:
    clients, outlet, _ = _clients(draining=True)
    clients.on_data(_frames(Hello(session=SID, auth=AUTH)))
    ((_, reply),) = outlet.sent
    assert isinstance(reply, Bye) and reply.session == SID
