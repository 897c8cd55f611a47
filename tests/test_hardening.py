"""No message, value or network fault may crash, hang or silently stall a server or a
trainer: every receive loop survives a handler that raises; the client refuses at the call
what the wire would refuse; a server's refusal of the session fails at once; and every hang
path found so far is closed, each shown with real processes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter, deque
from pathlib import Path
from typing import Any

import pytest
from clients import make_client
from conftest import Server, free_port, server_env, wait_until
from fuzz_targets import welcome_of

from dataserver.loop import InjectedFault, configure_faults
from dataserver_client import Batch, DataServerClient, DataServerError

pytestmark = pytest.mark.timeout(180)

FLAT = ("--dataset", "ds_plugins:flat", "--dataset-args", json.dumps({"n": 64}))
SLOW = ("--dataset", "ds_plugins:slow", "--dataset-args", json.dumps({"n": 96, "ms": 10}))
SMALL: dict[str, Any] = {"batch_size": 8, "image_size": (32, 32)}


def indices(batches: list[Batch]) -> list[int]:
    return sorted(i for b in batches for idx in b.indices for i in idx)


def epoch(client: DataServerClient, n: int = 0) -> list[Batch]:
    client.set_epoch(n)
    return list(client)


# ---------------------------------------------------------------- loops survive handlers


@pytest.mark.parametrize("site", ["front.task", "front.backend", "worker.task"])
def test_a_server_handler_that_raises_costs_one_message_and_the_epoch_is_exact(
    start_server: Any, site: str
) -> None:
    # Every process counts its own calls: with two workers, a task the first one dropped at
    # its 9th could be retried as the other's 9th and dropped again (the front retries once,
    # then passes the error on), depending on how the two interleave. One worker: the retry
    # is its 10th call.
    workers = 1 if site == "worker.task" else 2
    server = start_server(*FLAT, env={"DATASERVER_INJECT_FAULTS": f"{site}:9"}, workers=workers)
    with make_client(server.address, timeout=60, **SMALL) as client:
        start = time.monotonic()
        got = epoch(client)
        elapsed = time.monotonic() - start
        assert indices(got) == list(range(64))
        assert indices(epoch(client, 1)) == list(range(64))
        asked = client.stats().get("asked_again_deadline", 0)
    assert elapsed < 30  # a deadline of seconds, not the 60 s timeout
    stats = server.stats()
    assert stats["rejected"]["internal"] >= 1  # counted ...
    assert server.proc.poll() is None and stats["workers_started"] == workers  # nothing died
    if site == "front.backend":
        # A dropped DONE: the result came straight from the worker; the front lets go of
        # the task when that worker answers the next one, so the worker is not held busy.
        assert stats["counters"]["worker_answers_lost"] >= 1
    elif site == "worker.task":
        # The worker names the task it dropped; the front runs it again at once.
        assert stats["counters"]["tasks_retried"] >= 1
    else:
        assert asked >= 1  # a task the front dropped: the client asks again after its deadline


def test_a_client_handler_that_raises_costs_one_message_and_the_epoch_is_exact(
    synthetic_server: Server,
) -> None:
    configure_faults("client.result:3")
    try:
        with make_client(synthetic_server.address, timeout=60, **SMALL) as client:
            assert indices(epoch(client)) == list(range(96))
            stats = client.stats()
    finally:
        configure_faults("")
    assert stats["rejected"]["internal"] >= 3
    assert stats["asked_again_deadline"] >= 3


# ---------------------------------------------------------------- values refused at the call


def test_the_client_refuses_at_the_call_what_the_wire_would_refuse(
    synthetic_server: Server,
) -> None:
    address = synthetic_server.address
    with pytest.raises(ValueError, match=r"seed must be in 0\.\.2\*\*63-1, got -1"):
        make_client(address, seed=-1, **SMALL)
    with pytest.raises(ValueError, match="exceeds 16384 pixels"):
        make_client(address, image_size=(20000, 64))
    with make_client(address, **SMALL) as client:
        with pytest.raises(ValueError, match="key 1 is not a string"):
            client.control(weights={1: 0.5})
        with pytest.raises(ValueError, match="nested deeper than 8"):
            client.control(x=[[[[[[[[[[1]]]]]]]]]])
        with pytest.raises(ValueError, match="bytes packed, more than"):
            client.control(blob="x" * 100_000)
        with pytest.raises(ValueError, match="msgpack-able"):
            client.control(thing=object())
        client.control(weights={"1": 0.5})  # what the wire takes is taken
        assert indices(epoch(client)) == list(range(96))


def test_a_server_refusing_the_session_fails_at_once_naming_its_flag(start_server: Any) -> None:
    server = start_server(*FLAT, "--max-image-side", "256", "--max-sessions", "1", workers=1)
    start = time.monotonic()
    with pytest.raises(DataServerError, match="--max-image-side"):
        make_client(server.address, image_size=(512, 512), timeout=30)
    assert time.monotonic() - start < 5
    with make_client(server.address, timeout=30, **SMALL) as first:
        start = time.monotonic()
        with pytest.raises(DataServerError, match="--max-sessions 1"):
            make_client(server.address, timeout=30, **SMALL)
        assert time.monotonic() - start < 5  # the server's words at once, not the timeout
        assert indices(epoch(first)) == list(range(64))


# ---------------------------------------------------------------- hang paths


def _ports(endpoints: tuple[str, ...]) -> list[int]:
    return [int(e.rsplit(":", 1)[1]) for e in endpoints if e.startswith("tcp://")]


def test_results_lost_on_the_direct_path_are_asked_again(start_server: Any) -> None:
    """Kill the client's TCP connections to the workers' result ports (``ss -K``, as root)
    on every other batch: results in them are lost after the workers' DONE."""
    if os.geteuid() != 0 or shutil.which("ss") is None:
        pytest.skip("needs root and ss (iproute2) to kill connections")
    server = start_server(*SLOW, "--cache-gb", "0", workers=2)  # every epoch as slow
    ports = _ports(welcome_of(server.address).results)
    assert len(ports) == 2
    with make_client(server.address, timeout=30, **SMALL) as client:
        assert indices(epoch(client)) == list(range(96))  # connected, warm
        client.set_epoch(1)
        got, killed = [], 0
        start = time.monotonic()
        for n, batch in enumerate(client):
            got.append(batch)
            if n % 2 == 0:
                for port in ports:
                    out = subprocess.run(
                        ["ss", "-K", "dst", "127.0.0.1", "dport", "=", str(port)],
                        capture_output=True,
                        text=True,
                        timeout=10,
                    )
                    killed += out.stdout.count("ESTAB")
        elapsed = time.monotonic() - start
        stats = client.stats()
    if killed == 0:
        pytest.skip("ss -K killed nothing here (kernel without SOCK_DESTROY)")
    assert indices(got) == list(range(96))
    assert elapsed < 15, f"stalled: {elapsed:.1f} s"  # not the 30 s timeout
    asked = sum(v for k, v in stats.items() if k.startswith("asked_again"))
    assert asked >= 1, stats


def test_every_server_lost_at_once_and_only_one_back_gets_all_the_tasks() -> None:
    ports = [free_port(), free_port()]
    servers = [Server(*SLOW, workers=2, bind=f"tcp://127.0.0.1:{p}") for p in ports]
    back: Server | None = None
    try:
        with make_client([s.address for s in servers], timeout=30, **SMALL) as client:
            client.set_epoch(0)
            got = []
            start = time.monotonic()
            for n, batch in enumerate(client):
                got.append(batch)
                if n == 2:
                    for s in servers:
                        s.kill()
                    time.sleep(0.5)
                    back = Server(*SLOW, workers=2, bind=f"tcp://127.0.0.1:{ports[0]}")
            elapsed = time.monotonic() - start
        assert indices(got) == list(range(96))
        assert elapsed < 20, f"{elapsed:.1f} s"
    finally:
        for s in [*servers, *([back] if back else [])]:
            s.stop()


def test_poison_probes_that_find_no_poisonous_source_do_not_loop(start_server: Any) -> None:
    server = start_server(  # no store: every composition reads its sources from the dataset
        "--dataset",
        "ds_plugins:poison_when_stitched",
        "--dataset-args",
        '{"n": 32, "index": 5}',
        "--cache-gb",
        "0",
    )
    kw: dict[str, Any] = {**SMALL, "batch_size": 2, "shuffle": False, "timeout": 60}
    with make_client(server.address, on_error="skip", **kw) as client:
        client.set_mode("stitch")
        start = time.monotonic()
        got = epoch(client)
        assert time.monotonic() - start < 40
        assert indices(got) == [i for i in range(32) if i not in (4, 5, 6, 7)]
        assert sum(b.skipped for b in got) == 4
        assert sorted(i for b in got for i in b.skipped_indices) == [4, 5, 6, 7]
        assert client.stats()["skipped_poison_images"] == 1
    with make_client(server.address, **kw) as client:
        client.set_mode("stitch")
        client.set_epoch(0)
        it = iter(client)
        with pytest.raises(DataServerError, match=r"sample \[4, 5, 6, 7\] killed 2 worker"):
            next(it)
        assert [i for b in it for idx in b.indices for i in idx] == list(range(8, 32))


def test_calls_after_the_io_thread_died_raise_at_once_with_the_cause(
    synthetic_server: Server,
) -> None:
    client = make_client(synthetic_server.address, timeout=30, **SMALL)
    try:
        configure_faults("client.loop:1")
        assert wait_until(lambda: not client._engine.is_alive(), 5)
        for call in (
            lambda: iter(client),
            lambda: client.feedback(0.5),
            lambda: client.set_mode("stitch"),
            client.state_dict,
            client.stats,
        ):
            start = time.monotonic()
            with pytest.raises(DataServerError, match=r"fault injected at client\.loop") as info:
                call()
            assert time.monotonic() - start < 1.0
            assert isinstance(info.value.__cause__, InjectedFault)
    finally:
        configure_faults("")
        client.close()


def test_close_never_closes_descriptors_the_io_thread_may_still_poll(
    synthetic_server: Server,
) -> None:
    client = make_client(synthetic_server.address, **SMALL)
    engine = client._engine
    threading.Thread(target=engine.call, args=(time.sleep, 7.0), daemon=True).start()
    time.sleep(0.3)  # the I/O thread is now stuck in that command
    wake = engine._mailbox.fd
    client.close()  # gives up waiting after 5 s ...
    assert engine.is_alive()
    os.fstat(wake)  # ... and leaves the thread's descriptors open (no EBADF, no reuse)
    assert wait_until(lambda: not engine.is_alive(), 10)
    assert engine._mailbox.fd == -1  # the thread closed the pipe itself (both ends)


def test_workers_that_cannot_start_make_serve_exit_with_their_error_in_one_line() -> None:
    start = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dataserver.cli",
            "serve",
            "--dataset",
            "ds_plugins:fails_in_worker",
            "--workers",
            "2",
            "--bind",
            "tcp://127.0.0.1:0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=server_env(),
    )
    elapsed = time.monotonic() - start
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("dataserver serve: error: worker ")
    assert "failed to start" in last and "mounted on the front only" in last
    assert elapsed < 20


def test_a_dying_worker_blames_only_the_task_it_was_running(start_server: Any) -> None:
    server = start_server(
        "--dataset", "ds_plugins:poison", "--dataset-args", '{"n": 24, "index": 7}', workers=1
    )
    kw: dict[str, Any] = {**SMALL, "batch_size": 4, "shuffle": False, "timeout": 60}
    named: Counter[int | None] = Counter()
    with make_client(server.address, **kw) as client:
        for n in range(3):
            client.set_epoch(n)
            it = iter(client)
            delivered: list[int] = []
            while True:
                try:
                    batch = next(it)
                except StopIteration:
                    break
                except DataServerError as exc:
                    named[exc.index] += 1
                    continue
                delivered.extend(i for idx in batch.indices for i in idx)
            # Only the batch holding 7 fails; the task queued behind 7 is never blamed.
            assert delivered == [i for i in range(24) if not 4 <= i < 8]
        client_stats = {k: v for k, v in client.stats().items() if isinstance(v, int)}
    assert named == {7: 3}
    stats = server.stats()["counters"]
    # Two deaths per epoch, blamed on the image holding sample 7 alone: the task it came in
    # (with the images beside it) is answered poison once, the rest asked again.
    assert stats["tasks_poisoned"] == 3 and stats["worker_deaths"] == 6, (stats, client_stats)


def test_the_router_blames_the_running_task_not_the_one_before_it(tmp_path: Path) -> None:
    """The front had not yet read task A's DONE when the worker died running B."""
    from dataserver.counting import Counts
    from dataserver.server.counts import Count, Reject
    from dataserver.server.front.pool import WorkerHandle
    from dataserver.server.front.routing import WorkerRouter
    from dataserver.server.front.sessions import Scheduler, TaskEntry
    from dataserver.server.running import RunningSlot

    class Pool:
        def __init__(self) -> None:
            self.workers: dict[int, Any] = {}

        def dead(self) -> list[Any]:
            return list(self.workers.values())

        def forget(self, handle: Any) -> float:
            self.workers.pop(handle.slot)
            return 60.0

        def retry_due(self, now: float) -> None:
            pass  # (no start of a worker failed here)

    class Sends:
        def __init__(self) -> None:
            self.replies: list[Any] = []

        def reply(self, session: Any, msg: Any) -> None:
            self.replies.append(msg)

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    slot = RunningSlot.open(str(tmp_path), 0)
    handle = WorkerHandle(0, proc, None, 0.0, slot, identity=b"w0")
    pool = Pool()
    pool.workers[0] = handle
    scheduler = Scheduler(8, 64, 1 << 20, 1 << 20)
    session = scheduler.open(b"s" * 16, b"client", b"a-secret-of-16-b")
    assert session is not None
    a, b = (TaskEntry(session.sid, tid, 1, ((tid,),), []) for tid in (1, 2))
    handle.tasks = deque([a, b])
    slot.set(session.sid, 2)  # B was running
    sends = Sends()
    router = WorkerRouter(pool, scheduler, sends, Counts(Count), Counts(Reject))  # type: ignore[arg-type]
    router.reap()
    assert (a.attempts, b.attempts) == (0, 1)
    assert [e.task_id for e in session.queue] == [1, 2]  # both back, in order, A unblamed
    slot.close()
