"""The WebDataset peer of ``dataserver bench --only remote``: WebDataset's own pipeline
streaming the same tar shards from the same S3 API, as its users run it.

``wds.WebDataset(urls, shardshuffle=True)`` (the shards shuffled, split between the
DataLoader's workers) ``.shuffle(SHUFFLE_BUFFER)`` (a sample buffer: WebDataset's
approximation of a global shuffle), each sample decoded and fitted by the same code as
every other side (``compose_one`` over a one-sample dataset: identical work per image),
``.batched`` in the worker, in a ``wds.WebLoader`` with the tuned DataLoader's settings
(spawn, persistent workers, ``tuned_process``). A shard is read by one streaming GET
(``s3://`` opened by its ``url_opener`` stage's stand-in, streamed with obstore and the same
credentials and endpoint as the servers: what ``pipe:aws s3 cp URL -`` does, in process).
Epoch 2 is its steady rate (epoch 1 also starts the workers); nothing is cached.
"""

from __future__ import annotations

import argparse
import io
import os
from typing import Any

import numpy as np
import torch

SHUFFLE_BUFFER = 1000  # samples (WebDataset's examples use 1,000 to 5,000)


class _Chunks(io.RawIOBase):
    """A readable stream over an iterator of byte chunks (obstore's ``GetResult.stream``)."""

    def __init__(self, chunks: Any) -> None:
        self._chunks = iter(chunks)
        self._buf = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        while not len(self._buf):
            try:
                self._buf = memoryview(bytes(next(self._chunks)))
            except StopIteration:
                return 0
        n = min(len(b), len(self._buf))
        b[:n] = self._buf[:n]
        self._buf = self._buf[n:]
        return n


def open_s3(url: str, mode: str = "rb", bufsize: int = 8192, **kw: Any) -> io.BufferedReader:
    """WebDataset's opener for ``s3://BUCKET/KEY``: one streaming GET through obstore, the
    endpoint and credentials from the environment (``AWS_*``), as the servers read them."""
    import obstore
    from obstore.store import from_url

    bucket, _, key = url[len("s3://") :].partition("/")
    endpoint = os.environ.get("AWS_ENDPOINT_URL", "")
    options: Any = {"allow_http": endpoint.startswith("http://")}
    store: Any = from_url(f"s3://{bucket}", client_options=options)
    stream = obstore.get(store, key).stream(min_chunk_size=1 << 20)
    # (a raw stream that answers readinto is what BufferedReader takes)
    return io.BufferedReader(_Chunks(stream), buffer_size=max(bufsize, 1 << 20))


class _One:
    """A one-sample dataset for ``compose_one``: a WebDataset sample's decoded image and its
    COCO-style boxes (what ``ShardDataset`` makes of the same members)."""

    deterministic = True

    def __init__(self, sample: Any) -> None:
        self.sample = sample

    def __len__(self) -> int:
        return 1

    def __getitem__(self, index: int) -> Any:
        return self.sample


class _Work:
    """A WebDataset sample (its ``jpg`` and ``json`` members) made into the item every side
    makes: the image decoded, fitted and placed by ``compose_one``; its boxes and labels.
    (A class, not a closure: spawn pickles the pipeline into each worker.)"""

    def __init__(self, size: tuple[int, int]) -> None:
        self.size = size

    def __call__(self, sample: dict[str, Any]) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
        from dataserver.data.pipeline import compose_one
        from dataserver.data.sample import Sample
        from dataserver.data.shards import _objects
        from dataserver.data.transforms import decode_image
        from dataserver.protocol import BatchSizes

        key = sample["__key__"]
        image = decode_image(np.frombuffer(sample["jpg"], dtype=np.uint8))
        if image is None:
            raise ValueError(f"{key}: not a decodable image")
        boxes, labels, _, _ = _objects(key, "json", sample["json"])
        one = Sample(
            image,
            np.asarray(boxes, dtype=np.float32).reshape(-1, 4),
            np.asarray(labels, dtype=np.int64),
            key,
        )
        canvas, out = compose_one(_One(one), [0], 1, BatchSizes.of(self.size), 0, 0)
        return torch.from_numpy(canvas), out.boxes, out.labels


def _as_made(batch: Any) -> Any:
    return batch


def _opened(shards: Any) -> Any:
    """WebDataset's ``url_opener`` stage with ``s3://`` opened by ``open_s3``."""
    for shard in shards:
        yield {**shard, "stream": open_s3(shard["url"])}


def _samples(shards: Any) -> Any:
    """WebDataset's ``tarfile_samples`` (its tar expander and key grouping) over ``_opened``."""
    from webdataset.tariterators import group_by_keys, tar_file_expander

    return group_by_keys(tar_file_expander(_opened(shards)))


def wds_side(args: argparse.Namespace) -> dict[str, Any]:
    """The peer on ``args.spec`` (``wds:s3://.../shard-{000000..NNNNNN}.tar``): images/s of
    epochs 1 and 2 and the first batch's wait."""
    import webdataset as wds

    from dataserver.bench.baselines import collate, tuned_process
    from dataserver.bench.remote import two_epochs
    from dataserver.data.shards import expand

    urls = expand(args.spec[len("wds:") :])
    size = (args.image_size, args.image_size)
    workers = min(args.workers, len(urls))  # (a worker with no shard would have nothing)
    # WebDataset(urls, shardshuffle=True).shuffle(...) as its stages (the same ones), with
    # s3:// opened in process: the shard list shuffled, split between workers, streamed.
    pipeline = wds.DataPipeline(
        wds.SimpleShardList(urls, seed=0),
        wds.shuffle(len(urls), seed=0),
        wds.split_by_worker,
        _samples,
        wds.shuffle(SHUFFLE_BUFFER, seed=0),
        wds.map(_Work(size)),
        wds.batched(args.batch_size, collation_fn=collate, partial=True),
    )
    loader = wds.WebLoader(
        pipeline,
        batch_size=None,
        collate_fn=_as_made,  # (batched in the worker: nothing to convert on the way out)
        num_workers=workers,
        worker_init_fn=tuned_process,
        persistent_workers=workers > 0,
        multiprocessing_context="spawn" if workers > 0 else None,
        prefetch_factor=4 if workers > 0 else None,
    )
    return {"workers": workers, **two_epochs(loader)}
