"""``dataserver bench --only remote``: the bench's set served from an object store, as loose
objects (``coco:s3://...``) and as tar shards (``wds:s3://...``), behind added latency,
side by side with the same images on local disk.

The store is moto's S3 app under waitress, with a proxy adding ``REMOTE_DELAY_MS`` to what
it sends back (``objstore.py``): a real S3 API and real latency on loopback, not a cloud's
throughput. Every server runs without the store of decoded sources (``--cache-gb 0``), so
each epoch reads every image: epoch 1 from the store, epoch 2 from the fetch cache
(``--fetch-cache-gb``, in memory) that epoch 1 filled. Each side is a fresh server and a
fresh client process (``side.py``'s ``epochs``), alternating, ``--rounds`` times, medians.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dataserver.bench.common import Progress, med, rounds, run_side, server

REMOTE_DELAY_MS = 30.0


def _shard_mb(ann: str, shards: int = 8) -> float:
    """A shard size that cuts the bench's set into about ``shards`` shards (the issue's
    ~100 MB shards would hold the whole small set in one)."""
    folder = Path(ann).parent
    total = sum(p.stat().st_size for p in folder.glob("*.jpg"))
    return max(0.01, total / shards / (1 << 20))


def _fetches(address: str) -> int:
    """The server's ``fetches`` once workers have told it all (TALLY: once a second)."""
    from dataserver.admin import fetch_stats

    last = -1
    for _ in range(30):
        now = int(fetch_stats(address, 10)["counters"].get("fetches", 0))
        if now == last:
            return now
        last = now
        time.sleep(1.2)
    return last


def epochs_side(args: argparse.Namespace) -> dict[str, Any]:
    """A fresh client's two whole epochs against a fresh server: the time from building
    the client to its first batch, each epoch's images/s, and the GETs each epoch cost."""
    import dataserver_client  # noqa: F401  (imported before the clock starts)
    from dataserver_client import DataServerClient

    start = time.perf_counter()
    size = (args.image_size, args.image_size)
    out: dict[str, Any] = {}
    with DataServerClient(
        args.address, batch_size=args.batch_size, image_size=size, device="cpu"
    ) as client:
        before = 0
        for epoch in (1, 2):
            client.set_epoch(epoch - 1)
            began = time.perf_counter()
            images = 0
            for batch in client:
                if not images and epoch == 1:
                    out["first_batch_ms"] = 1000 * (time.perf_counter() - start)
                images += len(batch)
            out[f"epoch{epoch}_images_per_s"] = images / (time.perf_counter() - began)
            out["images"] = images
            fetched = _fetches(args.address)  # (untimed: between the epochs)
            out[f"epoch{epoch}_fetches"] = fetched - before
            before = fetched
    from dataserver.admin import fetch_stats

    ahead = fetch_stats(args.address, 10).get("prefetch") or {}
    for key in ("peak_bytes_in_flight", "max_bytes_in_flight", "peak_in_flight", "max_fetches"):
        out[key] = int(ahead.get(key, 0))
    return out


def fig_remote(args: argparse.Namespace, spec: str, progress: Progress) -> dict[str, Any]:
    try:
        from dataserver.bench.objstore import ObjectStore
    except ImportError as exc:  # (moto or waitress missing)
        return {"skipped": f"needs the test extra (moto[server], waitress): {exc}"}
    from dataserver.data.shards import build_index, expand, write_shards

    ann = spec[len("coco:") :]
    with tempfile.TemporaryDirectory(prefix="ds-bench-wds-") as tmp:
        paths = write_shards(ann, None, tmp, _shard_mb(ann))
        last = len(paths) - 1
        with ObjectStore(delay_ms=REMOTE_DELAY_MS) as store:
            loose = store.put_tree(Path(ann).parent, "coco")
            shards = store.put_tree(Path(tmp), "wds")
            specs = {
                "local": spec,
                "loose": f"coco:{loose}annotations.json:{loose}",
                "shards": f"wds:{shards}shard-{{000000..{last:06d}}}.tar",
            }
            saved = dict(os.environ)
            os.environ.update(store.env())  # (the servers' environment: never on the wire)
            try:
                names = sorted(p.name for p in Path(ann).parent.glob("*.jpg"))
                rate = _store_rate([(f"{loose}{n}", None, None) for n in names])
                index = build_index(expand(specs["shards"][len("wds:") :]))
                ranges = [
                    (index.shards[int(s)], int(o), int(n))
                    for s, o, n in zip(index.shard, index.offset, index.size, strict=True)
                ]
                range_rate = _store_rate(ranges)
                progress(
                    f"the store's own GET rate: {rate:,.0f}/s whole, {range_rate:,.0f}/s ranges"
                )
                sides = {k: _side(args, v) for k, v in specs.items()}
                sides["dataloader"] = _peer(args, "dataloader_s3", specs["loose"])
                if importlib.util.find_spec("webdataset") is not None:
                    sides["webdataset"] = _peer(args, "webdataset_s3", specs["shards"])
                runs = rounds(args, progress, sides)
            finally:
                os.environ.clear()
                os.environ.update(saved)
    out = _figures(runs, len(paths))
    out["store_gets_per_s"] = round(rate, 1)
    out["store_range_gets_per_s"] = round(range_rate, 1)
    for side, store_rate in (("loose", rate), ("shards", range_rate)):
        bound = min(store_rate, out["local_epoch1_images_per_s"])
        out[f"{side}_epoch1_vs_bound"] = round(out[f"{side}_epoch1_images_per_s"] / bound, 3)
    return out


def _store_rate(wanted: Sequence[tuple[str, int | None, int | None]], threads: int = 32) -> float:
    """GETs a second the store answers (behind its latency) to ``threads`` readers in
    this process (objects whole, or byte ranges): the bound on a first epoch when it is
    below local disk's rate."""
    from concurrent.futures import ThreadPoolExecutor

    from dataserver.data.remote import Fetcher, FetchSettings

    fetcher = Fetcher(FetchSettings(max_fetches=threads))
    began = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda w: fetcher.read(*w), wanted))
    return len(wanted) / (time.perf_counter() - began)


def _side(args: argparse.Namespace, spec: str) -> Any:
    flags = ["--dataset", spec, "--workers", str(args.workers), "--cache-gb", "0"]
    flags += ["--bind", "tcp://127.0.0.1:0"]

    def run() -> dict[str, Any]:
        with server(flags) as (address, _pids):
            return run_side("epochs", args, address=address)

    return run


def _peer(args: argparse.Namespace, side: str, spec: str) -> Any:
    def run() -> dict[str, Any]:
        return run_side(side, args, spec=spec)

    return run


def _figures(runs: dict[str, list[dict[str, Any]]], shards: int) -> dict[str, Any]:
    def m(side: str, key: str) -> float:
        return med([r[key] for r in runs[side]])

    out: dict[str, Any] = {
        "added_latency_ms": REMOTE_DELAY_MS,
        "loss": "none",
        "images": runs["local"][0]["images"],
        "shards": shards,
    }
    for side in ("local", "loose", "shards"):
        out[f"{side}_epoch1_images_per_s"] = round(m(side, "epoch1_images_per_s"), 1)
        out[f"{side}_epoch2_images_per_s"] = round(m(side, "epoch2_images_per_s"), 1)
        out[f"{side}_first_batch_ms"] = round(m(side, "first_batch_ms"), 1)
    for side in ("loose", "shards"):
        for e in (1, 2):
            key = f"epoch{e}_images_per_s"
            out[f"{side}_epoch{e}_vs_local"] = round(m(side, key) / m("local", key), 3)
            out[f"{side}_epoch{e}_requests"] = int(m(side, f"epoch{e}_fetches"))
    out["shards_index_requests"] = shards  # (the front reads each shard once, at start)
    for side in ("loose", "shards"):  # the front's fetcher: the most it had out, its bounds
        out[f"{side}_peak_fetches_in_flight"] = max(r["peak_in_flight"] for r in runs[side])
        out[f"{side}_peak_bytes_in_flight"] = max(r["peak_bytes_in_flight"] for r in runs[side])
    if runs.get("dataloader"):
        peer = m("dataloader", "epoch2_images_per_s")
        out["dataloader_obstore_images_per_s"] = round(peer, 1)
        out["dataloader_first_batch_ms"] = round(m("dataloader", "first_batch_ms"), 1)
        for side in ("loose", "shards"):
            out[f"{side}_epoch1_vs_dataloader"] = round(m(side, "epoch1_images_per_s") / peer, 3)
    if runs.get("webdataset"):  # (its steady rate: epoch 2, the workers started)
        peer = m("webdataset", "epoch2_images_per_s")
        out["webdataset_images_per_s"] = round(peer, 1)
        out["webdataset_first_batch_ms"] = round(m("webdataset", "first_batch_ms"), 1)
        out["shards_epoch1_vs_webdataset"] = round(m("shards", "epoch1_images_per_s") / peer, 3)
        out["shards_epoch2_vs_webdataset"] = round(m("shards", "epoch2_images_per_s") / peer, 3)
    out["max_fetches"] = runs["loose"][0]["max_fetches"]
    out["max_bytes_in_flight"] = runs["loose"][0]["max_bytes_in_flight"]
    out["not_measured"] = "a real cloud's throughput per prefix, GCS and Azure" + (
        "" if runs.get("webdataset") else ", WebDataset's own pipeline (not installed)"
    )
    return out


def dataloader_side(args: argparse.Namespace) -> dict[str, Any]:
    """The peer: a tuned DataLoader (``baselines.make_dataloader``: spawn, persistent
    workers, the same per-image work) whose Dataset fetches each batch's objects with
    obstore in a pool of threads of each worker's own (``__getitems__``: the objects of a
    batch requested together, 16 at once, ``remote.Fetcher.prefetch``) before decoding
    them; no cache, so every epoch fetches again. Epoch 2 is its steady rate (epoch 1 also
    starts the workers)."""
    import torch

    from dataserver.bench.baselines import make_dataloader

    size = (args.image_size, args.image_size)
    loader = make_dataloader(args.spec, size, args.batch_size, args.workers, args.spec_args)
    dataset = loader.dataset
    loader = torch.utils.data.DataLoader(
        _BatchFetched(dataset),  # type: ignore[arg-type]  # (a map-style Dataset, untyped)
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.workers,
        collate_fn=loader.collate_fn,
        worker_init_fn=loader.worker_init_fn,
        persistent_workers=True,
        multiprocessing_context="spawn",
        prefetch_factor=4,
    )
    return two_epochs(loader)


def two_epochs(loader: Any) -> dict[str, Any]:
    """A peer's two epochs through ``loader`` (batches of (images, [(boxes, labels)])): the
    images/s of each, the first batch's wait, the images an epoch."""
    from dataserver.bench.baselines import targets_of

    out: dict[str, Any] = {}
    start = time.perf_counter()
    for epoch in (1, 2):
        began = time.perf_counter()
        images = 0
        for batch, pairs in loader:
            targets_of(pairs)
            if not images and epoch == 1:
                out["first_batch_ms"] = 1000 * (time.perf_counter() - start)
            images += len(batch)
        out[f"epoch{epoch}_images_per_s"] = images / (time.perf_counter() - began)
        out["images"] = images
    return out


class _BatchFetched:
    """A map-style Dataset over ``inner`` (a ``PipelineDataset`` of a remote set) that
    fetches a batch's objects at once (``__getitems__``, which DataLoader calls with a
    batch's indices) before making its items one by one."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int) -> Any:
        return self.inner[index]

    def __getitems__(self, indices: list[int]) -> list[Any]:
        self.inner._ds().prefetch(list(indices))  # (GETs in a pool of this worker's)
        return [self.inner[i] for i in indices]
