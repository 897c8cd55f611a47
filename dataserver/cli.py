"""The ``dataserver`` command: serve, synth, index, demo, stats, bench, keygen.

Over the house's ~500 lines (about 620): the command's parser, its options with their help,
and one short function per subcommand; each subcommand's work lives in its own module.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any, NoReturn

import zmq

from dataserver import __version__
from dataserver.admin import fetch_stats
from dataserver.data.remote import (
    DEFAULT_FETCH_CACHE_GB,
    DEFAULT_MAX_FETCH_MB,
    DEFAULT_MAX_FETCHES,
)
from dataserver.data.spec import DEFAULT_SPEC, SpecError
from dataserver.protocol import ProtocolError
from dataserver.server.config import (
    DEFAULT_BIND,
    DEFAULT_CACHE_GB,
    DEFAULT_DRAIN_SECONDS,
    DEFAULT_HEARTBEAT_RATE,
    DEFAULT_IDLE_TIMEOUT,
    DEFAULT_MAX_IMAGE_SIDE,
    DEFAULT_MAX_QUEUED_MB,
    DEFAULT_MAX_TASK_MB,
    ConfigError,
    ServerConfig,
)


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line (no usage block), exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _fail(prog: str, message: str, code: int = 2) -> int:
    print(f"{prog}: error: {message}", file=sys.stderr)
    return code


# ---------------------------------------------------------------------- serve

CONTROL_BIND_DEPRECATED = (
    "dataserver serve: warning: --control-bind is deprecated and ignored: clients send "
    "CONTROL on each data connection (--bind), and the server binds no control endpoint"
)


def cmd_serve(args: argparse.Namespace) -> int:
    from dataserver.security import CurveKeyError
    from dataserver.server import WorkerStartError, ready_line, serve
    from dataserver.server.front.metrics import MetricsPortError

    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    if args.control_bind is not None:
        print(CONTROL_BIND_DEPRECATED, file=sys.stderr, flush=True)
    if args.workers is not None and args.workers < 1:
        return _fail("dataserver serve", f"--workers must be >= 1, got {args.workers}")
    config = ServerConfig(
        dataset=args.dataset,
        dataset_args=args.dataset_args,
        workers=args.workers or 0,
        bind=args.bind,
        session_ttl=args.session_ttl,
        cache_gb=args.cache_gb if args.cache_mb is None else args.cache_mb / 1024,
        curve_secret_key=args.curve_secret_key,
        curve_authorized_keys=args.curve_authorized_keys,
        direct_results=args.direct_results,
        local_results=args.local_results,
        max_sessions=args.max_sessions,
        max_image_side=args.max_image_side,
        max_queued_mb=args.max_queued_mb,
        max_task_mb=args.max_task_mb,
        drain_seconds=args.drain_seconds,
        metrics_port=args.metrics_port,
        metrics_bind=args.metrics_bind,
        idle_timeout=args.idle_timeout,
        heartbeat_rate=args.heartbeat_rate,
        fetch_cache=args.fetch_cache,
        fetch_cache_gb=args.fetch_cache_gb,
        max_fetches=args.max_fetches,
        max_fetch_mb=args.max_fetch_mb,
        index_cache=args.index_cache,
    )

    def announce(front: Any) -> None:
        print(ready_line(front), flush=True)

    try:
        serve(config, announce, lambda line: print(line, flush=True))
    except (SpecError, ConfigError, CurveKeyError) as exc:
        return _fail("dataserver serve", str(exc))
    except (WorkerStartError, MetricsPortError) as exc:
        return _fail("dataserver serve", str(exc), 1)
    except zmq.ZMQError as exc:
        return _fail("dataserver serve", f"cannot bind {args.bind}: {exc}", 1)
    return 0


# ---------------------------------------------------------------------- synth


def cmd_synth(args: argparse.Namespace) -> int:
    from dataserver.data.coco import write_coco_annotations, write_synthetic_coco

    if args.images < 1:
        return _fail("dataserver synth", "--images must be >= 1")
    from tqdm import tqdm

    with tqdm(total=args.images, unit="image", desc="dataserver synth") as bar:
        if args.annotations_only:
            path = write_coco_annotations(
                args.out_dir, args.images, args.seed, args.boxes, bar.update
            )
        else:
            path = write_synthetic_coco(args.out_dir, args.images, args.seed, bar.update)
    what = "annotations of" if args.annotations_only else ""
    print(f"wrote {what} {args.images} images and {path}; serve them with --dataset coco:{path}")
    return 0


# ---------------------------------------------------------------------- index


def cmd_index(args: argparse.Namespace) -> int:
    from dataserver.data.index import DetectionIndex, IndexCache
    from dataserver.data.spec import parse_spec, prepare_index
    from dataserver.server import index_progress

    def lines(fraction: float) -> None:  # for a server that runs this (server/front/indexing.py)
        print(f"progress {fraction:.3f}", flush=True)

    try:
        spec = parse_spec(args.source, args.dataset_args)
        with index_progress(args.source) as progress:
            tell = lines if args.progress_lines else progress
            shared, how = prepare_index(spec, IndexCache(args.index_cache), tell)
    except SpecError as exc:
        return _fail("dataserver index", str(exc))
    if shared is None:
        return _fail("dataserver index", f"{args.source} has no index to build (no annotations)")
    what = f"{shared.nbytes / (1 << 20):.1f} MiB"
    if shared.mapped.meta.get("detection"):
        det = DetectionIndex(shared.mapped)
        what = f"{len(det)} images, {len(det.all_boxes)} boxes, {what}"
    where = IndexCache(args.index_cache).path_for(shared.mapped.source)
    print(f"index of {args.source}: {how} ({what}) at {where}")
    return 0


def cmd_shards(args: argparse.Namespace) -> int:
    from dataserver.data.shards import write_shards

    if args.shard_mb <= 0:
        return _fail("dataserver shards", f"--shard-mb must be > 0, got {args.shard_mb}")
    try:
        paths = write_shards(args.annotations, args.image_dir, args.out_dir, args.shard_mb)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return _fail("dataserver shards", f"cannot write shards of {args.annotations}: {exc}")
    last = f"{len(paths) - 1:06d}"
    print(
        f"wrote {len(paths)} shards and categories.json into {args.out_dir}; serve them with "
        f"--dataset 'wds:{args.out_dir}/shard-{{000000..{last}}}.tar' (or upload the folder "
        "and give its URL)"
    )
    return 0


# ---------------------------------------------------------------------- stats


def cmd_stats(args: argparse.Namespace) -> int:
    from dataserver.security import CurveKeyError

    try:
        stats = fetch_stats(
            args.address, args.timeout, args.curve_server_key, args.curve_secret_key
        )
    except (TimeoutError, ProtocolError) as exc:
        return _fail("dataserver stats", str(exc), 1)
    except (ValueError, CurveKeyError) as exc:
        return _fail("dataserver stats", str(exc), 2)
    # Ready: every worker alive and not draining (a draining server leaves the Service).
    healthy = stats["workers_alive"] >= stats["workers"] and not stats.get("draining")
    if args.json:
        print(json.dumps(stats, indent=2, sort_keys=True))
        return 0 if healthy or not args.check else 1
    if stats.get("indexing") is not None:  # bound, its index being built: alive, not ready
        print(f"server {stats['server_id']}, up {stats['uptime_s']} s")
        print(f"  indexing {stats['indexing']} ({stats.get('dataset')})")
        return 1 if args.check else 0
    print(f"server {stats['server_id']}, up {stats['uptime_s']} s")
    print(f"  dataset        {stats['fingerprint']} ({stats['dataset_len']} samples)")
    print(
        f"  workers        {stats['workers_alive']}/{stats['workers']} alive, "
        f"{stats['workers_busy']} busy, {stats['workers_started']} started"
    )
    print(f"  queue depth    {stats['queue_depth']}")
    if stats.get("draining"):
        print(f"  draining       for {stats['draining']['for_s']} s")
    _print_sessions(stats)
    if stats.get("connections") is not None:
        limit = (stats.get("limits") or {}).get("max_connections")
        print(f"  connections    {stats['connections']} (at most {limit})")
    if stats.get("metrics_port") is not None:
        print(f"  metrics        port {stats['metrics_port']} (/metrics)")
    for key, value in sorted(stats["counters"].items()):
        print(f"  {key:<22} {value}")
    print(f"  rejected       {stats['rejected_total']}")
    for key, value in sorted(stats["rejected"].items()):
        print(f"    {key:<20} {value}")
    return 0 if healthy or not args.check else 1


def _print_sessions(stats: dict[str, Any]) -> None:
    """The sessions, the cap on them and why, how often their clients are told to beat."""
    print(f"  sessions       {stats['sessions']}")
    limits = stats.get("limits") or {}
    if limits.get("max_sessions_why"):
        print(f"  session cap    {limits['max_sessions']} ({limits['max_sessions_why']})")
    if stats.get("heartbeat_interval_s") is not None:
        print(f"  heartbeats     clients told to beat every {stats['heartbeat_interval_s']:g} s")


# ---------------------------------------------------------------------- keygen


def cmd_keygen(args: argparse.Namespace) -> int:
    from dataserver.security import keygen

    public, secret = keygen(args.directory, args.name)
    print(f"wrote {public} (public: give it to the other side) and {secret} (secret: keep it)")
    return 0


# ---------------------------------------------------------------------- demo / bench


def cmd_demo(args: argparse.Namespace) -> int:
    from dataserver.demo import run_demo

    return run_demo(args)


def cmd_bench(args: argparse.Namespace) -> int:
    from dataserver.bench import run_bench

    return run_bench(args)


# ---------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="dataserver", description="A data service for PyTorch detection training."
    )
    parser.add_argument("--version", action="version", version=f"dataserver {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_serve(sub)
    _add_synth(sub)
    _add_shards(sub)
    _add_index(sub)
    _add_demo(sub)
    _add_stats(sub)
    _add_keygen(sub)
    _add_bench(sub)
    return parser


def _add_serve(sub: Any) -> None:
    p = sub.add_parser("serve", help="run a server until SIGINT/SIGTERM")
    p.add_argument(
        "--dataset",
        default=DEFAULT_SPEC,
        help="synthetic | synthetic:images=N,seed=S | coco:ANNOTATIONS.json[:IMAGE_DIR] | "
        "package.module:factory (default: synthetic)",
    )
    p.add_argument(
        "--dataset-args", default=None, help="JSON object of keyword arguments for a factory"
    )
    p.add_argument(
        "--workers", type=int, default=None, help="worker processes (default: number of CPUs)"
    )
    p.add_argument(
        "--bind", default=DEFAULT_BIND, help=f"data endpoint (default {DEFAULT_BIND}; port * = any)"
    )
    p.add_argument(
        "--control-bind",
        default=None,
        metavar="ADDR",
        help="deprecated, ignored: CONTROL travels on each client's data connection (--bind); "
        "the server binds no control endpoint",
    )
    p.add_argument(
        "--cache-gb",
        type=float,
        default=DEFAULT_CACHE_GB,
        help="the store of decoded, fitted sources in shared memory, shared by every worker, "
        f"epoch and job of this server (0: none) (default {DEFAULT_CACHE_GB:g})",
    )
    p.add_argument("--cache-mb", type=int, default=None, help="the same in MiB (an older spelling)")
    p.add_argument(
        "--session-ttl",
        type=float,
        default=30.0,
        help="forget clients silent this long (s; clients beat every 0.5 s, slower on a loaded server: --heartbeat-rate) (default 30)",
    )
    p.add_argument(
        "--max-sessions",
        type=int,
        default=None,
        help="client sessions served at once; more are refused (default: as many as the fd "
        "limit allows, 1 fd a session; a larger N is clamped to that)",
    )
    p.add_argument(
        "--max-image-side",
        type=int,
        default=DEFAULT_MAX_IMAGE_SIDE,
        help=f"largest output image side a task may ask for (default {DEFAULT_MAX_IMAGE_SIDE})",
    )
    p.add_argument(
        "--max-queued-mb",
        type=int,
        default=DEFAULT_MAX_QUEUED_MB,
        help="bytes held for clients in each process: queued tasks, unread results; one "
        f"client at most 1/8 of it (default {DEFAULT_MAX_QUEUED_MB})",
    )
    p.add_argument(
        "--max-task-mb",
        type=int,
        default=DEFAULT_MAX_TASK_MB,
        help="the most output one task may ask for (images x 3 x H x W), refused before a "
        "worker allocates it; clients cut their batches to fit (default "
        f"{DEFAULT_MAX_TASK_MB}: 16 images of 1024x1024, one of 4096x4096)",
    )
    p.add_argument(
        "--curve-secret-key", default=None, help="server key file (.key_secret) for CURVE"
    )
    p.add_argument(
        "--curve-authorized-keys", default=None, help="directory of authorized client .key files"
    )
    p.add_argument(
        "--direct-results",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="workers send results straight to clients that can reach them (default: on; "
        "results fall back to the front otherwise)",
    )
    p.add_argument(
        "--local-results",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="workers also offer their results over ipc, which clients on this host use "
        "instead of TCP (default: on)",
    )
    p.add_argument(
        "--drain-seconds",
        type=float,
        default=DEFAULT_DRAIN_SECONDS,
        help="on SIGTERM: take no new tasks, tell clients (they move their queued tasks), "
        "finish running ones, exit within this many seconds (0: stop at once; SIGINT or a "
        f"second SIGTERM always stops at once) (default {DEFAULT_DRAIN_SECONDS:g})",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics on PORT of --metrics-bind (0: any free port, shown by "
        "`dataserver stats`) (default: off)",
    )
    p.add_argument(
        "--metrics-bind",
        metavar="HOST",
        default=None,
        help="the interface --metrics-port listens on, e.g. 0.0.0.0 for a scraper on another "
        "host (default: the interface of --bind; 127.0.0.1 for an ipc --bind)",
    )
    p.add_argument(
        "--idle-timeout",
        type=float,
        default=DEFAULT_IDLE_TIMEOUT,
        metavar="S",
        help="drop a peer's connection to the data port that sent nothing for S "
        "seconds (clients beat every 0.5-10 s as told; one that is dropped reconnects) "
        f"(default {DEFAULT_IDLE_TIMEOUT:g})",
    )
    p.add_argument(
        "--heartbeat-rate",
        type=float,
        default=DEFAULT_HEARTBEAT_RATE,
        metavar="N",
        help="heartbeats a second this server asks of all its sessions together: clients are "
        "told to beat every sessions/N s (0.5 to 10 s, at most a third of --session-ttl and "
        f"--idle-timeout) (default {DEFAULT_HEARTBEAT_RATE:g})",
    )
    p.add_argument(
        "--fetch-cache",
        default=None,
        metavar="DIR",
        help="keep bytes fetched from object stores (s3://, gs://, az://, http(s)://) in DIR on "
        "local disk, across restarts (default: in memory)",
    )
    p.add_argument(
        "--fetch-cache-gb",
        type=float,
        default=DEFAULT_FETCH_CACHE_GB,
        metavar="N",
        help="the fetch cache's size, all workers together (0: none) "
        f"(default {DEFAULT_FETCH_CACHE_GB:g})",
    )
    p.add_argument(
        "--max-fetches",
        type=int,
        default=DEFAULT_MAX_FETCHES,
        metavar="N",
        help="object-store requests in flight per server, shared by its workers "
        f"(default {DEFAULT_MAX_FETCHES})",
    )
    p.add_argument(
        "--max-fetch-mb",
        type=int,
        default=DEFAULT_MAX_FETCH_MB,
        metavar="N",
        help="MiB of object-store bytes in flight per server (the fetches ahead of the "
        f"sessions' plans) (default {DEFAULT_MAX_FETCH_MB})",
    )
    p.add_argument(
        "--index-cache",
        metavar="DIR",
        default=None,
        help="where annotation indexes are cached (built once per source, shared by every "
        "server on the volume; default: $XDG_CACHE_HOME/dataserver or ~/.cache/dataserver)",
    )
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=cmd_serve)


def _add_synth(sub: Any) -> None:
    p = sub.add_parser(
        "synth", help="write a synthetic COCO-format dataset (JPEGs + annotations.json)"
    )
    p.add_argument("out_dir")
    p.add_argument("--images", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--annotations-only",
        action="store_true",
        help="write annotations.json alone (no JPEGs): a large set to index, for benchmarks",
    )
    p.add_argument(
        "--boxes", type=int, default=7, help="--annotations-only: boxes per image (default 7)"
    )
    p.set_defaults(func=cmd_synth)


def _add_shards(sub: Any) -> None:
    p = sub.add_parser(
        "shards",
        help="write a local COCO set as WebDataset tar shards (KEY.jpg + KEY.json) for wds:",
    )
    p.add_argument("annotations", help="the COCO annotations.json")
    p.add_argument("out_dir")
    p.add_argument("--image-dir", default=None, help="(default: the annotation file's folder)")
    p.add_argument("--shard-mb", type=float, default=100.0, help="about this much a shard")
    p.set_defaults(func=cmd_shards)


def _add_index(sub: Any) -> None:
    p = sub.add_parser(
        "index",
        help="build a dataset's annotation index into the cache ahead of serving it "
        "(an init container, a Slurm prologue)",
    )
    p.add_argument(
        "source", help="coco:ANNOTATIONS.json | yolo:DATA.yaml[:SPLIT] | package.module:factory"
    )
    p.add_argument(
        "--dataset-args", default=None, help="JSON object of keyword arguments for a factory"
    )
    p.add_argument(
        "--index-cache",
        metavar="DIR",
        default=None,
        help="the cache directory (default: $XDG_CACHE_HOME/dataserver or ~/.cache/dataserver)",
    )
    p.add_argument("--progress-lines", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_index)


def _add_demo(sub: Any) -> None:
    p = sub.add_parser("demo", help="serve the synthetic set and train a small model against it")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--image-size", type=int, default=256)
    p.add_argument(
        "--threshold",
        type=float,
        default=0.75,
        help="Stitcher's tau (the paper's 0.1 suits COCO; the synthetic set is mostly small objects)",
    )
    p.add_argument(
        "--plot",
        metavar="FILE",
        default=None,
        help="also draw the ratio, the threshold and the mode of every step into FILE "
        '(e.g. timeline.png; needs matplotlib: pip install "dataserver[plot]")',
    )
    p.set_defaults(func=cmd_demo)


def _add_stats(sub: Any) -> None:
    p = sub.add_parser("stats", help="print a live server's counters")
    p.add_argument("address", help="the server's data endpoint, e.g. tcp://127.0.0.1:5555")
    p.add_argument("--timeout", type=float, default=5.0)
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--check", action="store_true", help="exit 1 unless every worker is alive (readiness probe)"
    )
    p.add_argument("--curve-server-key", default=None, help="the server's public key file (CURVE)")
    p.add_argument(
        "--curve-secret-key", default=None, help="this client's .key_secret file (CURVE)"
    )
    p.set_defaults(func=cmd_stats)


def _add_keygen(sub: Any) -> None:
    p = sub.add_parser("keygen", help="write a CURVE key pair")
    p.add_argument("directory")
    p.add_argument("--name", default="server")
    p.set_defaults(func=cmd_keygen)


def _add_bench(sub: Any) -> None:
    p = sub.add_parser(
        "bench", help="measure against DataLoader and raw ZeroMQ (docs/benchmarks.md)"
    )
    p.add_argument("--data", default=None, help="a dataserver synth folder (default: make one)")
    p.add_argument("--images", type=int, default=512)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--image-size", type=int, default=512)
    p.add_argument("--batches", type=int, default=40)
    p.add_argument("--rounds", type=int, default=3, help="runs of each side, alternating")
    p.add_argument(
        "--flip-images",
        type=int,
        default=1024,
        help="flip_stall: images of its own data set (it times whole epochs of them)",
    )
    p.add_argument(
        "--first-epoch-images",
        type=int,
        default=3072,
        help="dataloader: images of the data set its first-epoch runs time whole",
    )
    p.add_argument(
        "--scale-sessions", type=int, default=1000, help="scale (c): sessions held on one server"
    )
    p.add_argument("--scale-servers", default="1,4,16,64", help="scale (b): fake server counts")
    p.add_argument("--scale-clients", type=int, default=64, help="scale (a): task sessions")
    p.add_argument("--scale-workers", type=int, default=2, help="scale (a): the server's workers")
    p.add_argument("--scale-seconds", type=float, default=5.0, help="scale: each timed window")
    p.add_argument(
        "--slow-seconds", type=float, default=6.0, help="slow_server: each run's timed window"
    )
    p.add_argument("--scale-batches", type=int, default=300, help="scale (b): timed batches")
    p.add_argument(
        "--scale-rate-servers",
        default="16,256,1024",
        help="scale (b): fake server counts measured at a fixed task rate ('' to skip)",
    )
    p.add_argument(
        "--scale-rate", type=float, default=200.0, help="scale (b): that rate, tasks a second"
    )
    p.add_argument(
        "--scale-parts", default="a,b,c", help="scale: which of its parts to run (a, b, c)"
    )
    p.add_argument(
        "--scale-direct",
        type=int,
        choices=(0, 1),
        default=1,
        help="scale (c): each session holds a result connection to each worker, as a real "
        "client's (0: none, to weigh the front alone with fewer processes' load)",
    )
    p.add_argument(
        "--index-images", type=int, default=1_000_000, help="index: images of its annotation set"
    )
    p.add_argument("--index-boxes", type=int, default=7, help="index: boxes per image")
    p.add_argument(
        "--index-peer-images",
        type=int,
        default=20_000,
        help="index: images of the YOLO-layout set Ultralytics' label cache is built from",
    )
    p.add_argument("--only", default=None, help="comma-separated figures to run")
    p.add_argument("--json", default=None, help="also write the results here")
    p.set_defaults(func=cmd_bench)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
