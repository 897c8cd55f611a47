"""PyTorch Lightning training from dataserver: a ``LightningDataModule`` whose checkpoints
resume mid-epoch exactly.

::

    from dataserver_client.integrations.lightning import DataServerDataModule

    dm = DataServerDataModule("tcp://data-0:5555", val="tcp://data-val:5555",
                              batch_size=16, image_size=(512, 512))
    trainer = pl.Trainer(strategy="ddp", devices=4, max_epochs=12)
    trainer.fit(model, datamodule=dm)                        # batches are ``Batch`` objects
    trainer.fit(model, datamodule=dm, ckpt_path="last.ckpt")  # goes on where it stopped

- ``setup()`` builds the clients once Lightning's process group exists, so every rank
  takes its own shard (rank and world size from torch.distributed) and batches land on
  the rank's device (``trainer.strategy.root_device`` unless ``device`` is given);
  ``teardown()`` closes them. ``dm.client`` is the training client: steer it there
  (``dm.client.feedback(ratio)``, ``set_mode``, ``control``) from the LightningModule.
- ``train_dataloader()``/``val_dataloader()`` yield the clients' ``Batch`` objects. Their
  length is known and fixed for the epoch (so Lightning's fetcher prefetches nothing: the
  batches a checkpoint counts are the batches the model took), the epoch comes from
  Lightning (``loader.sampler.set_epoch``), and an iterator starts its epoch at its first
  ``next()``, never at ``iter()`` (Lightning calls ``iter()`` early, for checks and for
  ``estimated_stepping_batches``).
- ``state_dict()``/``load_state_dict()``: the training client's state rides in every
  Lightning checkpoint (``checkpoint["DataServerDataModule"]``); ``Trainer.fit(ckpt_path=...)``
  continues the interrupted epoch with exactly the samples it had not trained on, on every
  rank, in the same mode with the same control values.
- Lightning issue #20550 (a stateful loader's state is dropped when
  ``trainer.estimated_stepping_batches`` is read in ``configure_optimizers``: Lightning
  builds the loader before it restores the loops) does not reach this state: Lightning
  restores a DataModule before ``configure_optimizers``, and the loader iterators made
  early start their epoch only at their first ``next()``, after the restore. (The loaders
  have an empty ``state_dict`` of their own, only so that Lightning knows them resumable.)
- Lengths: ``len(train_dataloader())`` counts the epoch as if every batch were regular;
  stitched batches (``stitch_layout`` with k samples an output) end it sooner and the rest
  of it is ``None`` (see ``ServedEpoch``), so ``estimated_stepping_batches`` is an upper
  bound then. ``mosaic_partners="window"`` epochs are as long in either mode.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import pytorch_lightning as pl
import torch

from dataserver_client.batch import Batch
from dataserver_client.client import DataServerClient, EpochIterator
from dataserver_client.errors import DataServerError
from dataserver_client.plan.sizes import MultiScale, StepSizes

log = logging.getLogger("dataserver_client")

STATE_VERSION = 1

Address = str | Sequence[str]


class EpochSampler:
    """What ``loader.sampler`` is: Lightning calls ``set_epoch`` on it before every
    training epoch (with ``trainer.current_epoch``), which reaches the loader."""

    def __init__(self, loader: ServedLoader) -> None:
        self._loader = loader

    def set_epoch(self, epoch: int) -> None:
        self._loader.set_epoch(epoch)


class ServedLoader:
    """What ``train_dataloader()``/``val_dataloader()`` return: an iterable over the
    batches of one epoch of ``client``, for Lightning's loops.

    Training (``train=True``): ``len()`` is the number of batches of the epoch the next
    iteration runs, counted as if each batch not yet handed out were regular (the most a
    mode change can leave), including those a resumed state had already delivered (as
    Lightning counts them); it stays fixed while the epoch runs. Stitched batches (which
    consume k samples an image) end the epoch sooner; the items left are then ``None``
    (see ``ServedEpoch``). After an epoch's last batch, the client is moved to the next
    epoch, so a checkpoint taken at an epoch's end resumes at the start of the next one.

    Validation (``train=False``): every iteration is a whole pass of epoch 0 from its
    start (Lightning's sanity check and a validation run stopped by ``limit_val_batches``
    leave no trace), and ``set_epoch`` is ignored: each validation sees the same batches.
    """

    def __init__(self, client: DataServerClient, *, train: bool, window: int = 1) -> None:
        if window < 1:
            raise ValueError(f"ServedLoader: window must be >= 1, got {window}")
        self.client = client
        self.train = train
        self.window = int(window)  # training epochs: a whole number of these batches
        self.batch_size = client.config.batch_size
        self.sampler = EpochSampler(self)
        self.batch_sampler = None  # (Lightning looks for one beside the sampler)
        self._epoch = 0
        self._length: int | None = None  # fixed while an epoch runs
        self._resumed = False  # the client holds a loaded state the next epoch goes on from
        self._generation = 0
        self._cut = False  # the running epoch leaves a partial window of the client's out
        self._ahead: EpochIterator | None = None  # the next epoch, started when one was cut

    def __len__(self) -> int:
        return self._length if self._length is not None else self.planned()[0]

    def planned(self) -> tuple[int, int]:
        """(batches of the epoch the next iteration runs if every batch left is regular,
        batches of it already delivered: a loaded state's step, else 0). Training with a
        ``window``: the count rounded down to a whole number of windows."""
        total, step = self._counted()
        if self.train and self.window > 1:
            total -= total % self.window  # the partial last window is not served
        return total, step

    def _counted(self) -> tuple[int, int]:
        cfg = self.client.config
        share, position, step = self.client.num_samples, 0, 0
        if self._resumed:
            state = self.client.state_dict(gather=False)  # not active: the loaded position
            if state["deal"] is not None:  # an elastic resume: the client counts its deal
                return len(self.client), int(state["step"])
            position, step = int(state["position"]), int(state["step"])
        left = max(0, share - position)
        per = cfg.batch_size
        return step + (left // per if cfg.drop_last else -(-left // per)), step

    def set_epoch(self, epoch: int) -> None:
        if not self.train:
            return
        if self._resumed and epoch != self.client.epoch:
            self._resumed = False  # the client discards the loaded state (and says so)
        self._epoch = int(epoch)
        self.client.set_epoch(self._epoch)

    def resumed(self) -> None:
        """The client was given a state: the next epoch goes on from it."""
        self._resumed = True
        self._ahead = None
        self._epoch = self.client.epoch

    def __iter__(self) -> ServedEpoch:
        # Lightning reads len() right after iter(): it must be the coming epoch's.
        self._length = None
        self._generation += 1
        return ServedEpoch(self, self._generation)

    def start(self, generation: int) -> tuple[EpochIterator, int, int]:
        """Start the client's epoch: (its iterator, ``len()``, batches already delivered)."""
        if generation != self._generation:
            raise DataServerError("this loader iterator was superseded by a later iter(loader)")
        if self.train:
            self._length, first = self.planned()
            self._cut = self._counted()[0] > self._length
            ahead, self._ahead = self._ahead, None
            if ahead is not None and not self._resumed and self.client.epoch == self._epoch:
                return ahead, self._length, first  # started when the last one was cut short
            self._resumed = False
            self.client.set_epoch(self._epoch)
        else:
            self._length, first = len(self.client), 0
            self.client.set_epoch(0)
        return iter(self.client), self._length, first

    def finished(self) -> None:
        """The epoch's batches are all handed out: the next iteration is the next epoch.
        An epoch cut to whole windows leaves the client's epoch running: the next one is
        started at once (its batches prepared meanwhile; ``state_dict`` says it is next)."""
        if self.train:
            self._epoch = self.client.epoch + 1
            self.client.set_epoch(self._epoch)
            if self._cut:
                self._cut = False
                self._ahead = iter(self.client)

    def cut(self) -> bool:
        """Whether the running epoch ends before the client's (a partial window left out)."""
        return self._cut

    # Lightning saves a loader's state when it has these (and warns about a mid-epoch
    # checkpoint when it has not); the state lives in the DataModule's entry instead,
    # which Lightning restores before it builds any loader (see DataServerDataModule).
    def state_dict(self) -> dict[str, Any]:
        """Nothing: ``DataServerDataModule.state_dict`` carries the client's state."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to do: ``DataServerDataModule.load_state_dict`` restored the client."""


class ServedEpoch:
    """One iteration of a ``ServedLoader``: ``len(loader)`` items (a resumed epoch: those
    after its step, as Lightning counts). The client's epoch starts at the first ``next()``. After the epoch's last batch the client's epoch is
    finished at once, without waiting for Lightning to ask for one more.

    Training, when stitched batches ended the epoch before ``len(loader)``: the items left
    are ``None``, which Lightning skips (no ``training_step``, no optimizer step; it warns
    once that the loader yielded None), so that it still sees the epoch's last batch and
    runs what it runs at an epoch's end (validation, epoch-interval LR schedulers).
    """

    def __init__(self, loader: ServedLoader, generation: int) -> None:
        self._loader = loader
        self._generation = generation
        self._batches: EpochIterator | None = None
        self._length = 0
        self._given = 0  # the epoch's items handed out: batches, then any padding
        self._first = 0  # those a resumed epoch had handed out before
        self._done = False

    def __iter__(self) -> ServedEpoch:
        return self

    def __next__(self) -> Batch | None:
        if self._batches is None:
            # Counted from a resumed epoch's step, as Lightning counts the batches it restored.
            self._batches, self._length, self._given = self._loader.start(self._generation)
            self._first = self._given
        if self._given >= self._length:
            self._finish()
            raise StopIteration
        if self._done:  # the epoch ran out early: pad it to its announced length
            self._given += 1
            return None
        try:
            batch = next(self._batches)
        except StopIteration:
            self._finish()
            if not self._loader.train or self._given == self._first:
                raise
            log.info(
                "dataserver: epoch %d ended after %d of %d batches (stitched batches hold "
                "more samples); Lightning skips the %d left (None)",
                self._loader.client.epoch - 1,
                self._given,
                self._length,
                self._length - self._given,
            )
            self._given += 1
            return None
        self._given += 1
        if self._given >= self._length and self._loader.cut():
            self._finish()  # the client's batches past the last whole window are not served
        elif self._given >= self._length:
            # Every batch was regular: nothing of the epoch is left (a stitched batch
            # would have ended it sooner), so the client's next() ends the epoch at once.
            try:
                extra = next(self._batches)
            except StopIteration:
                pass
            else:  # cannot happen while len() is an upper bound; never drop it silently
                raise DataServerError(
                    f"epoch {extra.epoch}: batch {extra.step} exceeds the {self._length} "
                    "batches the loader announced"
                )
            self._finish()
        return batch

    def _finish(self) -> None:
        if not self._done:
            self._done = True
            self._loader.finished()


class DataServerDataModule(pl.LightningDataModule):
    """A ``LightningDataModule`` over dataserver: ``train``/``val`` are server addresses
    (anything ``DataServerClient`` takes: one address, a list, a DNS name, ``ray://NAME``),
    ``client_kwargs`` go to each ``DataServerClient`` (``batch_size``, ``image_size``,
    ``seed``, ``stitch_*``, ...).

    The validation client gets the same ``client_kwargs`` with ``shuffle=False``,
    ``drop_last=False`` and ``augment=False`` (never flipped nor augmented) (a ``MultiScale`` or ``StepSizes`` ``image_size`` becomes its
    largest size); nothing steers it, so its batches are regular. With several ranks each validates its shard, as
    Lightning's ``DistributedSampler`` does (drop_last False: the last batches of some ranks
    repeat a sample or two).

    Guarantees (those of ``DataServerClient``, through Lightning): each training epoch
    delivers every index of each rank's shard exactly once, also across a checkpoint and a
    ``Trainer.fit(ckpt_path=...)`` resume (mid-epoch, at an epoch's end, or on a batch end,
    as ``ModelCheckpoint`` saves them); the sanity check and validation runs never touch
    the training epoch; ``dm.client.feedback``/``set_mode``/``control`` are honoured by the
    very next training batch.
    """

    def __init__(self, train: Address, val: Address | None = None, **client_kwargs: Any) -> None:
        super().__init__()
        self.train_address = train
        self.val_address = val
        self.client_kwargs = dict(client_kwargs)
        self.client: DataServerClient | None = None
        self.val_client: DataServerClient | None = None
        self._train_loader: ServedLoader | None = None
        self._val_loader: ServedLoader | None = None
        self._pending: dict[str, Any] | None = None  # a state loaded before setup()

    # ------------------------------------------------------------ clients

    def _kwargs(self, *, val: bool) -> dict[str, Any]:
        kwargs = dict(self.client_kwargs)
        if kwargs.get("device") is None and self.trainer is not None:
            kwargs["device"] = self.trainer.strategy.root_device
        if val:
            kwargs.update(shuffle=False, drop_last=False, augment=False)
            size = kwargs.get("image_size")
            if isinstance(size, MultiScale | StepSizes):
                kwargs["image_size"] = size.stored
        return kwargs

    def _window(self) -> int:
        """Training epochs hold a whole number of windows of this many batches (1: every
        batch of the shard); a subclass may align them to gradient accumulation."""
        return 1

    def setup(self, stage: str) -> None:
        """Build the clients the stage needs (``fit``: training and, with ``val``,
        validation; ``validate``: validation). Lightning calls it on every rank after the
        process group exists: rank and world size come from torch.distributed."""
        if stage == "fit" and self.client is None:
            self.client = DataServerClient(self.train_address, **self._kwargs(val=False))
            self._train_loader = ServedLoader(self.client, train=True, window=self._window())
            if self._pending is not None:
                state, self._pending = self._pending, None
                self.load_state_dict(state)
        if (
            stage in ("fit", "validate")
            and self.val_address is not None
            and (self.val_client is None)
        ):
            self.val_client = DataServerClient(self.val_address, **self._kwargs(val=True))
            self._val_loader = ServedLoader(self.val_client, train=False)

    def teardown(self, stage: str) -> None:
        """Close the clients (a later ``setup`` builds new ones)."""
        for client in (self.client, self.val_client):
            if client is not None:
                client.close()
        self.client = self.val_client = None
        self._train_loader = self._val_loader = None

    def train_dataloader(self) -> ServedLoader:
        if self._train_loader is None:
            raise RuntimeError("DataServerDataModule.train_dataloader() before setup('fit')")
        return self._train_loader

    def val_dataloader(self) -> ServedLoader | list[Any]:
        """The validation loader; without ``val``, none (Lightning then skips validation)."""
        if self.val_address is None:
            return []
        if self._val_loader is None:
            raise RuntimeError("DataServerDataModule.val_dataloader() before setup()")
        return self._val_loader

    # ------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """The training client's state (plain data) for Lightning's checkpoint: the samples
        of the epoch not yet handed to the model, the mode, the control values.

        A **collective call** under torch.distributed: every rank's position is gathered
        (``DataServerClient.state_dict``), as Lightning calls it on every rank when it
        saves (``Trainer.save_checkpoint``, ``ModelCheckpoint``); one rank alone (a callback
        that saves on rank 0 only) would wait for the others. The job-wide state resumes on
        the same number of ranks, each from its own position, or on another, dealt.
        Before ``setup`` (no client) it is empty, and Lightning saves nothing.
        """
        if self.client is None:
            return {} if self._pending is None else self._pending
        return {"version": STATE_VERSION, "client": self.client.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where ``state`` was taken. Lightning calls it while restoring a
        checkpoint, after ``setup`` and before it builds a loader or an optimizer (so
        ``trainer.estimated_stepping_batches``, Lightning issue #20550, cannot drop it).
        Before ``setup`` it is kept and applied there."""
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise ValueError(f"not a DataServerDataModule state of version {STATE_VERSION}")
        if self.client is None or self._train_loader is None:
            self._pending = state
            return
        self.client.load_state_dict(state["client"])
        self._train_loader.resumed()

    def transfer_batch_to_device(
        self, batch: Any, device: torch.device, dataloader_idx: int
    ) -> Any:
        """A ``Batch`` is on the client's device already; it passes as it is."""
        if isinstance(batch, Batch) and batch.images.device == device:
            return batch
        return super().transfer_batch_to_device(batch, device, dataloader_idx)
