"""MMEngine (and so MMDetection) training from dataserver, with feedback that works.

The problem this project exists for was met in OpenMMLab training: a hook decides in
``after_train_iter`` that the next batch should be stitched and sets a flag on
``runner.train_dataloader.dataset``, and with ``num_workers > 0`` no worker sees it before
the next epoch. Here the flag travels to the servers, and the next batch honours it::

    from dataserver_client import DataServerClient
    from dataserver_client.integrations.mmengine import DataServerLoader

    client = DataServerClient("tcp://data-0:5555", batch_size=2, image_size=(800, 1344))
    cfg.train_dataloader = DataServerLoader(client, metainfo=dict(classes=CLASSES))
    cfg.custom_hooks = [dict(type="StitcherFeedbackHook")]  # or dict(type="DataServerHook")
    runner = Runner.from_cfg(cfg)

- ``DataServerLoader`` is what ``EpochBasedTrainLoop`` and ``IterBasedTrainLoop`` iterate:
  batches in MMEngine's data format, a ``sampler`` whose ``set_epoch`` MMEngine's
  ``DistSamplerSeedHook`` calls, a ``dataset`` with ``metainfo``.
- ``StitcherFeedbackHook`` (``DataServerHook`` plus Stitcher's rule) calls
  ``loader.client.feedback(outputs[ratio_key])`` after every iteration; the next batch,
  on every rank, has the mode it decided.
- Any other hook steers the servers' dataset with ``client.control``, where a
  ``DataLoader`` user would have set an attribute on the dataset (which workers never
  see)::

      @HOOKS.register_module()
      class ActivateHook(Hook):
          def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None):
              if runner.iter == 1000:
                  # was: runner.train_dataloader.dataset.active = True
                  runner.train_dataloader.client.control(active=True)
              if should_regenerate(outputs):
                  # was: runner.train_dataloader.dataset.regenerate()
                  runner.train_dataloader.client.control(regenerate=runner.iter)

  and the dataset served by ``dataserver serve --dataset mypkg.mod:factory`` acts on them
  in ``set_control``, which every worker calls before it builds any sample of the next
  batch::

      def set_control(self, values):
          self.active = bool(values.get("active", False))
          if values.get("regenerate") != self.generation:  # values keep the latest per key
              self.generation = values.get("regenerate")
              self.regenerate()

- Multi-scale: a client built with ``image_size=MultiScale(sizes, every=n)`` is passed
  through as it is; each batch arrives at its scheduled size and its data samples'
  ``img_shape``, ``pad_shape`` and ``batch_input_shape`` are that size (``batch.image_size``),
  so no ``BatchSyncRandomResize`` is needed (and none should resize them again).
- Mosaic and close-mosaic: with ``stitch_layout="mosaic"``, ``CloseMosaicHook(close_epoch,
  mosaic_from_start=True)`` trains on mosaics until ``close_epoch`` and on regular batches
  from it on (Ultralytics' ``close_mosaic``; YOLOX's ``no_aug_epochs``)::

      client = DataServerClient(..., stitch_layout="mosaic")
      cfg.custom_hooks = [dict(type="DataServerHook"),
                          dict(type="CloseMosaicHook", close_epoch=max_epochs - 15,
                               mosaic_from_start=True)]

- Checkpoints: ``DataServerHook`` (and so ``StitcherFeedbackHook``) writes the loader's
  state into every MMEngine checkpoint (``checkpoint["dataserver"]``) and, under
  ``resume=True``, restores it, so a resumed run goes on mid-epoch with exactly the
  samples not yet trained on, in the same mode, with the same control values.

  MMEngine 0.10 cannot resume its own checkpoints under torch >= 2.6 (``torch.load`` now
  defaults to ``weights_only=True`` and refuses MMEngine's ``HistoryBuffer``:
  open-mmlab/mmengine#1655). While the Runner loads its checkpoint, the hook allows the
  few globals MMEngine writes (``mmengine_checkpoint_globals()``) and no others; pass
  ``DataServerHook(allow_mmengine_globals=False)`` to leave ``torch.load`` alone.

Just over the house's ~500 lines: the MMEngine integration's loader, hooks and batch
conversion, which follow MMEngine's API together.
"""

from __future__ import annotations

import builtins
import importlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from mmengine.hooks import Hook
from mmengine.registry import HOOKS
from mmengine.structures import BaseDataElement, InstanceData

from dataserver_client.batch import Batch
from dataserver_client.client import DataServerClient
from dataserver_client.plan.resume import RANK_KEYS
from dataserver_client.plan.sizes import MultiScale, StepSizes

log = logging.getLogger("dataserver_client")

CHECKPOINT_KEY = "dataserver"
LOADER_STATE_VERSION = 1

DataBatch = dict[str, list[Any]]


def as_data_batch(batch: Batch, sample_type: type = BaseDataElement) -> DataBatch:
    """A ``Batch`` in MMEngine's data format: ``{"inputs": [uint8 (3, H, W) tensors],
    "data_samples": [sample_type]}``, one entry per output image.

    Each data sample carries ``gt_instances`` (``InstanceData``: ``bboxes`` float32 (M, 4)
    xyxy in the image's pixels, ``labels`` int64 (M,)) and the metainfo an mmdet model
    reads: ``img_shape``, ``ori_shape``, ``pad_shape`` and ``batch_input_shape`` (all (H, W)
    of this image, which every image of the batch has: boxes are already in its pixels, so
    nothing is to be rescaled or padded), ``scale_factor`` (1.0, 1.0) and ``flip`` False
    (augmentation is baked into pixels and boxes on the servers), plus this project's
    ``mode``, ``indices`` (the dataset indices the image was made from), ``epoch``, ``step``,
    ``feedback_seq`` and ``image_size`` (``batch.image_size``). The shapes follow each batch:
    under a ``MultiScale`` schedule they are ``batch.image_size``, the size of that batch
    (with ``stitch_layout="batch"`` in stitch mode, the size of its cut images). The tensors
    are views of the batch's, on the client's device.
    """
    inputs = list(batch.images.unbind(0))
    shape = (int(batch.images.shape[-2]), int(batch.images.shape[-1]))
    samples = []
    for target, indices in zip(batch.targets, batch.indices, strict=True):
        sample: BaseDataElement = sample_type(
            metainfo={
                "img_shape": shape,
                "ori_shape": shape,
                "pad_shape": shape,
                "batch_input_shape": shape,
                "scale_factor": (1.0, 1.0),
                "flip": False,
                "flip_direction": None,
                "mode": batch.mode,
                "indices": list(indices),
                "epoch": batch.epoch,
                "step": batch.step,
                "feedback_seq": batch.feedback_seq,
                "image_size": (int(batch.image_size[0]), int(batch.image_size[1])),
            }
        )
        sample.gt_instances = InstanceData(bboxes=target["boxes"], labels=target["labels"])
        samples.append(sample)
    return {"inputs": inputs, "data_samples": samples}


def default_sample_type() -> type:
    """mmdet's ``DetDataSample`` where mmdet is importable, else ``BaseDataElement``."""
    try:
        from mmdet.structures import DetDataSample
    except Exception:  # absent, or present but broken (an mmcv mismatch): go without it
        return BaseDataElement
    return DetDataSample


class ServedDataset:
    """What ``loader.dataset`` is: the size of the served dataset and its ``metainfo``.

    The samples live on the servers; steer them with ``loader.client.control(...)``.
    """

    def __init__(self, client: DataServerClient, metainfo: dict[str, Any] | None) -> None:
        self._client = client
        self.metainfo: dict[str, Any] = dict(metainfo or {})

    def __len__(self) -> int:
        return self._client.dataset_len

    def __getitem__(self, index: int) -> Any:
        raise TypeError(
            "the samples of a DataServerLoader are built on the servers: iterate the loader, "
            "and steer the servers' dataset with loader.client.control(...)"
        )


class EpochSampler:
    """What ``loader.sampler`` is: ``set_epoch`` reaches ``client.set_epoch`` (MMEngine's
    ``DistSamplerSeedHook`` calls it before every epoch). Ignored while the loader runs
    under ``IterBasedTrainLoop`` with a ``DataServerHook``, where the loader moves from
    epoch to epoch itself (and MMEngine's own count restarts at 0 after a resume)."""

    def __init__(self, loader: DataServerLoader) -> None:
        self._loader = loader

    def set_epoch(self, epoch: int) -> None:
        if not self._loader.endless:
            self._loader.client.set_epoch(epoch)

    def __len__(self) -> int:
        return self._loader.client.num_samples


class DataServerLoader:
    """A ``DataServerClient`` as the ``train_dataloader`` of an MMEngine ``Runner``.

    Iterating it runs one epoch of ``client`` (the epoch ``sampler.set_epoch`` set, or the
    rest of a restored one) and yields each batch as ``as_data_batch`` converts it. When an
    epoch ends the loader moves the client to the next epoch, so a checkpoint taken between
    epochs resumes at the start of the next one. ``len(loader)`` is ``len(client)``: the
    batches of the epoch if the mode does not change again. ``metainfo`` becomes
    ``loader.dataset.metainfo`` (an mmdet model wants ``classes`` there).

    Pass the client you built; the loader does not close it. A client built with
    ``image_size=MultiScale(...)`` (or ``stitch_layout="mosaic"``) is used as it is: every
    batch comes at its scheduled size, and the data samples' shapes say it (see
    ``as_data_batch``). With ``DataServerHook`` (or ``StitcherFeedbackHook``) registered,
    its state rides in MMEngine's checkpoints.

    ``on_epoch(callback)``: ``callback`` is called with the epoch number just before the
    loader starts serving that epoch (before its first batch is planned), what
    ``CloseMosaicHook`` uses under ``IterBasedTrainLoop``.
    """

    def __init__(
        self,
        client: DataServerClient,
        metainfo: dict[str, Any] | None = None,
        *,
        sample_type: type | None = None,
    ) -> None:
        if not isinstance(client, DataServerClient):
            raise TypeError(f"DataServerLoader wraps a DataServerClient, got {type(client)!r}")
        self.client = client
        self.dataset = ServedDataset(client, metainfo)
        self.sampler = EpochSampler(self)
        self.batch_size = client.config.batch_size
        self.sample_type = sample_type or default_sample_type()
        self.endless = False  # set by ``serve_endless`` (DataServerHook, IterBasedTrainLoop)
        self._epoch_callbacks: list[Callable[[int], None]] = []

    def __len__(self) -> int:
        return len(self.client)

    def __iter__(self) -> Iterator[DataBatch]:
        # A generator: the epoch starts at the first next(), not here. IterBasedTrainLoop
        # calls iter() when it is built, before a checkpoint is loaded.
        return self._epoch()

    def on_epoch(self, callback: Callable[[int], None]) -> None:
        """Call ``callback(epoch)`` just before each epoch starts (once, however often it
        is given)."""
        if callback not in self._epoch_callbacks:
            self._epoch_callbacks.append(callback)

    def _epoch(self) -> Iterator[DataBatch]:
        for callback in self._epoch_callbacks:
            callback(self.client.epoch)
        for batch in self.client:
            yield as_data_batch(batch, self.sample_type)
        self.client.set_epoch(self.client.epoch + 1)

    def serve_endless(self, skip: int = 0) -> Iterator[DataBatch | None]:
        """From now on the loader moves from epoch to epoch itself (the sampler's
        ``set_epoch`` is ignored): ``endless_batches(skip)``, for ``IterBasedTrainLoop``."""
        self.endless = True
        return self.endless_batches(skip)

    def endless_batches(self, skip: int = 0) -> Iterator[DataBatch | None]:
        """Every epoch in turn, without end (what ``IterBasedTrainLoop`` wants). The first
        ``skip`` items are ``None`` and cost nothing: after a resume the loop draws and
        drops as many batches as it had trained on, which the restored state has already
        left out."""
        for _ in range(skip):
            yield None
        empty = 0
        while True:
            delivered = 0
            for data in self._epoch():
                delivered += 1
                yield data
            empty = 0 if delivered else empty + 1
            if empty > 1:  # one empty epoch is a resume at an epoch's end; two is no data
                raise RuntimeError("the served dataset gives this rank no batches")

    def state_dict(self) -> dict[str, Any]:
        """The client's state: the samples not yet handed to the trainer, the mode, the
        control values (plain data, saved in MMEngine checkpoints by ``DataServerHook``).

        Job-wide without a collective call: MMEngine saves checkpoints on rank 0 only (a
        gather there would hang the other ranks), and the ranks of a run step in lockstep
        (equal shares of the epoch, one averaged decision), so rank 0's position, step,
        mode and control values are every rank's. Such a state resumes on the same number
        of ranks or, dealt by ``DataServerClient.load_state_dict``, on another.
        """
        state = self.client.state_dict(gather=False)
        world = self.client.config.world_size
        if world > 1:
            entry = {k: state[k] for k in RANK_KEYS}
            state["ranks"] = [dict(entry) for _ in range(world)]
        return {"version": LOADER_STATE_VERSION, "client": state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on where ``state`` was taken (see ``DataServerClient.load_state_dict``)."""
        if not isinstance(state, dict) or state.get("version") != LOADER_STATE_VERSION:
            raise ValueError(f"not a DataServerLoader state of version {LOADER_STATE_VERSION}")
        self.client.load_state_dict(state["client"])

    def __deepcopy__(self, memo: dict[int, Any]) -> DataServerLoader:
        # Runner.from_cfg deep-copies its config: a live connection is shared, not copied.
        return self

    def __repr__(self) -> str:
        # A Python expression, so a Runner can dump a config that holds the loader.
        cfg = self.client.config
        sizes = cfg.sizes
        size = sizes if isinstance(sizes, MultiScale | StepSizes) else sizes.hw
        return (
            f"DataServerLoader(DataServerClient({list(cfg.addresses)!r}, "
            f"batch_size={cfg.batch_size}, image_size={size!r}))"
        )


@HOOKS.register_module(force=True)
class DataServerHook(Hook):
    """Ties a ``DataServerLoader`` to the Runner's checkpoints and loops.

    - ``before_save_checkpoint``: ``checkpoint["dataserver"] = loader.state_dict()``.
    - On ``resume=True`` (a checkpoint whose progress the runner took over), the loader's
      state is restored before training starts: the run continues with exactly the
      remaining samples of the epoch, in the same mode. ``load_from`` alone (weights only)
      leaves the loader alone.
    - Under ``IterBasedTrainLoop`` the loader runs epoch after epoch by itself, and the
      batches the loop draws and drops after a resume are not taken from the servers.
    """

    priority = "NORMAL"  # before CheckpointHook (VERY_LOW): the state holds this step's decision

    def __init__(self, allow_mmengine_globals: bool = True) -> None:
        self.allow_mmengine_globals = allow_mmengine_globals
        self._restore: tuple[dict[str, Any], int, int] | None = None
        self._load_window: Any = None

    def before_run(self, runner: Any) -> None:
        # Runner.train calls load_or_resume right after before_run, and before_train after
        # it: the window in which MMEngine's own checkpoint is read.
        serialization = torch.serialization
        if self.allow_mmengine_globals and hasattr(serialization, "safe_globals"):
            self._load_window = serialization.safe_globals(mmengine_checkpoint_globals())
            self._load_window.__enter__()

    def _close_load_window(self) -> None:
        if self._load_window is not None:
            window, self._load_window = self._load_window, None
            window.__exit__(None, None, None)

    def after_run(self, runner: Any) -> None:
        self._close_load_window()

    def before_save_checkpoint(self, runner: Any, checkpoint: dict[str, Any]) -> None:
        checkpoint[CHECKPOINT_KEY] = self.loader(runner).state_dict()

    def after_load_checkpoint(self, runner: Any, checkpoint: dict[str, Any]) -> None:
        # Runner.resume calls this before it takes over the checkpoint's epoch and iter;
        # before_train tells a resume from a load_from by whether it did.
        state = checkpoint.get(CHECKPOINT_KEY)
        meta = checkpoint.get("meta", {})
        if state is not None:
            self._restore = (state, int(meta.get("epoch", -1)), int(meta.get("iter", -1)))

    def before_train(self, runner: Any) -> None:
        self._close_load_window()
        loader = self.loader(runner)
        if self._restore is not None:
            state, epoch, it = self._restore
            self._restore = None
            if runner.iter == it and runner.epoch == epoch and it > 0:
                loader.load_state_dict(state)
                log.info("dataserver: resumed the loader at iter %d", it)
        from mmengine.runner import IterBasedTrainLoop

        loop = runner.train_loop
        if isinstance(loop, IterBasedTrainLoop):
            if not hasattr(loop, "dataloader_iterator"):
                raise RuntimeError("this MMEngine's IterBasedTrainLoop has no dataloader_iterator")
            loop.dataloader_iterator = loader.serve_endless(skip=runner.iter)

    @staticmethod
    def loader(runner: Any) -> DataServerLoader:
        """The runner's ``DataServerLoader`` (a clear error when it has another loader)."""
        loader = runner.train_loop.dataloader
        if not isinstance(loader, DataServerLoader):
            raise TypeError(
                f"{type(runner).__name__}.train_dataloader is a {type(loader).__name__}, "
                "not a DataServerLoader"
            )
        return loader


@HOOKS.register_module(force=True)
class StitcherFeedbackHook(DataServerHook):
    """Stitcher's feedback from the model's outputs to the next batch.

    After every training iteration: ``ratio = outputs[ratio_key]`` (the model's log vars:
    return it from the model's loss dict under a key without "loss" in it, as a float or a
    0-d tensor; ``dataserver_client.stitcher.small_object_loss_ratio`` computes it from the
    per-match regression losses and the matched ground-truth areas), then
    ``loader.client.feedback(ratio)``: the next batch is stitched iff ``ratio <
    stitch_threshold``. With torch.distributed the ratio is averaged over ranks first, so
    the decision taken at iteration t is the mode of iteration t + 1 on every rank. The
    decision is logged as ``next_stitch`` (1.0 or 0.0). Checkpoints as ``DataServerHook``.
    """

    def __init__(self, ratio_key: str = "small_object_ratio") -> None:
        super().__init__()
        self.ratio_key = ratio_key

    def after_train_iter(
        self,
        runner: Any,
        batch_idx: int,
        data_batch: Any = None,
        outputs: dict[str, Any] | None = None,
    ) -> None:
        if not outputs or self.ratio_key not in outputs:
            have = sorted(outputs or {})
            raise KeyError(
                f"StitcherFeedbackHook: the model's outputs have no {self.ratio_key!r} "
                f"(they have {have}); return the small-object loss ratio from the model's "
                "loss dict under that key (see dataserver_client.stitcher)"
            )
        ratio = to_float(outputs[self.ratio_key])
        mode = self.loader(runner).client.feedback(ratio)
        runner.message_hub.update_scalar("train/next_stitch", float(mode == "stitch"))


@HOOKS.register_module(force=True)
class CloseMosaicHook(Hook):
    """Close-mosaic (Ultralytics' ``close_mosaic``, YOLOX's ``no_aug_epochs``): mosaics
    until epoch ``close_epoch``, regular batches from it on, for a loader whose client has
    ``stitch_layout="mosaic"``.

    Guarantee (no other hook setting the mode): every batch of an epoch >= ``close_epoch``
    is regular; with ``mosaic_from_start=True`` every batch of an earlier epoch is a mosaic
    (otherwise the mode of earlier epochs is left to whatever else sets it). The
    switch is ``loader.client.set_mode(...)`` before the epoch's first batch is planned, so
    that batch honours it; no loader is rebuilt and no worker is restarted.

    Under ``EpochBasedTrainLoop`` the mode is set in ``before_train_epoch`` from
    ``runner.epoch``; under ``IterBasedTrainLoop`` (where ``runner.epoch`` stays 0 and the
    loader moves from epoch to epoch itself) at the start of every epoch the loader serves,
    from that epoch's number. A resumed run gets the mode of the epoch it resumes in.
    Register it with ``DataServerHook`` for checkpoints; not with ``StitcherFeedbackHook``,
    whose feedback would set the mode again after every iteration (refused in
    ``before_train``).
    """

    priority = "NORMAL"

    def __init__(self, close_epoch: int, mosaic_from_start: bool = False) -> None:
        if isinstance(close_epoch, bool) or not isinstance(close_epoch, int) or close_epoch < 0:
            raise ValueError(
                f"CloseMosaicHook: close_epoch must be an int >= 0, got {close_epoch!r}"
            )
        self.close_epoch = close_epoch
        self.mosaic_from_start = bool(mosaic_from_start)
        self._by_loader = False  # IterBasedTrainLoop: the loader's epoch callback sets the mode
        self._client: DataServerClient | None = None

    def mode_of(self, epoch: int) -> str | None:
        """The mode this hook gives ``epoch`` (None: it leaves that epoch's mode alone)."""
        if epoch >= self.close_epoch:
            return "regular"
        return "stitch" if self.mosaic_from_start else None

    def before_train(self, runner: Any) -> None:
        from mmengine.runner import IterBasedTrainLoop

        loader = DataServerHook.loader(runner)
        layout = loader.client.config.stitch_layout
        if layout != "mosaic":
            raise ValueError(
                f"CloseMosaicHook needs a client built with stitch_layout='mosaic', not {layout!r}"
            )
        if any(isinstance(hook, StitcherFeedbackHook) for hook in runner.hooks):
            raise ValueError(
                "CloseMosaicHook and StitcherFeedbackHook both set the mode: register "
                "DataServerHook (checkpoints) with CloseMosaicHook instead"
            )
        self._by_loader = isinstance(runner.train_loop, IterBasedTrainLoop)
        if self._by_loader:
            loader.on_epoch(self._on_epoch)
        self._client = loader.client

    def _on_epoch(self, epoch: int) -> None:
        mode = self.mode_of(epoch)
        if mode is not None and self._client is not None:
            self._client.set_mode(mode)

    def before_train_epoch(self, runner: Any) -> None:
        if not self._by_loader:
            self._client = DataServerHook.loader(runner).client
            self._on_epoch(runner.epoch)


def mmengine_checkpoint_globals() -> list[Any]:
    """What an MMEngine 0.10 checkpoint pickles besides tensors and plain data: the
    message hub's ``HistoryBuffer`` (with its numpy arrays and scalars of numeric dtypes,
    and its bound statistics methods, pickled through ``getattr``)."""
    import numpy as np
    from mmengine.logging import HistoryBuffer

    try:
        multiarray = importlib.import_module("numpy._core.multiarray")  # numpy >= 2
    except ImportError:
        multiarray = importlib.import_module("numpy.core.multiarray")
    return [
        HistoryBuffer,
        builtins.getattr,
        np.ndarray,
        np.dtype,
        multiarray._reconstruct,
        multiarray.scalar,
        *(type(np.dtype(code)) for code in "?bBhHiIlLqQefdg"),
    ]


def to_float(value: Any) -> float:
    """A float or a one-element tensor as a float (NaN stays NaN: it keeps regular mode)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"the ratio must be one value, got a tensor of shape {tuple(value.shape)}"
            )
        return float(value.detach().item())
    return float(value)
