"""The figures of ``dataserver bench``: each a ratio of two measurements taken in the same
run, alternating the sides and keeping each side's median (the machines these run on are
shared and noisy). Absolute rates and CPU costs are reported too, for context.

Just over the house's ~500 lines: one function per figure of ``dataserver bench``."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

from dataserver.admin import fetch_stats
from dataserver.bench.augment import fig_augment
from dataserver.bench.common import (
    Progress,
    _per_image_ms,
    med,
    rounds,
    run_side,
    served,
    server,
)
from dataserver.bench.index import fig_index
from dataserver.bench.multiscale import fig_multiscale
from dataserver.bench.peers import fig_dataloader
from dataserver.bench.remote import fig_remote
from dataserver.bench.rfdetr import fig_rfdetr
from dataserver.bench.slowserver import fig_slow_server
from dataserver.bench.transformers import fig_transformers
from dataserver.bench.ultralytics import fig_ultralytics
from dataserver.demo import start_server, stop_server


def fig_overhead(args: argparse.Namespace, spec: str, progress: Progress) -> dict[str, Any]:
    """The service's own CPU per sample, with samples that cost nothing to make (32 x 32,
    0 ms): client, front and workers, beside DataLoader's main process and workers on the
    same samples and pipeline."""
    zero = "dataserver.data.simulated:simulated"
    dataset_args = json.dumps({"n": 4096, "ms": 0, "size": 32})
    opts = {"image_size": 32, "batch_size": 64, "batches": max(args.batches, 100)}
    flags = ["--dataset", zero, "--dataset-args", dataset_args, "--workers", str(args.workers)]
    with server(flags) as (address, pids):
        runs = rounds(
            args,
            progress,
            {
                "dataserver": lambda: served(args, address, pids, **opts),
                "dataloader": lambda: run_side(
                    "dataloader", args, spec=zero, spec_args=dataset_args, **opts
                ),
            },
        )

    def us(values: list[float], run: dict[str, Any]) -> float:
        return 1e6 * sum(values) / run["images"]

    ds, dl = runs["dataserver"], runs["dataloader"]
    client = med([us([r["cpu_self_s"]], r) for r in ds])
    front = med([us(r["cpu_others_s"][:1], r) for r in ds])
    workers = med([us(r["cpu_others_s"][1:], r) for r in ds])
    return {
        "dataserver_us_per_sample": round(
            med([us([r["cpu_self_s"], *r["cpu_others_s"]], r) for r in ds]), 1
        ),
        "client_us_per_sample": round(client, 1),
        "front_us_per_sample": round(front, 1),
        "workers_us_per_sample": round(workers, 1),
        "dataloader_us_per_sample": round(
            med([us([r["cpu_self_s"], *r["cpu_others_s"]], r) for r in dl]), 1
        ),
        "dataloader_main_us_per_sample": round(med([us([r["cpu_self_s"]], r) for r in dl]), 1),
        "dataserver_samples_per_s": round(med([r["images_per_s"] for r in ds]), 1),
        "dataloader_samples_per_s": round(med([r["images_per_s"] for r in dl]), 1),
    }


def fig_cache(args: argparse.Namespace, spec: str, progress: Progress) -> dict[str, Any]:
    """Epoch 2 onward with the server's store of prepared sources (one epoch untimed fills
    it) vs DataLoader, which decodes every epoch."""
    flags = ["--dataset", spec, "--workers", str(args.workers), "--cache-gb", "2"]
    with server(flags) as (address, pids):
        runs = rounds(
            args,
            progress,
            {
                "dataserver_cached": lambda: served(args, address, pids, warm_epochs=1),
                "dataloader": lambda: run_side("dataloader", args, spec=spec),
            },
        )
        stats = fetch_stats(address, 10)
    ds = med([r["images_per_s"] for r in runs["dataserver_cached"]])
    dl = med([r["images_per_s"] for r in runs["dataloader"]])
    store = stats.get("store") or {}
    counters = stats.get("counters", {})
    reused = counters.get("sources_reused", 0)
    # every source use after the server's first epoch (round 1's untimed one): a hit or a miss
    later = reused + counters.get("sources_decoded", 0) - args.images
    put, hit = store_costs(args.image_size)
    larger = larger_than_store(args, spec, progress)
    return {
        **larger,
        "store_first_lap_put_us_per_source": put,
        "store_hit_us_per_source": hit,
        "cached_images_per_s": round(ds, 1),
        "dataloader_images_per_s": round(dl, 1),
        "cached_vs_dataloader": round(ds / dl, 3),
        "store_hit_rate": store.get("hit_rate"),  # (over the server's life, epoch 1 too)
        "store_hit_rate_after_epoch_1": round(reused / later, 3) if later > 0 else None,
        "store_bytes": store.get("bytes"),
        "cpu_ms_per_image_cached": round(
            med([_per_image_ms(r) for r in runs["dataserver_cached"]]), 2
        ),
    }


def synth_bytes(images: int, side: int) -> int:
    """Bytes of a synth set's sources fitted to ``side`` (its images are 4:3)."""
    return images * 3 * side * (side * 3 // 4)


def quarter_store_gb(images: int, side: int) -> str:
    """``--cache-gb`` for a store of a quarter of a synth set's sources at ``side``, as the
    flag takes it."""
    return f"{synth_bytes(images, side) / 4 / (1 << 30):.4f}"


def larger_than_store(args: argparse.Namespace, spec: str, progress: Progress) -> dict[str, Any]:
    """A dataset 4x the store's bytes (sources at the stored size): epoch 2 onward with a
    store of a quarter of them against ``--cache-gb 0``, on one server each, rounds
    alternating; the store's hit rate after its first epoch (docs/contract.md: >= 0.97 of no store,
    hit rate >= 0.9 x store/dataset bytes)."""
    side = args.image_size
    dataset_bytes = synth_bytes(args.images, side)
    base = ["--dataset", spec, "--workers", str(args.workers)]
    with (
        server([*base, "--cache-gb", quarter_store_gb(args.images, side)]) as (small, small_pids),
        server([*base, "--cache-gb", "0"]) as (plain, plain_pids),
    ):
        runs = rounds(
            args,
            progress,
            {
                "quarter_store": lambda: served(args, small, small_pids, warm_epochs=1),
                "no_store": lambda: served(args, plain, plain_pids, warm_epochs=1),
            },
        )
        stats = fetch_stats(small, 10)
    store = stats.get("store") or {}
    counters = stats.get("counters", {})
    reused = counters.get("sources_reused", 0)
    # The server's first epoch (round 1's untimed one) decodes every source; every source
    # use after it is a hit or a miss of a later epoch.
    later = reused + counters.get("sources_decoded", 0) - args.images
    small_rate = med([r["images_per_s"] for r in runs["quarter_store"]])
    plain_rate = med([r["images_per_s"] for r in runs["no_store"]])
    return {
        "quarter_store_images_per_s": round(small_rate, 1),
        "quarter_store_vs_no_store": round(small_rate / plain_rate, 3),
        "quarter_store_hit_rate_after_epoch_1": round(reused / later, 3) if later > 0 else None,
        # store bytes over the dataset's, its sources at the size the store measured
        "quarter_store_bytes_ratio": round(
            store.get("capacity_bytes", 0)
            / max(1, store.get("mean_entry_bytes", 0) * args.images or dataset_bytes),
            3,
        ),
        "quarter_store_admitted": store.get("admitted"),
    }


def store_costs(side: int, n: int = 400) -> tuple[float, float]:
    """Microseconds of CPU for a worker to put one source into a new store (its memory
    committed up front, as the front does, and mapped whole by the worker's handle) and to
    find it there again, one process, a letterboxed 4:3 source of the bench's size (512x384
    for 512): means over ``n``."""
    import numpy as np

    from dataserver.data.pipeline import Source
    from dataserver.server.store import Store

    image = np.random.default_rng(0).integers(0, 255, (3, side * 3 // 4, side), np.uint8)
    source = Source(image, np.zeros((3, 4), np.float32), np.zeros(3, np.int64))
    front = Store.create(max(64 << 20, 2 * n * image.nbytes))
    store = Store.attach(*front.fds, front.capacity, populate=True)
    try:
        start = time.thread_time()
        for i in range(n):
            store.get((i, 1), lambda: source)
        put = time.thread_time() - start
        start = time.thread_time()
        for i in range(n):
            found, _ = store.get((i, 1), lambda: source)
        hit = time.thread_time() - start
        assert found.image.shape == image.shape
    finally:
        store.close()
        front.close()
    return round(1e6 * put / n, 1), round(1e6 * hit / n, 1)


def fig_close_mosaic(args: argparse.Namespace, spec: str, progress: Progress) -> dict[str, Any]:
    """A trainer that steers the mode once (mosaic for the warm-up epoch, then close-mosaic:
    ``set_mode("regular")``) against one that never steered, in the epochs after, on one
    server with a warm store, interleaved rounds: images/s and the images the server
    composed per image delivered (1.0: no lookahead twins)."""
    flags = ["--dataset", spec, "--workers", str(args.workers), "--cache-gb", "2"]
    client = json.dumps({"stitch_layout": "mosaic", "stitch_k": 4})
    with server(flags) as (address, pids):
        runs = rounds(
            args,
            progress,
            {
                "steered_once": lambda: served(
                    args, address, pids, warm_epochs=1, steer="close", client_args=client
                ),
                "never_steered": lambda: served(
                    args, address, pids, warm_epochs=1, steer="count", client_args=client
                ),
            },
        )
    once = med([r["images_per_s"] for r in runs["steered_once"]])
    never = med([r["images_per_s"] for r in runs["never_steered"]])
    return {
        "steered_once_images_per_s": round(once, 1),
        "never_steered_images_per_s": round(never, 1),
        "steered_once_vs_never": round(once / never, 3),
        "composed_per_delivered_steered_once": round(
            med([r["composed_per_delivered"] for r in runs["steered_once"]]), 3
        ),
        "composed_per_delivered_never_steered": round(
            med([r["composed_per_delivered"] for r in runs["never_steered"]]), 3
        ),
    }


def fig_feedback(args: argparse.Namespace, spec: str, progress: Progress) -> dict[str, Any]:
    """samples/s with the mode flipping on ~20% of steps vs one constant mode, same server,
    and the source decodes the flips cost (decoded by the server minus samples delivered):
    without a store (the lookahead off) and with a store of a quarter of the dataset (the
    lookahead on, its twins kept by the store whatever subset it admits: ``quarter_store``)."""
    out = _feedback_on(args, spec, progress, "0")
    quarter = _feedback_on(args, spec, progress, quarter_store_gb(args.images, args.image_size))
    del quarter["note"]
    return {**out, "quarter_store": quarter}


def _feedback_on(
    args: argparse.Namespace, spec: str, progress: Progress, cache_gb: str
) -> dict[str, Any]:
    """``fig_feedback`` on one server with ``--cache-gb cache_gb``."""
    with server(["--dataset", spec, "--workers", str(args.workers), "--cache-gb", cache_gb]) as (
        address,
        _,
    ):
        runs: dict[str, list[dict[str, Any]]] = {"flips": [], "regular": [], "stitch": []}
        for r in range(args.rounds):
            for name, flip, mode in (
                ("flips", 0.2, "regular"),
                ("regular", 0.0, "regular"),
                ("stitch", 0.0, "stitch"),
            ):
                before = fetch_stats(address, 10)["counters"].get("sources_decoded", 0)
                out = run_side("feedback", args, address=address, flip_rate=flip, mode=mode, seed=r)
                out["decoded"] = (
                    fetch_stats(address, 10)["counters"].get("sources_decoded", 0) - before
                )
                runs[name].append(out)
                progress(
                    f"round {r + 1}/{args.rounds}, --cache-gb {cache_gb}: {name} "
                    f"{out['samples_per_s']:,.0f} samples/s"
                )

    # What the same batches would cost at each mode's constant-mode speed: the ratio
    # isolates the price of switching from the (large) difference between the modes.
    regular_bps = med([o["regular_batches"] / o["elapsed"] for o in runs["regular"]])
    stitch_bps = med([o["stitch_batches"] / o["elapsed"] for o in runs["stitch"]])
    vs_mix = [
        (o["regular_batches"] / regular_bps + o["stitch_batches"] / stitch_bps) / o["elapsed"]
        for o in runs["flips"]
    ]
    extra = [o["decoded"] / max(1, o["total_samples"]) - 1 for o in runs["flips"]]
    per_flip = [
        (o["decoded"] - o["total_samples"]) / max(1, o["total_flips"]) for o in runs["flips"]
    ]
    return {
        "flips_vs_constant_modes": round(med(vs_mix), 3),
        "flips_samples_per_s": round(med([o["samples_per_s"] for o in runs["flips"]]), 1),
        "regular_samples_per_s": round(med([o["samples_per_s"] for o in runs["regular"]]), 1),
        "stitch_samples_per_s": round(med([o["samples_per_s"] for o in runs["stitch"]]), 1),
        "flip_rate": round(med([o["flips"] / args.batches for o in runs["flips"]]), 3),
        "stitched_share": round(
            med([o["stitch_batches"] / args.batches for o in runs["flips"]]), 3
        ),
        "extra_decodes_per_sample_with_flips": round(med(extra), 3),
        "extra_decodes_per_flip": round(med(per_flip), 1),
        "note": "flips_vs_constant_modes = (time the flip run's batches take at constant-mode "
        "speed) / (time they took); samples/s counts dataset samples (a stitched image holds k); "
        "extra decodes count sources decoded beyond those delivered (the store keeps the rest)",
    }


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1)


def fig_flip_stall(args: argparse.Namespace, spec: str, progress: Progress) -> dict[str, Any]:
    """The wait in ``next()`` right after a mode flip vs after no flip, for a trainer whose
    step leaves the CPU free (150 ms, and 60 ms where the pool cannot keep up in stitch mode),
    flipping on ~20% of steps, over whole epochs of a fresh server (so its decode count
    compares with the samples delivered); with the client's lookahead on (the default) and
    off (every flip replans from nothing)."""
    import tempfile

    from dataserver.data.coco import write_synthetic_coco

    with tempfile.TemporaryDirectory(prefix="ds-flips-") as tmp:
        n = args.flip_images
        progress(f"writing {n} synthetic JPEGs (whole epochs of them are timed)")
        ann = write_synthetic_coco(tmp, n, seed=1)
        flip_spec = f"coco:{ann}"
        # (step ms, lookahead, the store a quarter of the set: it admits a subset)
        cases = [(ms, la, False) for ms in (150, 60) for la in (True, False)]
        cases.append((150, True, True))
        runs: dict[tuple[int, bool, bool], list[dict[str, Any]]] = {c: [] for c in cases}
        for r in range(args.rounds):
            for step_ms, lookahead, quarter in cases:
                flags = ["--dataset", flip_spec, "--workers", str(args.workers)]
                if quarter:
                    flags += ["--cache-gb", quarter_store_gb(n, args.image_size)]
                with server(flags) as (address, _):
                    out = run_side(
                        "flip_stall",
                        args,
                        address=address,
                        step_ms=step_ms,
                        flip_rate=0.2,
                        seed=r,
                        client_args=json.dumps({"stitch_k": 4, "lookahead": lookahead}),
                    )
                    time.sleep(0.3)  # the workers' last DONE counts land
                    decoded = fetch_stats(address, 10)["counters"].get("sources_decoded", 0)
                out["extra_decodes"] = decoded - out["samples"]
                runs[(step_ms, lookahead, quarter)].append(out)
                after = out["waits_ms"]["flip"]
                progress(
                    f"round {r + 1}/{args.rounds}: step {step_ms} ms, lookahead "
                    f"{'on' if lookahead else 'off'}{', quarter store' if quarter else ''}: "
                    f"{out['flips']} flips, median wait after "
                    f"a flip {_quantile(after, 0.5)} ms, extra decodes {out['extra_decodes']}"
                )
    result: dict[str, Any] = {}
    for (step_ms, lookahead, quarter), outs in runs.items():
        flip = [w for o in outs for w in o["waits_ms"]["flip"]]
        calm = [w for o in outs for w in o["waits_ms"]["no_flip"]]
        flips = sum(o["flips"] for o in outs)
        extra = sum(o["extra_decodes"] for o in outs)
        samples = sum(o["samples"] for o in outs)
        m_flip, m_calm = _quantile(flip, 0.5), _quantile(calm, 0.5)
        key = f"step_{step_ms}ms_lookahead_{'on' if lookahead else 'off'}"
        key += "_quarter_store" if quarter else ""
        result[key] = {
            "stall_ms": round(m_flip - m_calm, 1) if m_flip is not None and m_calm else None,
            "wait_after_flip_ms": {"median": m_flip, "p90": _quantile(flip, 0.9)},
            "wait_after_no_flip_ms": {"median": m_calm, "p90": _quantile(calm, 0.9)},
            "flips": flips,
            "flips_ready_when_asked": sum(o["flips_promoted_ready"] for o in outs),
            "extra_decodes_per_flip": round(extra / max(1, flips), 2),
            "extra_decodes_share": round(extra / max(1, samples), 4),
        }
    result["note"] = (
        "stall_ms = median wait in next() after a flip minus after no flip (target <= 5 ms at "
        "150 ms); extra decodes = sources the server decoded beyond the epoch's samples; "
        "_quarter_store: the server's store holds a quarter of the set (it admits a subset)"
    )
    return result


def fig_first_batch(args: argparse.Namespace, spec: str, progress: Progress) -> dict[str, Any]:
    """Time from a new client to its first batch, against a running, idle server."""
    with server(["--dataset", spec, "--workers", str(args.workers)]) as (address, _):
        runs = []
        for r in range(5):
            runs.append(run_side("first_batch", args, address=address))
            progress(f"run {r + 1}/5: {runs[-1]['first_batch_ms']:.0f} ms")
    return {
        "first_batch_ms": round(med([r["first_batch_ms"] for r in runs]), 1),
        "handshake_ms": round(med([r["handshake_ms"] for r in runs]), 1),
        "runs_ms": [round(r["first_batch_ms"], 1) for r in runs],
    }


def fig_coordination(args: argparse.Namespace, spec: str, progress: Progress) -> dict[str, Any]:
    """4 servers x 8 workers, samples that take 10 ms each (sleeping, not computing): the
    samples/s one client gets vs the ideal 32 x 100 = 3,200/s."""
    servers, workers, ms = 4, 8, 10.0
    dataset_args = json.dumps({"n": 8192, "ms": ms, "size": 32})
    flags = [
        "--dataset",
        "dataserver.data.simulated:simulated",
        "--dataset-args",
        dataset_args,
        "--workers",
        str(workers),
        "--cache-gb",
        "0",
    ]
    started = []
    try:
        for n in range(servers):
            started.append(start_server(flags, timeout=120))
            progress(f"server {n + 1}/{servers} up")
        addresses = ",".join(address for _, address in started)
        # Prefetch 4: with 32 workers and batches of 64, two batches in flight would leave
        # two samples per task (a message per 20 ms of work, each way, per worker).
        opts = {"batch_size": 64, "image_size": 32, "client_args": json.dumps({"prefetch": 4})}
        coord = argparse.Namespace(**vars(args))
        runs = rounds(
            coord,
            progress,
            {"dataserver": lambda: run_side("dataserver", coord, address=addresses, **opts)},
        )
    finally:
        for proc, _ in started:
            stop_server(proc)
    ideal = servers * workers * 1000.0 / ms
    rate = med([r["images_per_s"] for r in runs["dataserver"]])
    return {
        "samples_per_s": round(rate, 1),
        "ideal_samples_per_s": ideal,
        "vs_ideal": round(rate / ideal, 3),
        "rounds": [round(r["images_per_s"], 1) for r in runs["dataserver"]],
    }


def fig_scale(args: argparse.Namespace, spec: str, progress: Progress) -> dict[str, Any]:
    """What bounds a large job: ``dataserver/bench/scale.py`` (imported here, when run:
    its roles run as ``python -m dataserver.bench.scale``)."""
    from dataserver.bench import scale

    return scale.fig_scale(args, spec, progress)


def fig_transport(args: argparse.Namespace, spec: str, progress: Progress) -> dict[str, Any]:
    """Delivered GB/s of pre-decoded samples (no decode: pixels in memory, fitted at their
    own size) vs raw ZeroMQ PUSH/PULL of same-sized frames from as many processes, over the
    transport the client used (ipc: it runs on the server's host), and over TCP loopback."""
    nbytes = 3 * args.image_size * args.image_size
    dataset_args = json.dumps({"n": 32, "size": args.image_size})
    flags = [
        "--dataset",
        "dataserver.data.simulated:predecoded",
        "--dataset-args",
        dataset_args,
        "--workers",
        str(args.workers),
    ]
    with server(flags) as (address, pids):
        runs = rounds(
            args,
            progress,
            {
                "dataserver": lambda: served(args, address, pids),
                "rawzmq_ipc": lambda: run_side("rawzmq", args, transport="ipc"),
                "rawzmq_tcp": lambda: run_side("rawzmq", args, transport="tcp"),
            },
        )
    o = med([r["images_per_s"] * nbytes for r in runs["dataserver"]])
    ipc = med([r["images_per_s"] * nbytes for r in runs["rawzmq_ipc"]])
    tcp = med([r["images_per_s"] * nbytes for r in runs["rawzmq_tcp"]])
    return {
        "dataserver_gb_per_s": round(o / 1e9, 3),
        "raw_zmq_gb_per_s": round(ipc / 1e9, 3),
        "vs_raw_zmq": round(o / ipc, 3),
        "raw_zmq_tcp_gb_per_s": round(tcp / 1e9, 3),
        "vs_raw_zmq_tcp": round(o / tcp, 3),
    }


FIGURES: dict[str, Callable[[argparse.Namespace, str, Progress], dict[str, Any]]] = {
    "dataloader": fig_dataloader,
    "overhead": fig_overhead,
    "cache": fig_cache,
    "feedback": fig_feedback,
    "close_mosaic": fig_close_mosaic,
    "flip_stall": fig_flip_stall,
    "first_batch": fig_first_batch,
    "coordination": fig_coordination,
    "transport": fig_transport,
    "multiscale": fig_multiscale,
    "augment": fig_augment,
    "scale": fig_scale,
    "ultralytics": fig_ultralytics,
    "remote": fig_remote,
    "slow_server": fig_slow_server,
    "index": fig_index,
    "transformers": fig_transformers,
    "rfdetr": fig_rfdetr,
}
# Run only when named (``--only``): 4 servers x 8 workers on one small host measure the
# processes fighting over its cores, not the design; ``scale`` measures what bounds a job;
# ``slow_server`` (minutes of slow servers on purpose) measures a fault, not a rate.
OPT_IN = frozenset(
    {"coordination", "ultralytics", "remote", "slow_server", "index", "transformers", "rfdetr"}
)
