"""``DataServerClient``: the trainer-side iterator over batches served by dataserver.

Over the house's ~500 lines (about 680): the public API, each method documented for users
with the checks of its arguments, and ``iterate_epochs``; the work is in the engine (each
method asks it through ``call``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from dataserver.protocol import control_problem
from dataserver_client.batch import Batch
from dataserver_client.buffers.handoff import Handoff, Stuck
from dataserver_client.collectives import (
    all_reduce_mean,
    default_rank_world,
    gather_ranks,
    in_process_group,
)
from dataserver_client.config import (
    MAX_DATASET_LEN,
    ClientConfig,
    resolve_device,
    size_problem,
)
from dataserver_client.engine.engine import Engine
from dataserver_client.errors import DataServerError
from dataserver_client.metrics import ClientMetrics
from dataserver_client.plan.epoch import MODES, REGULAR, STITCH, shard_size
from dataserver_client.plan.resume import (
    CONFIG_KEYS,
    Deal,
    Position,
    check_state,
    epoch_shard,
    merge_states,
    plan_resume,
    version_of,
)
from dataserver_client.plan.sizes import MultiScale, SizeSchedule, StepSizes, schedule_of
from dataserver_client.session.inflight import Delivery
from dataserver_client.session.rebuild import plan_of

log = logging.getLogger("dataserver_client")


@dataclasses.dataclass(frozen=True)
class Resume:
    """Where the next iteration starts: a loaded state's epoch, position and step (its
    deal, for an elastic resume), or the start of an epoch."""

    epoch: int
    position: int
    step: int
    deal: Deal | None
    legacy: bool = False  # a state of resume.LEGACY_VERSIONS: the epoch in its order of then


class DataServerClient:
    """Iterate over one rank's shard of an epoch, assembled into batches on ``device``.

    Guarantees (see docs/contract.md): every index of the shard exactly once per epoch, in the
    order fixed by (seed, epoch); ``feedback``/``set_mode``/``control`` are honoured by the
    very next batch ``next()`` returns, whatever the prefetch depth; the same seed, epoch
    and feedback sequence give bit-identical batches on any number of workers or servers;
    and no call blocks longer than ``timeout`` seconds without progress.

    ``addresses``: one ``tcp://host:port`` or a list (a DNS name with several addresses
    counts as several servers). ``rank``/``world_size`` default to torch.distributed, then
    env RANK/WORLD_SIZE, then 0/1; ``device`` to "cuda" when available. ``prefetch`` is
    how many batches are prepared ahead of the trainer (default 4: with a batch a task,
    enough to keep two tasks at each worker; each task costs a message each way and a
    wake-up of the client, the front and a worker). CURVE: ``curve_server_key`` (the
    server's public key) and ``curve_secret_key`` (this client's secret key), as paths to
    ``dataserver keygen`` files or as bytes. ``shared_memory``: let workers on this host
    write batches straight into this process's memory (a sealed memfd, handed only to
    workers proven to be on this host and of this user; default on; results
    from other hosts come over the network either way). ``lookahead``: while the trainer
    steers the mode often (``feedback``/``set_mode`` twice within 16 batches; off again
    after 64 batches without), also prepare the next batch in the other mode, from the
    same samples, so the batch after a flip is ready when asked (a trainer that steers once
    or twice, such as close-mosaic, pays nothing for it; default on; composition is done
    twice, never a decode, where the servers keep a store of sources: ``serve
    --cache-gb``; without one it stays off). ``discovery_interval``:
    seconds between re-resolutions of the DNS names among ``addresses`` (a Kubernetes
    headless Service): servers that appear join the running epoch, servers that disappear
    have their tasks moved at once (``0``: resolve once). ``metrics_port``: serve this
    client's metrics (the time ``next()`` waits for data, samples/s) in Prometheus' format
    on that port of this process; ``stats()`` has them either way. ``max_dataset_len``:
    a server announcing more samples is refused (``DataServerError``; default 2**40, at
    most 2**48: the epoch's order is computed per position, so the size costs no memory).

    ``image_size``: (h, w), or a ``MultiScale`` schedule (batch ``step``'s size drawn from
    its sizes by (seed, epoch, step // every), the same on every rank, planned ahead), or
    a ``StepSizes`` (batch ``step`` of every epoch at the list's ``step``-th size, the last
    one after its end: a rank's own list, planned ahead); ``set_image_size`` changes it
    from the next batch on. ``stitch_layout``: "spatial"
    (a sqrt(k) x sqrt(k) grid), "batch" (k smaller images) or "mosaic" (YOLO's mosaic of 4
    around a random centre, ``dataserver/data/mosaic.py``); ``set_mode`` turns any of them
    on and off (close-mosaic is ``set_mode("regular")``). ``pad_value`` (0..255; 114 for
    YOLO): every pixel no sample covers (letterbox padding, mosaic gaps, empty cells);
    ``letterbox``: "top-left" (default) or "center" (Ultralytics' ``LetterBox``: a regular
    image, and each cell of a grid, centred, its boxes shifted with it).
    ``fit``: "letterbox" (default: each source resized to fit its cell, aspect kept, the
    rest ``pad_value``) or "stretch" (resized to the whole cell, aspect not kept, as the
    DETR-family processors do; a mosaic's sources are stretched to the image size before
    they are cut). ``augment=False``: neither the servers' built-in flip nor the dataset's
    ``augment``/``augment_composed`` run (what a validation client asks). Both travel in
    ``state_dict()`` and ``batch.manifest``. ``batch.content`` says where each picture
    lies in its canvas (a padding mask: ``dataserver_client.content_mask``).

    ``mosaic_partners`` (with ``stitch_layout="mosaic"``): "consume" (default: a mosaic
    consumes its 4 samples, Stitcher's semantics) or "window" (YOLO's: every sample of the
    rank's epoch anchors one output, its 3 partners drawn by (seed, epoch, position) from
    the rank's previous min(N, 8 x batch_size, 1000) positions, wrapping at the epoch's
    start, ``partners.py``; an epoch is N outputs in either mode, ``batch.indices[i][0]``
    the anchor, ``batch.num_samples`` counting anchors; a partner that fails under
    ``on_error="skip"`` leaves a 3-tile mosaic). ``mosaic_p`` (with "window" only): the
    probability, per output, of a mosaic, drawn by (seed, epoch, position); an output that
    is not one is its anchor alone, as a regular image, in the same batch.

    ``hedge`` (default on): with several servers, a task that waits on one server longer
    than its peers' recent p95 answer time (x1.25, at least 50 ms) is sent to a second
    server too, the first answer taken (the other cancelled or dropped: every index is
    still delivered once, bit-identical); a server whose answers are several times slower
    than its peers' gets no new work but a probe every half second until it recovers
    (docs/failures.md, "Slow servers"; ``stats()``: ``hedged``, ``hedge_won``, ``hedging``). With no
    slow server it hedges a few percent of tasks, on credit left free; ``hedge=False``
    turns both off.
    """

    def __init__(
        self,
        addresses: str | Sequence[str],
        batch_size: int = 16,
        image_size: tuple[int, int] | MultiScale | StepSizes = (512, 512),
        shuffle: bool = True,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        device: str | torch.device | None = None,
        drop_last: bool = False,
        stitch_k: int = 4,
        stitch_layout: str = "spatial",
        stitch_threshold: float = 0.1,
        on_error: str = "raise",
        timeout: float = 30.0,
        *,
        prefetch: int = 4,
        curve_server_key: str | bytes | None = None,
        curve_secret_key: str | bytes | None = None,
        shared_memory: bool = True,
        lookahead: bool = True,
        discovery_interval: float = 5.0,
        metrics_port: int | None = None,
        max_dataset_len: int = MAX_DATASET_LEN,
        pad_value: int = 0,
        letterbox: str = "top-left",
        mosaic_partners: str = "consume",
        mosaic_p: float = 1.0,
        hedge: bool = True,
        augment: bool = True,
        fit: str = "letterbox",
    ) -> None:
        if rank is None or world_size is None:
            auto_rank, auto_world = default_rank_world()
            rank = auto_rank if rank is None else rank
            world_size = auto_world if world_size is None else world_size
        try:
            sizes = schedule_of(image_size)
        except ValueError as exc:
            raise ValueError(f"DataServerClient: {exc}") from None
        self.config = ClientConfig(
            addresses=tuple([addresses] if isinstance(addresses, str) else addresses),
            batch_size=int(batch_size),
            image_size=sizes,
            shuffle=bool(shuffle),
            seed=int(seed),
            rank=int(rank),
            world_size=int(world_size),
            device=resolve_device(device),
            drop_last=bool(drop_last),
            stitch_k=int(stitch_k),
            stitch_layout=stitch_layout,
            stitch_threshold=float(stitch_threshold),
            on_error=on_error,
            timeout=float(timeout),
            prefetch=int(prefetch),
            shared_memory=bool(shared_memory),
            lookahead=bool(lookahead),
            discovery_interval=float(discovery_interval),
            metrics_port=None if metrics_port is None else int(metrics_port),
            max_dataset_len=int(max_dataset_len),
            pad_value=pad_value,  # (checked as given: a bool or 114.5 is refused, not cast)
            letterbox=letterbox,
            mosaic_partners=mosaic_partners,
            mosaic_p=mosaic_p,  # (checked as given, as pad_value)
            hedge=bool(hedge),
            fit=fit,
            augment=augment,  # (checked as given: a bool)
        )
        self.config.validate()
        curve = _load_curve(curve_server_key, curve_secret_key)
        self._metrics = ClientMetrics(self.config.rank)
        if self.config.metrics_port is not None:  # a taken port fails here, before any socket
            self._metrics.serve(self.config.metrics_port)
        self._metrics_finalizer = weakref.finalize(self, self._metrics.close)
        self._handoff: Handoff[Delivery] = Handoff()
        self._engine = Engine(self.config, self._handoff, curve)
        self._engine.start()
        self._finalizer = weakref.finalize(self, self._engine.close)
        try:
            info = self._engine.handshake.result(self.config.timeout + 10.0)
        except BaseException:
            self.close()
            raise
        self.dataset_len: int = info.dataset_len
        self.fingerprint: str = info.fingerprint
        self._categories: tuple[tuple[int, str], ...] = info.categories
        self._sizes_count = info.sizes_count  # (the table itself: asked when first needed)
        self._epoch = 0
        self._feedback_seq = 0
        self._active = False
        self._resume: Resume | None = None  # a loaded state: where the next iteration starts
        self._legacy = False  # the iteration under way is a legacy state's (Resume.legacy)
        self._closed = False
        self._generation = 0

    # ------------------------------------------------------------ epoch

    @property
    def num_samples(self) -> int:
        """Samples in this rank's shard per epoch (DistributedSampler's count)."""
        return shard_size(self.dataset_len, self.config.world_size, self.config.drop_last)

    def __len__(self) -> int:
        """Batches in this epoch if the mode does not change again: those handed out so far
        plus the samples left cut in the current mode (a stitched batch holds k x more).
        Between epochs, the next epoch's (from a loaded state's position, if any).

        It changes when the mode does: on the epoch's last batch it is the number the epoch
        had. A progress bar that reads it once (``tqdm(client)``) counts every batch and
        ends early when stitching shortened the epoch; ``bar.total = len(client)`` after
        each ``feedback`` keeps it exact.
        """
        share: int | None = None
        if self._active and not self._closed:
            snap: Position = self._engine.call(self._engine.snapshot)
            position, step, mode, share = snap.position, snap.step, snap.mode, snap.share
        else:
            where = self._resume or Resume(self._epoch, 0, 0, None)
            position, step, mode = where.position, where.step, self.mode
        # This rank's share of the epoch: a dealt epoch (elastic resume) has its own size;
        # a spare sample rides in the last batch, so batches are counted without it.
        left = max(0, (self.num_samples if share is None else share) - position)
        per = self.config.layout().samples_per_batch(mode)
        return step + (left // per if self.config.drop_last else -(-left // per))

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def mode(self) -> str:
        """The mode the next batch will have (the I/O thread's plan book holds it)."""
        self._check_open()
        return str(self._engine.call(self._engine.mode))

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch`` for the next iteration (its order is fixed by (seed, epoch))."""
        if self._resume is not None and self._resume.epoch != epoch:
            log.warning(
                "set_epoch(%d) discards the loaded state of epoch %d", epoch, self._resume.epoch
            )
            self._resume = None
        self._epoch = int(epoch)

    def __iter__(self) -> EpochIterator:
        """Start the epoch set by ``set_epoch`` (or continue a loaded state) and return its
        iterator. A new ``iter()`` starts the epoch again, as with DataLoader; iterators of
        earlier ``iter()`` calls stop working."""
        self._check_open()
        resume, self._resume = self._resume, None
        if resume is not None:
            self._epoch = resume.epoch
        where = resume or Resume(self._epoch, 0, 0, None)
        # The epoch's shard is made here, in the trainer's thread (it is the one waiting for
        # it; a legacy state's order is computed whole): the I/O thread goes on meanwhile.
        planned = epoch_shard(self.config, self.dataset_len, self._epoch, where.deal, where.legacy)
        self._legacy = where.legacy
        self._engine.call(
            self._engine.start_epoch, self._epoch, where.position, where.step, where.deal, planned
        )
        self._metrics.epoch_started()
        self._active = True
        self._generation += 1
        return EpochIterator(self, self._generation)

    def _next(self, generation: int) -> Batch:
        if generation != self._generation:
            raise DataServerError("this iterator's epoch was superseded by a later iter(client)")
        if not self._active:
            raise StopIteration
        backstop = self.config.timeout + 10.0  # the I/O thread raises first; this catches its death
        started = time.perf_counter()  # the wait for data, for the metrics
        try:
            item = self._handoff.take(backstop, self._engine.is_alive)
        except Stuck:
            raise
        except BaseException:  # the epoch's end, or the I/O thread's error: this epoch is over
            self._active = False
            raise
        now = time.perf_counter()
        self._engine.wake()  # a batch was taken: there is room to plan another
        if isinstance(item, DataServerError):
            raise item
        handed = self._engine.hand_over(item)
        batch = dataclasses.replace(
            handed,
            feedback_seq=self._feedback_seq,
            manifest={**handed.manifest, "fingerprint": self.fingerprint},
        )
        self._metrics.taken(now - started, batch.num_samples, now)
        return batch

    # ------------------------------------------------------------ steering

    def feedback(self, ratio: float, sync: bool = True) -> str:
        """Stitcher's rule: stitch the next batch when ``ratio < stitch_threshold``.

        ``ratio`` is the share of the regression loss that small objects contribute (see
        ``small_object_loss_ratio``). With torch.distributed initialised and ``sync``, the
        ratio is first averaged over ranks, so every rank takes the same decision. Returns
        the mode of the next batch, which ``next()`` honours at once.
        """
        value = float(ratio)
        if sync:
            value = all_reduce_mean(value, self.config.device)
        mode = STITCH if value < self.config.stitch_threshold else REGULAR
        self._steer(mode, None)
        return mode

    def set_mode(self, mode: str) -> None:
        """Make the next batch (and those after it) ``"stitch"`` or ``"regular"``."""
        if mode not in MODES:
            raise ValueError(f"mode must be 'regular' or 'stitch', got {mode!r}")
        self._steer(mode, None)

    def set_image_size(self, size: tuple[int, int] | MultiScale | StepSizes) -> None:
        """Make the next batch (and those after it) ``size`` (h, w), boxes in its pixels, or
        follow a ``MultiScale`` or ``StepSizes`` schedule from the next batch on (its steps
        counted from the epoch's start). Like ``set_mode``, the next batch ``next()``
        returns honours it, whatever the prefetch depth: the batches prepared at the old
        size are planned again (a scheduled change, ``MultiScale`` or ``StepSizes``, costs
        no such wait: its sizes are planned ahead; set before an epoch starts, nothing is
        planned yet and nothing is planned again)."""
        try:
            sizes = schedule_of(size, "set_image_size")
        except ValueError as exc:
            raise ValueError(str(exc)) from None
        problem = size_problem(sizes, self.config.layout().grid)
        if problem is not None:
            raise ValueError(f"set_image_size: {problem}")
        self._check_open()
        problem = self._side_problem([*sizes.sizes, sizes.stored])
        if problem is not None:  # what the servers would refuse, refused here, at the call
            raise ValueError(f"set_image_size: {problem}")
        self._feedback_seq += 1
        self._engine.call(self._engine.resize, sizes)

    def _side_problem(self, sizes: Sequence[tuple[int, int]]) -> str | None:
        """A size of ``sizes`` the servers in use would refuse: a side above the smallest of
        their ``--max-image-side`` (as their WELCOMEs announced it)."""

        side: int | None = self._engine.call(self._engine.max_image_side)
        for hw in sizes:
            if side is not None and max(hw) > side:
                return f"image size {tuple(hw)} exceeds the servers' --max-image-side {side}"
        return None

    @property
    def categories(self) -> list[tuple[int, str]]:
        """The dataset's categories as its servers announce them: (label, name) pairs, the
        labels as they are on the wire (COCO keeps its category ids); [] when the dataset
        announces none. Servers of one job announcing different ones are refused as
        servers of another dataset are."""
        return list(self._categories)

    @property
    def sizes(self) -> list[tuple[int, int]]:
        """The dataset's per-sample (h, w), index by index, as its servers announce them
        (a dataset's optional ``sizes``, up to 2^24: what aspect-grouped batches are
        planned from, e.g. Ultralytics' rect validation); [] when it announces none. A
        list of N tuples: ``size_array()`` is the same as one array. Asked of the servers
        the first time (``size_array``)."""
        return [(int(h), int(w)) for h, w in self.size_array().tolist()]

    def size_array(self) -> np.ndarray:
        """``sizes`` as one read-only int32 (N, 2) array ((0, 2) when the dataset
        announces none). WELCOME carries only their count and digest: the first call asks
        a server for them, in chunks (``dataserver_client/session/announce.py``), and waits at most
        ``timeout`` seconds, then raises ``DataServerError`` saying so; a server that sends
        sizes other than the digest announced is refused (as a server that breaks the
        protocol) and the sizes are asked of another. Later calls return the same array."""
        self._check_open()
        if self._sizes_count == 0:
            return np.zeros((0, 2), np.int32)
        future = self._engine.call(self._engine.sizes)
        deadline = time.monotonic() + self.config.timeout
        while True:
            try:
                table: np.ndarray = future.result(0.25)
                return table
            except TimeoutError:
                if not self._engine.is_alive():
                    raise self._engine.dead_error() from None
                if time.monotonic() > deadline:
                    why = (
                        f"the dataset's {self._sizes_count} sizes: not all came within "
                        f"{self.config.timeout:g} s (timeout)"
                    )
                    self._engine.call(self._engine.abandon_sizes, why)
                    raise DataServerError(why) from None

    @property
    def image_size(self) -> tuple[int, int] | MultiScale | StepSizes:
        """The size schedule from the next batch on: (h, w), a ``MultiScale`` or a
        ``StepSizes``."""
        self._check_open()
        sizes: SizeSchedule = self._engine.call(self._engine.size_schedule)
        return sizes if isinstance(sizes, MultiScale | StepSizes) else sizes.hw

    def rebuild(self, manifest: dict[str, Any]) -> Batch:
        """The batch ``manifest`` (a ``batch.manifest``) names, composed again: bit-identical
        images, boxes, labels, indices and mode, on any client of servers with the same
        dataset, without touching this client's epoch, mode or control values (the batch
        is composed with the manifest's own values). Raises ``ValueError`` for a manifest
        that is not one (naming the field) or is of another dataset, and
        ``DataServerError`` as ``next()`` would."""
        self._check_open()
        self._check_dataset(manifest)
        plan, values, on_error = plan_of(manifest, self.dataset_len)
        for key, hw in (("image_size", plan.sizes.fit), ("source_size", plan.sizes.stored)):
            problem = self._side_problem([hw])
            if problem is not None:
                raise ValueError(f"manifest {key!r}: {problem}")
        future = self._engine.call(self._engine.rebuild, plan, values, on_error)
        deadline = time.monotonic() + self.config.timeout + 10.0
        while True:
            try:
                delivery = future.result(0.25)
                break
            except TimeoutError:
                if not self._engine.is_alive():
                    raise self._engine.dead_error() from None
                if time.monotonic() > deadline:
                    self._engine.call(self._engine.abandon_rebuild, future)
                    raise DataServerError(
                        f"rebuild of epoch {plan.epoch} step {plan.step}: no answer within "
                        f"{self.config.timeout + 10.0:g} s"
                    ) from None
        batch: Batch = self._engine.hand_over(delivery)
        # Named as the manifest names it: its layout and control_seq, not this client's.
        named = {key: manifest[key] for key in ("stitch_layout", "stitch_k", "control_seq")}
        for key, absent in (("mosaic_partners", "consume"), ("mosaic_p", 1.0)):
            named[key] = manifest.get(key, absent)
        return dataclasses.replace(
            batch, manifest={**batch.manifest, **named, "fingerprint": self.fingerprint}
        )

    def _check_dataset(self, manifest: Any) -> None:
        """A manifest must name this client's dataset: without its fingerprint, another
        dataset's manifest would be composed from this one's samples."""
        if not isinstance(manifest, dict):
            return  # (``plan_of`` says what it is not)
        if "fingerprint" not in manifest:
            raise ValueError(
                "manifest has no 'fingerprint': a batch.manifest names the dataset it is of"
            )
        if manifest["fingerprint"] != self.fingerprint:
            raise ValueError(
                f"manifest is of dataset {manifest['fingerprint']!r}; the servers serve "
                f"{self.fingerprint!r}"
            )

    def control(self, **values: Any) -> None:
        """Send values to the dataset's ``set_control(values)`` on every server; every
        sample of the next batch is built after it received them. The dataset receives all
        values sent so far, the latest for each key."""
        problem = control_problem(values)
        if problem is not None:  # what the servers would refuse, refused here, at the call
            raise ValueError(f"DataServerClient.control: {problem}")
        self._steer(self.mode, values)

    def _steer(self, mode: str, control: dict[str, Any] | None) -> None:
        self._check_open()
        self._feedback_seq += 1
        # (Mode steers that come often also arm the lookahead: the next batch is kept ready
        # in the other mode too; a trainer that steers rarely pays nothing for it.)
        self._engine.call(self._engine.steer, mode, control)

    # ------------------------------------------------------------ state

    def state_dict(self, *, gather: bool | None = None) -> dict[str, Any]:
        """Plain data (msgpack- and torch.save-able) to resume from: the samples not yet
        handed out, in the same order, in the same mode and with the same feedback_seq.

        A sample counts as handed out once ``next()`` has returned its batch on this rank
        before this call. With torch.distributed initialised over this client's ranks
        (``gather=None``: when its world size is the client's and above 1; ``True``:
        required), this is a **collective call**: every rank calls it, as for a DDP
        checkpoint, and each rank's state then also holds every rank's position, step,
        mode, control values and feedback_seq (``"ranks"``), so any rank's state resumes
        the whole job, on any number of ranks (``load_state_dict``). ``gather=False``:
        this rank's state only (not a collective; resume it at the same world size, or
        combine the ranks' states with ``merge_states``).
        """
        self._check_open()
        snap: Position = self._engine.call(self._engine.snapshot)
        legacy = self._legacy
        if not self._active:  # what the next iteration would do
            where = self._resume or Resume(self._epoch, 0, 0, None)
            legacy = where.legacy
            deal = None if where.deal is None else where.deal.to_state()
            snap = dataclasses.replace(
                snap, epoch=where.epoch, position=where.position, step=where.step, deal=deal
            )
        where_state = {
            "epoch": snap.epoch,
            "position": snap.position,
            "step": snap.step,
            "mode": snap.mode,
            "control": snap.control,
            "control_seq": snap.control_seq,
            "deal": snap.deal,
            "image_size": snap.image_size,
        }
        state: dict[str, Any] = {
            "version": version_of(snap.deal is not None, legacy),
            "dataset_len": self.dataset_len,
            "fingerprint": self.fingerprint,
            "feedback_seq": self._feedback_seq,
            **{k: getattr(self.config, k) for k in ("rank", "world_size", *CONFIG_KEYS)},
            **where_state,
        }
        if self._gathering(gather):
            state["ranks"] = gather_ranks(state, self.config.device)
        return state

    def _gathering(self, gather: bool | None) -> bool:
        if gather is False:
            return False
        cfg = self.config
        ours = cfg.world_size > 1 and in_process_group(cfg.rank, cfg.world_size)
        if gather and not ours:
            raise ValueError(
                "state_dict(gather=True) needs torch.distributed initialised with this "
                f"client's rank {cfg.rank} of world_size {cfg.world_size}"
            )
        return ours

    @staticmethod
    def merge_states(states: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """One state for the whole job from the states of all its ranks (one each, any
        order, taken without torch.distributed): what ``load_state_dict`` needs to resume
        on another number of ranks. They must be of one epoch and one configuration."""
        return merge_states(states)

    def load_state_dict(self, state: dict[str, Any] | Sequence[dict[str, Any]]) -> None:
        """Continue where ``state`` was taken: the next iteration yields exactly the
        remaining batches of its epoch.

        ``state`` saved by a job of the same world size: this rank goes on from its own
        position (its own state, or its entry of a job-wide one), batch for batch as an
        unbroken run would. Saved by a job of another world size (elastic resume; a
        job-wide state: gathered by ``state_dict`` under torch.distributed, merged by
        ``merge_states``, or a list of every rank's state, or a world_size 1 state): the
        samples the old job had not delivered, in epoch order, are dealt round-robin to the
        new ranks (rank j takes the j-th, (j+M)-th, ...), each exactly once, nothing padded,
        in rank 0's mode and control values; the epoch after it is a normal epoch. Ranks
        may then hold one sample more than others: it rides in their last batch, so every
        rank ends the epoch on the same step as long as the ranks take the same modes
        (``feedback(sync=True)``) and at least one sample per rank is left.
        A state of other data, another seed or another batch configuration is refused.
        """
        self._check_open()
        job = state if isinstance(state, dict) else merge_states(state)
        check_state(job, self._identity())
        where = plan_resume(job, self.config.rank, self.config.world_size)
        self._engine.call(
            self._engine.restore,
            where["mode"],
            where["control"],
            where["control_seq"],
            where["image_size"],
        )
        self._feedback_seq = where["feedback_seq"]
        self._epoch = where["epoch"]
        self._active = False
        self._resume = Resume(
            where["epoch"], where["position"], where["step"], where["deal"], where["legacy"]
        )

    def _identity(self) -> dict[str, Any]:
        """What a state must match to be loaded here."""
        return {
            **{k: getattr(self.config, k) for k in CONFIG_KEYS},
            "fingerprint": self.fingerprint,
            "dataset_len": self.dataset_len,
        }

    def stats(self) -> dict[str, Any]:
        """Client-side counters: tasks per server, late (superseded) results, re-issues;
        and what the trainer sees: ``data_wait`` (the time each ``next()`` waited for its
        batch: ``count``, ``sum_s``, ``p50_ms``/``p90_ms``/``p99_ms`` over the latest 1024,
        cumulative ``buckets``), ``samples_per_s`` (``recent``: over the last 10 s,
        ``epoch``: since this epoch's ``iter()``) and ``metrics_port`` (None: not served)."""
        self._check_open()
        return {**self._engine.call(self._engine.stats), **self._metrics.summary()}

    # ------------------------------------------------------------ lifetime

    def _check_open(self) -> None:
        """Raise at once when the client is closed, or its I/O thread has died (with the
        reason it died), instead of waiting for an answer that cannot come."""
        if self._closed:
            raise DataServerError("the client is closed")
        if not self._engine.is_alive():
            self._active = False
            raise self._engine.dead_error()

    def close(self) -> None:
        """Say BYE to every server, stop the I/O thread, close every socket."""
        self._closed = True
        self._active = False
        self._finalizer()
        self._metrics_finalizer()

    def __enter__(self) -> DataServerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class EpochIterator:
    """The iterator of one epoch of a ``DataServerClient`` (what ``iter(client)`` returns)."""

    def __init__(self, client: DataServerClient, generation: int) -> None:
        self._client = client
        self._generation = generation

    def __iter__(self) -> EpochIterator:
        return self

    def __next__(self) -> Batch:
        return self._client._next(self._generation)


def iterate_epochs(client: DataServerClient, first_epoch: int = 0) -> Iterator[Batch]:
    """Batches without end: each epoch in turn, ``set_epoch`` called at every boundary."""
    epoch = first_epoch
    while True:
        client.set_epoch(epoch)
        yield from client
        epoch += 1


def _load_curve(
    server_key: str | bytes | None, secret_key: str | bytes | None
) -> dict[str, bytes] | None:
    if server_key is None and secret_key is None:
        return None
    if server_key is None or secret_key is None:
        raise ValueError("curve_server_key and curve_secret_key go together")
    from dataserver.security import client_curve_keys

    return client_curve_keys(server_key, secret_key)
