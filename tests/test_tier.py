"""The data tier under a running job: servers join by DNS discovery, leave by a drain
(SIGTERM) or by dying (SIGKILL); the epoch stays exactly once and bit-identical to an
undisturbed one. Real processes throughout; the DNS test rewrites /etc/hosts inside a
private mount namespace (``unshare -m``: needs root; skipped without)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from clients import make_client
from conftest import Server, server_env, wait_until

pytestmark = pytest.mark.timeout(300)

TESTS = Path(__file__).resolve().parent
N = 1600  # samples; 20 ms each: one 2-worker server makes ~100/s, three ~300/s
SIM = [
    "--dataset",
    "dataserver.data.simulated:simulated",
    "--dataset-args",
    json.dumps({"n": N, "ms": 20, "size": 32}),
    "--cache-gb",
    "0",
]


class Trainer:
    """``tests/tier_trainer.py`` in a process of its own; its batch records as they come.
    It holds before its next batch while the go file says "pause"."""

    def __init__(self, address: str, go: Path, prefix: list[str] | None = None) -> None:
        go.write_text("run")
        self.go = go
        cmd = [sys.executable, str(TESTS / "tier_trainer.py"), address, "--go", str(go)]
        cmd += ["--interval", "0.2"]
        self.proc = subprocess.Popen(
            [*(prefix or []), *cmd],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=server_env(),
        )
        self.records: list[dict[str, Any]] = []
        self.stats: dict[str, Any] | None = None
        self.times: list[float] = []  # when each record arrived (this process's clock)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            item = json.loads(line)
            if "stats" in item:
                self.stats = item["stats"]
            else:
                self.records.append(item)
                self.times.append(time.monotonic())

    def at(self, step: int, timeout: float = 60.0) -> None:
        assert wait_until(lambda: len(self.records) > step or self.proc.poll() is not None, timeout)
        assert len(self.records) > step, self.stderr()

    def pause(self) -> int:
        """Hold the trainer; the step it holds after."""
        self.go.write_text("pause")
        time.sleep(0.2)
        return len(self.records)

    def resume(self) -> float:
        self.go.write_text("run")
        return time.monotonic()

    def finish(self, timeout: float = 120.0) -> None:
        self.proc.wait(timeout)
        self._reader.join(5)
        assert self.proc.returncode == 0, self.stderr()

    def stderr(self) -> str:
        if self.proc.poll() is None:
            return "(still running)"
        assert self.proc.stderr is not None
        return self.proc.stderr.read()[-3000:]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def rate(self, since: float, until: float) -> float:
        """Samples per second over the batches that arrived between two instants."""
        picked = [
            (t, sum(map(len, r["indices"])))
            for t, r in zip(self.times, self.records, strict=False)
            if since < t <= until
        ]
        if len(picked) < 3:
            return 0.0
        return sum(n for _, n in picked[1:]) / (picked[-1][0] - picked[0][0])


@pytest.fixture
def trainers() -> Iterator[list[Trainer]]:
    started: list[Trainer] = []
    yield started
    for t in started:
        t.close()


@pytest.fixture(scope="module")
def reference() -> Iterator[list[dict[str, Any]]]:
    """The epoch as one undisturbed server makes it."""
    server = Server(*SIM, workers=2)
    go = Path(os.environ.get("TMPDIR", "/tmp")) / f"ds-go-{os.getpid()}"
    trainer = Trainer(server.address, go)
    try:
        trainer.finish()
        yield trainer.records
    finally:
        trainer.close()
        server.stop()
        go.unlink(missing_ok=True)


def check_exact(records: list[dict[str, Any]], reference: list[dict[str, Any]]) -> None:
    delivered = [i for r in records for image in r["indices"] for i in image]
    assert sorted(delivered) == list(range(N)), "not exactly once"
    assert [r["indices"] for r in records] == [r["indices"] for r in reference]
    assert [r["digest"] for r in records] == [r["digest"] for r in reference], "not bit-identical"


def test_sigterm_drains_a_server_under_a_running_epoch(
    start_server: Any, trainers: list[Trainer], reference: list[dict[str, Any]], tmp_path: Path
) -> None:
    a = start_server(*SIM, "--drain-seconds", "20", workers=2)
    b = start_server(*SIM, "--drain-seconds", "20", workers=2)
    trainer = Trainer(f"{a.address},{b.address}", tmp_path / "go")
    trainers.append(trainer)
    trainer.at(20)
    sent = time.monotonic()
    a.drain()
    a.proc.wait(25)
    drain_s = time.monotonic() - sent
    assert a.proc.returncode == 0
    assert "draining" in a.read_stderr()
    assert drain_s < 20, f"the drain took the whole grace period ({drain_s:.1f} s)"
    trainer.finish()
    check_exact(trainer.records, reference)
    assert trainer.stats is not None and trainer.stats["servers_drained"] == 1
    print(f"\ndrain: SIGTERM to exit {drain_s:.2f} s")


def test_a_draining_server_takes_no_new_client_and_reports_it(start_server: Any) -> None:

    a = start_server(*SIM, "--drain-seconds", "20", workers=1)
    b = start_server(*SIM, "--drain-seconds", "20", workers=1)
    with make_client(
        [a.address, b.address], batch_size=4, image_size=(32, 32), device=None
    ) as busy:
        busy.set_epoch(0)
        it = iter(busy)
        next(it)
        a.drain()
        assert wait_until(lambda: b.proc.poll() is None and a.proc.poll() is not None, 25)
    assert a.proc.returncode == 0
    # A client that meets only a draining server gets its handshake from the others.
    c = start_server(*SIM, "--drain-seconds", "20", workers=1)
    with make_client(
        [b.address, c.address], batch_size=4, image_size=(32, 32), device=None
    ) as client:
        client.set_epoch(0)
        next(iter(client))
        c.drain()
        assert wait_until(lambda: c.proc.poll() is not None, 25)
    out = subprocess.run(
        [sys.executable, "-m", "dataserver.cli", "stats", b.address, "--check"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def _can_unshare() -> str | None:
    if os.geteuid() != 0:
        return "needs root (unshare -m, a private /etc/hosts)"
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        return "needs unshare and mount (util-linux)"
    probe = subprocess.run(
        [
            "unshare",
            "-m",
            "--propagation",
            "private",
            "sh",
            "-c",
            "mount --bind /etc/hosts /etc/hosts",
        ],
        capture_output=True,
        timeout=10,
    )
    if probe.returncode != 0:
        why = probe.stderr.decode(errors="replace").strip()
        return f"unshare -m with a bind mount over /etc/hosts fails here: {why}"
    return None


def _port_free_on(hosts: list[str]) -> int:
    for _ in range(50):
        with socket.socket() as s:
            s.bind((hosts[0], 0))
            port = int(s.getsockname()[1])
        try:
            for h in hosts[1:]:
                with socket.socket() as s:
                    s.bind((h, port))
        except OSError:
            continue
        return port
    raise RuntimeError("no port free on every address")


def test_servers_join_by_dns_and_leave_by_drain_and_kill_exactly_once(
    start_server: Any, trainers: list[Trainer], reference: list[dict[str, Any]], tmp_path: Path
) -> None:
    why = _can_unshare()
    if why:
        pytest.skip(why)
    ips = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
    port = _port_free_on(ips)
    _, b, c = (
        start_server(*SIM, "--drain-seconds", "20", workers=2, bind=f"tcp://{ip}:{port}")
        for ip in ips
    )
    hosts = tmp_path / "hosts"

    def publish(*addresses: str) -> None:  # rewritten in place: the bind mount follows
        with open(hosts, "w") as f:
            f.write("127.0.0.1 localhost\n")
            f.writelines(f"{ip} ds.test\n" for ip in addresses)

    publish(ips[0])
    mount = f'mount --bind {hosts} /etc/hosts && exec "$@"'
    prefix = ["unshare", "-m", "--propagation", "private", "sh", "-c", mount, "sh"]
    trainer = Trainer(f"tcp://ds.test:{port}", tmp_path / "go", prefix)
    trainers.append(trainer)

    trainer.at(25)  # one server
    held = trainer.pause()
    one = trainer.rate(trainer.times[2], trainer.times[held - 1])
    published = time.monotonic()
    publish(*ips)  # two more join under the running epoch
    assert wait_until(lambda: b.stats()["sessions"] == 1 and c.stats()["sessions"] == 1, 10)
    join_s = time.monotonic() - published
    resumed = trainer.resume()
    trainer.at(held + 60)
    held = trainer.pause()
    three = trainer.rate(resumed + 0.3, trainer.times[held - 1])

    b.drain()  # scale-down: SIGTERM, and the pod leaves the Service
    publish(ips[0], ips[2])
    trainer.resume()
    trainer.at(held + 15)
    c.kill()  # a node dies: no drain, still in DNS for a while
    trainer.at(held + 25)
    publish(ips[0])
    trainer.finish()
    b.proc.wait(25)
    assert b.proc.returncode == 0

    check_exact(trainer.records, reference)
    stats = trainer.stats
    assert stats is not None
    # (B's BYE and its leaving DNS race, as on Kubernetes: either way its tasks move.)
    assert stats["servers_joined"] == 2 and stats["servers_left"] == 2
    assert "draining" in b.read_stderr()
    print(
        f"\njoin seen by both servers {join_s:.2f} s after DNS; samples/s {one:.0f} -> {three:.0f}"
    )
    assert three > 1.5 * one, (
        f"throughput did not rise with three servers: {one:.0f} -> {three:.0f}"
    )
