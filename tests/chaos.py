"""The chaos run (issue 9): train a few epochs through ``DataServerClient`` against several
real servers while, at seeded random points of each epoch, workers are SIGKILLed (the pool replaces them),
servers are SIGKILLed and restarted on the same address, a server's link flaps (a server in
a network namespace behind a veth pair: ``ip link set down``/``up``; needs root and
iproute2, otherwise that fault is skipped and the output says so), servers are drained
(SIGTERM, restarted once they exited), and the trainer flips the mode (``set_mode`` or
``feedback``) at random steps.

    python tests/chaos.py [--epochs 3] [--servers 3] [--seed 0] [--faults-per-epoch 5]
                          [--json OUT]

It prints, per epoch and in total, the samples lost and duplicated (compared with the
epoch's shard: both must be 0), batches out of the epoch's order, stale batches (a batch
whose mode or ``feedback_seq`` is not the one set before it), corrupt images (a pixel or
label that is not its sample's), every fault with its time, and the time lost to faults.
Exit status 1 when anything was lost, duplicated, out of order, stale or corrupt, or an
error reached the trainer.

Definitions:
- lost: samples of the epoch's shard delivered fewer times than the shard holds them;
  duplicated: deliveries beyond that (an index outside the shard counts as duplicated).
- time lost (per epoch): the epoch's wall time minus that of a fault-free baseline epoch
  run first with the same servers, steps and flip rate (can be slightly negative: the
  epochs' mode sequences differ).
- fault points: each fault is due once its epoch has delivered a seeded random share
  (5% to 60%) of its samples, not at a time: an epoch the lookahead served ahead from the
  stores can take a fifth of the baseline's time. Past 70% of an epoch the trainer waits
  (before asking for its next batch, at most ``hold_s``) until every fault of the epoch
  has been injected; that wait is left out of the epoch's time (``held_s``).
- stall (per fault): the extra wait in ``next()`` over the baseline's median wait, summed
  over the batches asked for from the fault until the next fault or 10 s, whichever comes
  first. It includes the capacity missing while a killed or drained server restarts (with
  two servers, one down halves the data rate), so it is an attribution, not a latency.

The CI version is ``tests/test_chaos.py``; it calls :func:`run_chaos`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS / "plugins"))  # clients, when run as a script
sys.path.insert(0, str(TESTS))  # conftest and test_netns, when run as a script

from clients import make_client  # noqa: E402
from conftest import Server, free_port  # noqa: E402
from test_netns import Host, NsServer  # noqa: E402

from dataserver_client import DataServerClient, DataServerError  # noqa: E402
from dataserver_client.plan.epoch import epoch_order, shard_of  # noqa: E402

WORKER_KILL, SERVER_KILL, LINK_FLAP, DRAIN = "worker_kill", "server_kill", "link_flap", "drain"
KINDS = (WORKER_KILL, SERVER_KILL, LINK_FLAP, DRAIN)
BASELINE_EPOCH = 1000  # an epoch number the chaos epochs never use


@dataclass
class ChaosConfig:
    """What the run trains on and how hard it is hit."""

    epochs: int = 3
    servers: int = 3
    seed: int = 0
    faults_per_epoch: int = 5
    samples: int = 3000
    sample_ms: float = 20.0  # each sample costs this (a sleep: no CPU) in a worker
    workers: int = 2
    batch_size: int = 8
    image_side: int = 32
    step_ms: float = 20.0  # the "training step": a sleep
    flip_prob: float = 0.2  # chance per step that the trainer flips the mode
    drain_seconds: float = 10.0
    cache_gb: float = 0.0  # > 0: servers keep a store, so flips are served by the lookahead
    warmup: bool = True  # with a store: fill it in an uncounted epoch before the baseline
    link_down_s: tuple[float, float] = (
        0.5,
        4.5,
    )  # a flap's length: under and over the 3 s heartbeat
    netns: bool = True  # put one server behind a veth pair when root and iproute2 exist
    timeout: float = 60.0
    stall_window: float = 10.0
    hold_s: float = 30.0  # past 70% of an epoch, wait at most this for its faults
    quiet: bool = False


@dataclass
class Fault:
    kind: str
    slot: str
    epoch: int
    t: float  # seconds since the run started
    t_epoch: float  # seconds since its epoch started
    detail: dict[str, Any] = field(default_factory=dict)
    stall_s: float = 0.0


# ---------------------------------------------------------------- servers


class Slot:
    """One server address that stays the same across kills, drains and restarts."""

    def __init__(self, name: str, cfg: ChaosConfig, host: Host | None) -> None:
        self.name, self.cfg, self.host = name, cfg, host
        ip = host.there_ip if host is not None else "127.0.0.1"
        # A fresh namespace has every port free; here, ask the kernel for one.
        data = 5555 if host is not None else free_port()
        self.bind = f"tcp://{ip}:{data}"
        self.server: Server | None = None
        self.every: list[Server] = []  # every process started, stopped at the end
        self.up = False
        self.lock = threading.Lock()

    @property
    def address(self) -> str:
        return self.bind

    def start(self) -> float:
        """Start a server on this slot's address; seconds until it was ready."""
        cfg = self.cfg
        args = [
            "--dataset",
            "dataserver.data.simulated:simulated",
            "--dataset-args",
            json.dumps({"n": cfg.samples, "ms": cfg.sample_ms, "size": cfg.image_side}),
            "--cache-gb",
            str(cfg.cache_gb),
            "--drain-seconds",
            str(cfg.drain_seconds),
        ]
        began = time.monotonic()
        for attempt in range(5):  # the old process's port may take a moment to be free
            try:
                if self.host is not None:
                    server: Server = NsServer(
                        self.host.ns, *args, workers=cfg.workers, bind=self.bind
                    )
                else:
                    server = Server(*args, workers=cfg.workers, bind=self.bind)
            except RuntimeError:
                if attempt == 4:
                    raise
                time.sleep(0.5)
                continue
            self.every.append(server)
            self.server = server
            break
        with self.lock:
            self.up = True
        return time.monotonic() - began

    def stop_all(self) -> None:
        for server in self.every:
            try:
                server.stop()
            except Exception:  # keep stopping the others
                if server.proc.poll() is None:
                    server.proc.kill()


def make_host(cfg: ChaosConfig) -> tuple[Host | None, str]:
    """A network namespace for one server, or None and why not."""
    if not cfg.netns:
        return None, "--no-netns"
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return None, "needs root and iproute2"
    try:
        return Host(), ""
    except (subprocess.CalledProcessError, OSError) as exc:
        return None, f"cannot create a network namespace here: {exc}"


# ---------------------------------------------------------------- faults


HOLD_AT = 0.7  # past this share of an epoch the trainer waits for its faults


class Injector:
    """Runs one epoch's schedule of faults (each due at a share of the epoch's samples,
    as the trainer reports it: ``reached``) in a thread of its own; restarts run in threads
    too, so a restart in progress does not hold the next fault back. A fault that takes a
    server out (kill, drain, flap) is injected only while another server is up."""

    def __init__(
        self, slots: list[Slot], rng: random.Random, cfg: ChaosConfig, t0: float, log: Any
    ) -> None:
        self.slots, self.rng, self.cfg, self.t0, self.log = slots, rng, cfg, t0, log
        self.faults: list[Fault] = []
        self.skipped: list[tuple[str, int, str]] = []
        self.share = 0.0  # of the epoch in progress's samples delivered (``reached``)
        self.pending: list[tuple[float, str]] = []
        self.helpers: list[threading.Thread] = []
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None

    def run_epoch(self, epoch: int, schedule: list[tuple[float, str]], start: float) -> None:
        self.stop = threading.Event()
        self.share = 0.0
        self.pending = list(schedule)
        self.thread = threading.Thread(target=self._run, args=(epoch, start), daemon=True)
        self.thread.start()

    def end_epoch(self) -> None:
        """Stop injecting, and wait until every server is back up."""
        self.stop.set()
        if self.thread is not None:
            self.thread.join()
        for helper in self.helpers:
            helper.join()
        self.helpers.clear()

    def _up(self) -> list[Slot]:
        return [s for s in self.slots if s.up]

    def _take_down(self, candidates: list[Slot]) -> Slot | None:
        """Mark one of ``candidates`` down, if another server stays up."""
        up = [s for s in candidates if s.up]
        if not up or len(self._up()) < 2:
            return None
        slot = self.rng.choice(up)
        with slot.lock:
            slot.up = False
        return slot

    def hold(self) -> float:
        """Wait until every fault of the epoch has been injected (at most ``hold_s``);
        the seconds waited."""
        began = time.monotonic()
        while self.pending and time.monotonic() - began < self.cfg.hold_s:
            time.sleep(0.02)
        return time.monotonic() - began

    def reached(self, share: float) -> None:
        """The trainer's word: the epoch has delivered ``share`` of its samples."""
        self.share = share

    def _run(self, epoch: int, start: float) -> None:
        """Inject each fault once its share of the epoch has been delivered and its target
        is available (a fault waiting for a target does not hold back the ones after it)."""
        pending = self.pending
        while pending and not self.stop.wait(0.02):
            share = self.share
            for item in [p for p in pending if p[0] <= share]:
                kind = item[1]
                try:
                    fault = self._inject(kind, epoch, start)
                except Exception as exc:  # report it; the run goes on
                    self.errors.append(f"{kind}: {exc!r}")
                    pending.remove(item)
                    continue
                if fault is not None:
                    pending.remove(item)
                    self.faults.append(fault)
                    self.log(
                        f"  fault  +{fault.t_epoch:6.2f} s  {fault.kind:<11} {fault.slot}"
                        f"  {_detail(fault.detail)}"
                    )
        self.skipped += [(kind, epoch, "the epoch ended first") for _, kind in pending]

    def _fault(self, kind: str, slot: Slot, epoch: int, start: float, **detail: Any) -> Fault:
        now = time.monotonic()
        return Fault(kind, slot.name, epoch, now - self.t0, now - start, dict(detail))

    def _inject(self, kind: str, epoch: int, start: float) -> Fault | None:
        slot: Slot | None
        if kind == WORKER_KILL:
            up = self._up()
            slot = self.rng.choice(up) if up else None
        elif kind == LINK_FLAP:
            slot = self._take_down([s for s in self.slots if s.host is not None])
        else:
            slot = self._take_down(self.slots)
        if slot is None or slot.server is None:
            return None
        server = slot.server
        if kind == WORKER_KILL:
            pid = self.rng.choice(server.worker_pids())
            os.kill(pid, signal.SIGKILL)
            return self._fault(kind, slot, epoch, start, pid=pid)
        if kind == SERVER_KILL:
            fault = self._fault(kind, slot, epoch, start, pid=server.pid)
            server.kill()
            self._helper(self._restart, slot, fault, 0.5)
            return fault
        if kind == DRAIN:
            fault = self._fault(kind, slot, epoch, start, pid=server.pid)
            server.drain()
            self._helper(self._after_drain, slot, server, fault)
            return fault
        if kind == LINK_FLAP and slot.host is not None:
            down_s = round(self.rng.uniform(*self.cfg.link_down_s), 2)
            fault = self._fault(kind, slot, epoch, start, down_s=down_s)
            slot.host.cut()
            self._helper(self._mend, slot, slot.host, down_s)
            return fault
        raise ValueError(kind)

    def _helper(self, target: Any, *args: Any) -> None:
        def guarded() -> None:
            try:
                target(*args)
            except Exception as exc:
                self.errors.append(f"{target.__name__}: {exc!r}")

        thread = threading.Thread(target=guarded, daemon=True)
        self.helpers.append(thread)
        thread.start()

    def _restart(self, slot: Slot, fault: Fault, delay: float) -> None:
        time.sleep(delay)
        fault.detail["back_after_s"] = round(delay + slot.start(), 2)

    def _after_drain(self, slot: Slot, server: Server, fault: Fault) -> None:
        sent = time.monotonic()
        rc = server.proc.wait(self.cfg.drain_seconds + 20)
        fault.detail["exit_after_s"] = round(time.monotonic() - sent, 2)
        fault.detail["rc"] = rc
        if "work still held" in server.read_stderr():  # the grace period ran out
            fault.detail["grace_ran_out"] = True
        if rc != 0:
            self.errors.append(f"{slot.name} exited {rc} after SIGTERM (a drain exits 0)")
        fault.detail["back_after_s"] = round(time.monotonic() - sent + slot.start(), 2)

    def _mend(self, slot: Slot, host: Host, down_s: float) -> None:
        time.sleep(down_s)
        host.mend()
        with slot.lock:
            slot.up = True


def _detail(detail: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in detail.items())


def schedule_for(rng: random.Random, kinds: list[str], n: int) -> list[tuple[float, str]]:
    """``n`` faults at random points in the first 60% of an epoch (shares of its samples
    delivered); every kind once before any twice."""
    picked: list[str] = []
    while len(picked) < n:
        picked += rng.sample(kinds, len(kinds))
    picked = picked[:n]
    rng.shuffle(picked)
    points = sorted(rng.uniform(0.05, 0.6) for _ in range(n))
    return list(zip(points, picked, strict=True))


# ---------------------------------------------------------------- training


@dataclass
class EpochResult:
    epoch: int
    seconds: float
    batches: int
    samples: int
    flips: int
    lost: int
    duplicated: int
    out_of_order: int
    stale: int
    corrupt: int
    errors: list[str]
    waits: list[tuple[float, float]]  # (when next() was called, since the run start; wait)
    held_s: float = 0.0  # waited for the epoch's faults (left out of ``seconds``)


def corrupt_images(batch: Any, side: int) -> int:
    """Images whose pixels or labels are not their samples' (a simulated sample is a flat
    image of value ``index % 256`` with label ``1 + index % 80``; flips leave it as it is)."""
    bad = 0
    images = batch.images.cpu()
    for image, target, group in zip(images, batch.targets, batch.indices, strict=True):
        labels = sorted(int(x) for x in target["labels"].cpu())
        if labels != sorted(1 + i % 80 for i in group):
            bad += 1
            continue
        if batch.mode == "regular":
            cells = [(image, group[0])]
        else:  # spatial stitch, k=4: a 2x2 grid of half-size cells in row order
            h = side // 2
            cells = [
                (image[:, (j // 2) * h : (j // 2 + 1) * h, (j % 2) * h : (j % 2 + 1) * h], i)
                for j, i in enumerate(group)
            ]
        if any(bool((cell != i % 256).any()) for cell, i in cells):
            bad += 1
    return bad


@dataclass
class Steering:
    """What the trainer has asked for so far: every batch must honour it."""

    mode: str = "regular"
    seq: int = 0  # feedback/set_mode calls: the client's batch.feedback_seq


def train_epoch(
    client: DataServerClient,
    epoch: int,
    cfg: ChaosConfig,
    rng: random.Random,
    steer: Steering,
    t0: float,
    injector: Injector | None = None,
) -> EpochResult:
    """One epoch with a sleep for a step and mode flips at random steps, checked. With an
    ``injector``: tells it how far the epoch is, and past ``HOLD_AT`` waits (once) for it
    to have injected every fault of the epoch."""
    client.set_epoch(epoch)
    shard = shard_of(epoch_order(client.dataset_len, cfg.seed, epoch, True), 0, 1, False)
    delivered: list[int] = []
    waits: list[tuple[float, float]] = []
    errors: list[str] = []
    flips = stale = corrupt = batches = 0
    held, holding = 0.0, injector is not None
    start = time.monotonic()
    it = iter(client)
    while True:
        if injector is not None:
            share = len(delivered) / max(1, len(shard))
            injector.reached(share)
            if holding and share >= HOLD_AT:
                held, holding = injector.hold(), False
        asked = time.monotonic()
        try:
            batch = next(it)
        except StopIteration:
            break
        except DataServerError as exc:
            errors.append(str(exc))
            if len(errors) > 20:
                break
            continue
        waits.append((asked - t0, time.monotonic() - asked))
        batches += 1
        delivered.extend(i for group in batch.indices for i in group)
        if batch.mode != steer.mode or batch.feedback_seq != steer.seq:
            stale += 1
        corrupt += corrupt_images(batch, cfg.image_side)
        time.sleep(cfg.step_ms / 1000)
        if rng.random() < cfg.flip_prob:
            steer.mode = "stitch" if steer.mode == "regular" else "regular"
            if rng.random() < 0.5:
                client.set_mode(steer.mode)
            else:  # Stitcher's rule: a small-object share under the threshold stitches
                ratio = 0.02 if steer.mode == "stitch" else 0.5
                if client.feedback(ratio) != steer.mode:
                    stale += 1
            steer.seq += 1
            flips += 1
    seconds = time.monotonic() - start - held
    want, got = Counter(int(i) for i in shard), Counter(delivered)
    lost = sum(max(0, n - got[i]) for i, n in want.items())
    duplicated = sum(max(0, n - want[i]) for i, n in got.items())
    out_of_order = 0 if delivered == [int(i) for i in shard] else 1
    return EpochResult(
        epoch,
        seconds,
        batches,
        len(delivered),
        flips,
        lost,
        duplicated,
        out_of_order,
        stale,
        corrupt,
        errors,
        waits,
        round(held, 3),
    )


def attribute_stalls(
    faults: list[Fault], waits: list[tuple[float, float]], base: float, window: float
) -> None:
    """Each fault's stall: the excess wait of the batches asked for in its window."""
    ordered = sorted(faults, key=lambda f: f.t)
    for n, fault in enumerate(ordered):
        end = fault.t + window
        if n + 1 < len(ordered):
            end = min(end, ordered[n + 1].t)
        fault.stall_s = round(sum(max(0.0, w - base) for t, w in waits if fault.t <= t < end), 3)


# ---------------------------------------------------------------- the run


def run_chaos(cfg: ChaosConfig) -> dict[str, Any]:
    """Run the whole chaos run; a JSON-able report (``ok`` says whether it passed)."""
    say = (lambda s: None) if cfg.quiet else (lambda s: print(s, flush=True))
    rng = random.Random(cfg.seed)
    host, no_netns = make_host(cfg)
    slots = [Slot(f"s{n}", cfg, host if n == 0 else None) for n in range(cfg.servers)]
    kinds = [k for k in KINDS if k != LINK_FLAP or host is not None]
    client: DataServerClient | None = None
    t0 = time.monotonic()
    try:
        starting = [threading.Thread(target=slot.start) for slot in slots]
        for thread in starting:
            thread.start()
        for thread in starting:
            thread.join()
        if not all(slot.up for slot in slots):
            raise RuntimeError("a server did not start")
        say(
            f"chaos: {cfg.servers} servers x {cfg.workers} workers"
            f" ({'s0 in a network namespace' if host else 'no network namespace'}),"
            f" {cfg.samples} samples x {cfg.sample_ms:g} ms, batch {cfg.batch_size},"
            f" step {cfg.step_ms:g} ms, flip p={cfg.flip_prob:g}, seed {cfg.seed}"
        )
        if host is None:
            say(f"link flaps: SKIPPED ({no_netns})")
        client = make_client(
            [s.address for s in slots],
            batch_size=cfg.batch_size,
            image_size=(cfg.image_side, cfg.image_side),
            seed=cfg.seed,
            rank=0,
            world_size=1,
            timeout=cfg.timeout,
        )
        steer = Steering()
        if (
            cfg.cache_gb > 0 and cfg.warmup
        ):  # fill the stores first, or the baseline is the one cold epoch
            warm = train_epoch(client, BASELINE_EPOCH + 1, cfg, rng, steer, t0)
            say(f"warm-up (fills the stores, not counted): {warm.seconds:.2f} s")
        base = train_epoch(client, BASELINE_EPOCH, cfg, rng, steer, t0)
        base_wait = statistics.median(w for _, w in base.waits)
        say(
            f"baseline (no faults): {base.seconds:.2f} s, {base.batches} batches,"
            f" median wait in next() {base_wait * 1000:.1f} ms,"
            f" lost {base.lost}, duplicated {base.duplicated}"
        )
        injector = Injector(slots, rng, cfg, t0, say)
        epochs: list[dict[str, Any]] = []
        for epoch in range(cfg.epochs):
            schedule = schedule_for(rng, kinds, cfg.faults_per_epoch)
            say(f"epoch {epoch}:")
            injector.run_epoch(epoch, schedule, time.monotonic())
            res = train_epoch(client, epoch, cfg, rng, steer, t0, injector)
            injector.end_epoch()
            faults = [f for f in injector.faults if f.epoch == epoch]
            attribute_stalls(faults, res.waits, base_wait, cfg.stall_window)
            lost_s = res.seconds - base.seconds
            say(
                f"  epoch {epoch}: {res.seconds:.2f} s (time lost {lost_s:+.2f} s;"
                f" {res.held_s:.2f} s held for its faults, left out),"
                f" {res.batches} batches, {res.flips} mode flips, {len(faults)} faults"
                f" (stalls {sum(f.stall_s for f in faults):.2f} s);"
                f" lost {res.lost}, duplicated {res.duplicated},"
                f" out of order {res.out_of_order}, stale {res.stale}, corrupt {res.corrupt},"
                f" errors {len(res.errors)}"
            )
            for err in res.errors[:5]:
                say(f"    error: {err}")
            row = {k: v for k, v in asdict(res).items() if k != "waits"}
            row["time_lost_s"] = round(lost_s, 3)
            epochs.append(row)
        stats = client.stats()
    finally:
        if client is not None:
            client.close()
        for slot in slots:
            slot.stop_all()
        if host is not None:
            host.close()

    faults = injector.faults
    by_kind = Counter(f.kind for f in faults)
    total = {
        k: sum(e[k] for e in epochs)
        for k in ("lost", "duplicated", "out_of_order", "stale", "corrupt", "flips", "samples")
    }
    errors = [e for row in epochs for e in row["errors"]] + injector.errors
    time_lost = sum(e["time_lost_s"] for e in epochs)
    stalls = sum(f.stall_s for f in faults)
    ok = not errors and all(
        total[k] == 0 for k in ("lost", "duplicated", "out_of_order", "stale", "corrupt")
    )
    say("faults injected:")
    for f in faults:
        say(
            f"  t={f.t:7.2f} s  epoch {f.epoch} +{f.t_epoch:6.2f} s  {f.kind:<11} {f.slot}"
            f"  stall {f.stall_s:.2f} s  {_detail(f.detail)}"
        )
    for kind, epoch, why in injector.skipped:
        say(f"  not injected: {kind} in epoch {epoch} ({why})")
    for err in injector.errors:
        say(f"  injector error: {err}")
    say(
        f"total: {cfg.epochs} epochs, {total['samples']} samples, {len(faults)} faults ("
        + ", ".join(f"{by_kind[k]} {k}" for k in KINDS)
        + f"), {total['flips']} mode flips;"
        f" lost {total['lost']}, duplicated {total['duplicated']},"
        f" out of order {total['out_of_order']}, stale {total['stale']},"
        f" corrupt {total['corrupt']}, errors {len(errors)};"
        f" time lost {time_lost:+.2f} s over {sum(e['seconds'] for e in epochs):.1f} s"
        f" (baseline {cfg.epochs} x {base.seconds:.2f} s), fault stalls {stalls:.2f} s"
    )
    say(
        "client: "
        + ", ".join(
            f"{k} {stats.get(k, 0)}"
            for k in ("servers_drained", "servers_left", "reissued", "late", "cancelled")
        )
        + f"; flips {dict(stats.get('flips', {}))}"
    )
    say("PASS" if ok else "FAIL")
    return {
        "ok": ok,
        "config": asdict(cfg),
        "link_flaps": "on" if host is not None else f"skipped: {no_netns}",
        "baseline": {"seconds": round(base.seconds, 3), "median_wait_s": round(base_wait, 4)},
        "epochs": epochs,
        "faults": [asdict(f) for f in faults],
        "not_injected": [list(s) for s in injector.skipped],
        "injector_errors": injector.errors,
        "total": {
            **total,
            "faults": len(faults),
            "faults_by_kind": dict(by_kind),
            "time_lost_s": round(time_lost, 3),
            "stalls_s": round(stalls, 3),
            "errors": len(errors),
        },
        "client_stats": {
            **{k: v for k, v in stats.items() if isinstance(v, int | float)},
            "flips": dict(stats.get("flips", {})),
        },
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--servers", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--faults-per-epoch", type=int, default=5)
    p.add_argument("--samples", type=int, default=3000)
    p.add_argument("--sample-ms", type=float, default=20.0)
    p.add_argument("--step-ms", type=float, default=20.0)
    p.add_argument(
        "--cache-gb",
        type=float,
        default=0.0,
        help="each server's store (default 0: every sample costs its time every epoch; "
        "> 0: flips are served by the lookahead, and a warm-up epoch fills the stores)",
    )
    p.add_argument("--no-netns", action="store_true", help="no server behind a veth pair")
    p.add_argument("--json", default=None, metavar="OUT", help="write the report here")
    args = p.parse_args(argv)
    if args.servers < 2:
        p.error(
            "--servers must be at least 2 (a fault takes a server out only while another is up)"
        )
    cfg = ChaosConfig(
        epochs=args.epochs,
        servers=args.servers,
        seed=args.seed,
        faults_per_epoch=args.faults_per_epoch,
        samples=args.samples,
        sample_ms=args.sample_ms,
        step_ms=args.step_ms,
        cache_gb=args.cache_gb,
        netns=not args.no_netns,
    )
    report = run_chaos(cfg)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
