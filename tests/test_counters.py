"""Counters are declared once per side (``dataserver/server/counts.py``,
``client/dataserver_client/counts.py``): every name the code counts is declared, and every
declared name is exported (``dataserver stats``, the server's metrics, ``client.stats()``)."""

from __future__ import annotations

import ast
import itertools
from enum import StrEnum
from pathlib import Path
from typing import Any, get_args

import pytest
from clients import make_client
from conftest import Server

from dataserver.counting import Counts
from dataserver.server import counts as server_counts
from dataserver.server.counts import Count, Reject, WorkerCount
from dataserver.server.front.metrics import ViewCollector
from dataserver.server.front.view import Limits, ServerView
from dataserver_client import counts as client_counts

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parent.parent
SIDES: dict[Path, tuple[type[StrEnum], ...]] = {
    ROOT / "dataserver": (Count, Reject, WorkerCount),
    ROOT / "client" / "dataserver_client": (
        client_counts.Count,
        client_counts.Reject,
        client_counts.Flip,
    ),
}
COUNTING = {"count", "record"}  # the methods of ``Counts`` that name a counter
HOLDERS = ("counters", "rejected", "_dropped", "counts", "flips")  # what holds a ``Counts`` here


def _files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.py"))


def _undeclared(node: ast.Attribute, enums: dict[str, type[StrEnum]]) -> bool:
    """Whether ``node`` is ``Enum.NAME`` of a side's declaration, and NAME is not in it."""
    enum = enums.get(node.value.id) if isinstance(node.value, ast.Name) else None
    return enum is not None and node.attr not in enum.__members__


def test_every_counter_written_is_a_declared_name() -> None:
    """No counter is written by subscript, and every ``count``/``record`` names a member
    of its side's declaration (mypy checks the types; this checks the spelling of what is
    written, so a counter that nobody declared cannot appear)."""
    problems: list[str] = []
    for root, declared in SIDES.items():
        enums = {e.__name__: e for e in declared}
        for path in _files(root):
            tree = ast.parse(path.read_text())
            where = path.relative_to(ROOT)
            for node in ast.walk(tree):
                if isinstance(node, (ast.AugAssign, ast.Assign)):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    for t in targets:
                        if isinstance(t, ast.Subscript) and ast.unparse(t.value).endswith(
                            ("counters", "rejected")
                        ):
                            problems.append(f"{where}:{node.lineno}: {ast.unparse(t)} written")
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr in COUNTING
                    and ast.unparse(node.func.value).endswith(HOLDERS)
                    and node.args
                    and isinstance(node.args[0], (ast.Constant, ast.JoinedStr, ast.BinOp))
                ):
                    name = ast.unparse(node.args[0])
                    problems.append(f"{where}:{node.lineno}: {name} is not a declared name")
                if isinstance(node, ast.Attribute) and _undeclared(node, enums):
                    problems.append(f"{where}:{node.lineno}: {ast.unparse(node)} undeclared")
    assert not problems, "\n".join(problems)


def test_every_family_name_is_declared() -> None:
    """The names made from a family's suffixes are all declared (a suffix added to a
    ``Literal`` without its member fails here)."""
    for socket in get_args(server_counts.Watched):
        assert server_counts.connections(socket) in Count
        assert server_counts.disconnects(socket) in Count
        assert server_counts.not_authorized(socket) in Reject
        assert server_counts.bad_handshake(socket) in Reject
    for socket, reason in itertools.product(
        get_args(server_counts.Tracked), get_args(server_counts.Dropped)
    ):
        assert server_counts.dropped(socket, reason) in Reject
    assert len(server_counts.LANDING_REFUSED) == len(get_args(server_counts.LandingRefusal))
    assert set(client_counts.ASKED_AGAIN.values()) <= set(client_counts.Count)


def test_counts_take_only_their_declared_names() -> None:
    counts = Counts(Count)
    counts.count(Count.HELLOS)
    with pytest.raises(TypeError):
        counts.count("hellos")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        counts.count(Reject.MALFORMED)  # type: ignore[arg-type]
    counts.record(Count.TASKS_PACED, 7)
    counts.count(Count.SOURCES_DECODED, 0)  # counted by 0: shown (``Counter``'s habit)
    assert counts.snapshot() == {"tasks_paced": 7, "sources_decoded": 0, "hellos": 1}
    assert counts.take() == {Count.HELLOS: 1, Count.TASKS_PACED: 7, Count.SOURCES_DECODED: 0}
    assert counts.snapshot() == {}


def _everything(names: type[StrEnum]) -> Counts[Any]:
    counts: Counts[Any] = Counts(names)
    for n, name in enumerate(names, 1):
        counts.count(name, n)
    return counts


def test_every_declared_server_name_is_exported() -> None:
    """``dataserver stats`` shows every counter and every rejection reason; the metrics
    show every reason, and read their counters through the declared names."""
    counters, rejected = _everything(Count), _everything(Reject)
    view = ServerView(
        server_id="s",
        started=0.0,
        taken=1.0,
        metrics_port=None,
        dataset_len=8,
        fingerprint="f",
        workers=1,
        workers_alive=1,
        workers_ready=1,
        workers_busy=0,
        workers_started=1,
        worker_spawn_failures=0,
        queue_depth=0,
        queued_bytes=0,
        results_unread_bytes=0,
        sessions=0,
        sessions_evicted=0,
        connections=None,
        draining_for_s=None,
        limits=Limits(1, 1, 1, None, 1.0, 1),
        store=None,
        sources="stored",
        counters=ServerView.frozen(counters),
        rejected=ServerView.frozen(rejected),
    )
    stats = view.as_stats()
    assert stats["counters"] == counters.snapshot() and set(stats["counters"]) == set(Count)
    assert stats["rejected"] == rejected.snapshot() and set(stats["rejected"]) == set(Reject)
    assert stats["rejected_total"] == sum(range(1, len(Reject) + 1))
    families = {m.name: m for m in ViewCollector(lambda: view).collect()}
    shown = {s.labels["reason"]: s.value for s in families["dataserver_rejected_messages"].samples}
    assert shown == rejected.snapshot()
    served = families["dataserver_samples_served"].samples[0].value
    assert served == counters.get(Count.IMAGES_DONE)


def test_every_declared_client_name_is_exported(synthetic_server: Server) -> None:
    """``client.stats()`` shows every counter at its top level and every rejection reason
    in ``rejected``; the first ones from the start."""
    with make_client(synthetic_server.address, batch_size=8, image_size=(32, 32)) as client:
        stats = client.stats()
        assert set(client_counts.SHOWN) <= stats.keys()
        assert stats["rejected"] == {}
        assert stats["flips"] == {name.value: 0 for name in client_counts.Flip}
        engine = client._engine

        def count_everything() -> None:
            for name in client_counts.Count:
                engine.parts.counters.count(name)
            for reason in client_counts.Reject:
                engine.parts.rejected.count(reason)

        engine.call(count_everything)
        stats = client.stats()
    assert all(stats[name] >= 1 for name in client_counts.Count)
    assert stats["rejected"] == {reason: 1 for reason in client_counts.Reject}
