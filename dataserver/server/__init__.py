"""``dataserver serve``: a front process and its pool of worker processes."""

from __future__ import annotations

import logging
import os
import shutil
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from dataserver.data.fetchcache import memory_dir
from dataserver.data.index import IndexCache
from dataserver.data.remote import FetchSettings, configure
from dataserver.data.spec import (
    DatasetSpec,
    build_dataset,
    dataset_categories,
    dataset_fingerprint,
    dataset_sizes,
    parse_spec,
    prepare_index,
)
from dataserver.server.config import ConfigError, ServerConfig
from dataserver.server.conns import raise_fd_limit
from dataserver.server.front.front import Front, WorkerStartError
from dataserver.server.front.indexing import IndexingPorts, build_ahead
from dataserver.server.memory import FRONT_TRIM_THRESHOLD, keep_large_blocks

log = logging.getLogger("dataserver.serve")

__all__ = [
    "ConfigError",
    "Front",
    "ServerConfig",
    "WorkerStartError",
    "parse_ready_line",
    "ready_line",
    "serve",
]


def ready_line(front: Front) -> str:
    """The one line ``dataserver serve`` prints once every worker is up."""
    return (
        f"dataserver ready data={front.endpoints['data']} "
        f"workers={front.n_workers} samples={front.dataset_len} dataset={front.config.dataset} "
        f"sources={front.sources()} index_cache={IndexCache(front.config.index_cache).dir}"
    )


def parse_ready_line(line: str) -> dict[str, str]:
    """The fields of a ``ready_line`` (data, workers, samples, dataset, sources,
    index_cache)."""
    return dict(part.split("=", 1) for part in line.split()[2:])


@contextmanager
def index_progress(what: str) -> Iterator[Callable[[float], None]]:
    """``progress(fraction)`` for an index being built: a tqdm bar on stderr, shown once
    the build has taken 2 s (a cached start shows nothing)."""
    from tqdm import tqdm

    with tqdm(total=100, desc=f"indexing {what}", unit="%", delay=2.0, leave=False) as bar:

        def progress(fraction: float) -> None:
            bar.update(max(0, round(100 * fraction) - bar.n))

        yield progress


def serve(
    config: ServerConfig,
    on_ready: Callable[[Front], Any],
    on_indexing: Callable[[str], Any] = lambda line: None,
) -> None:
    """Index the dataset's annotations once (from the cache, or built: then the ports are
    bound first and ``on_indexing(line)`` is told where), build the dataset on that index
    (to check its spec and learn its size), then run the front until SIGINT, or SIGTERM
    and a drain (``--drain-seconds``). Raises ``SpecError``/``ConfigError`` for bad flags
    and ``WorkerStartError`` when no worker can start."""
    config.validate()
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # whatever a user's dataset imports, no GPU here
    # The front keeps less at a heap's top than a worker: what it frees there is mostly
    # libzmq's frames of its I/O thread, whose arena top malloc_trim does not trim; the
    # frames of a message that never ended (its connection shut down) went back only
    # past 256 MiB (63 MiB of 64 sent stayed for good), now past 16 MiB.
    keep_large_blocks(trim_threshold=FRONT_TRIM_THRESHOLD)
    soft, hard = raise_fd_limit()
    log.info("pid %d; fd limit %d (hard %d)", os.getpid(), soft, hard)
    spec = parse_spec(config.dataset, config.dataset_args)
    remote = "://" in f"{config.dataset}{config.dataset_args or ''}"
    if remote and config.fetch_cache is None and config.fetch_cache_gb > 0:
        # The in-memory fetch cache: a private directory of /dev/shm, removed at exit.
        config = replace(config, fetch_memory_dir=memory_dir())
    try:
        _serve(config, spec, on_ready, on_indexing)
    finally:
        if config.fetch_memory_dir is not None:
            shutil.rmtree(config.fetch_memory_dir, ignore_errors=True)


def _serve(
    config: ServerConfig,
    spec: DatasetSpec,
    on_ready: Callable[[Front], Any],
    on_indexing: Callable[[str], Any],
) -> None:
    fetch = config.fetch_dir()
    # The front fetches only to learn the dataset (annotations, a shard index it leaves in
    # the cache's directory for its workers); it keeps no object's bytes.
    configure(FetchSettings(cache_dir=None if fetch is None else fetch[0]))
    # The annotation index: loaded from the cache, or built once (the workers map it). A
    # build binds the ports first and answers STATS ("indexing N%") while a one-shot
    # ``dataserver index`` runs (CURVE servers build it before binding: STATS is keyed).
    cache = IndexCache(config.index_cache)
    shared, how = prepare_index(spec, cache, cached_only=True)
    if how == "uncached" and config.curve is None and cache.usable():
        ports = IndexingPorts(config)
        on_indexing(
            f"dataserver indexing data={ports.data_endpoint} "
            f"dataset={config.dataset} index_cache={cache.dir}"
        )
        try:
            build_ahead(spec, cache, ports)
            config = ports.bound()
        finally:
            ports.close()
    if shared is None:
        with index_progress(config.dataset) as progress:
            shared, how = prepare_index(spec, cache, progress)
    if shared is not None:
        log.info("index of %s: %s (%d MiB)", config.dataset, how, shared.nbytes >> 20)
    dataset = build_dataset(spec, None if shared is None else shared.mapped)
    size = len(dataset)
    if size < 1:
        raise ConfigError(f"--dataset {config.dataset}: the dataset is empty")
    fingerprint = dataset_fingerprint(spec, dataset)
    deterministic = getattr(dataset, "deterministic", False) is True
    categories = dataset_categories(dataset)
    sizes = dataset_sizes(dataset, size)
    # A dataset in object storage that says where its samples' bytes are: the front
    # fetches them ahead of its workers (``prefetch.py``; it keeps the dataset for that).
    remote = "://" in f"{config.dataset}{config.dataset_args or ''}"
    locate = getattr(dataset, "locations", None) if remote and fetch is not None else None
    blocks = getattr(dataset, "block", None) if locate is not None else None
    del dataset
    index = None if shared is None else (shared.fd, shared.nbytes)
    front = Front(
        config, size, fingerprint, deterministic, categories, sizes, index, locate, blocks
    )
    previous = {
        signal.SIGINT: signal.signal(signal.SIGINT, lambda *_: front.stop()),
        # SIGTERM (a scale-down, a rolling update): drain first; a second one stops at once.
        signal.SIGTERM: signal.signal(signal.SIGTERM, lambda *_: front.terminate()),
    }
    try:
        front.run(on_ready)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
