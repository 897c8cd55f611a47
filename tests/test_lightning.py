"""PyTorch Lightning's real Trainer (CPU) over ``DataServerDataModule``, through
``examples/lightning_train.py``: 2 ranks under Lightning's own DDP strategy (gloo), a
checkpoint mid-epoch and a ``Trainer.fit(ckpt_path=...)`` resume that trains every sample
of each epoch exactly once across ranks and both runs; validation passes that leave the
training epoch alone; a checkpoint on an epoch's last batch; Stitcher's feedback (epochs
shortened by stitched batches) across a resume.

The optimizer's ``OneCycleLR`` reads ``trainer.estimated_stepping_batches`` in every run,
which is what makes Lightning drop a stateful loader's state on resume (Lightning issue
#20550): the resumes here are that case.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pytorch_lightning")

from conftest import Server

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "lightning_train.py"
TRAIN_IMAGES = 96  # synthetic_server's
VAL_IMAGES = 48
BATCH = 8

Records = dict[tuple[str, int], list[dict[str, Any]]]


def run_example(*args: str, timeout: float = 240) -> str:
    """Run the example (it starts the other ranks itself) and return its output."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_ADDR")
        and k not in ("MASTER_PORT", "CUDA_VISIBLE_DEVICES")
        and not k.startswith("DATASERVER_LIGHTNING")
    }
    env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [sys.executable, str(EXAMPLE), "--image-size", "64", "--batch-size", str(BATCH), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return out


def records(prefix: Path) -> Records:
    """Every batch the example's LightningModule recorded, by (kind, epoch), with its rank."""
    out: Records = defaultdict(list)
    for path in sorted(prefix.parent.glob(prefix.name + ".rank*.jsonl")):
        rank = int(path.name.rsplit(".rank", 1)[1].split(".")[0])
        for line in path.read_text().splitlines():
            r = json.loads(line)
            r["rank"] = rank
            out[(r["kind"], r["epoch"])].append(r)
    return out


def samples(batches: list[dict[str, Any]]) -> list[int]:
    return [i for r in batches for image in r["indices"] for i in image]


def steps(batches: list[dict[str, Any]], rank: int) -> list[int]:
    return [r["step"] for r in batches if r["rank"] == rank]


def summary(out: str) -> str:
    return next(line for line in out.splitlines() if line.startswith("trained "))


@pytest.fixture(scope="module")
def val_server() -> Iterator[Server]:
    server = Server("--dataset", f"synthetic:images={VAL_IMAGES},seed=5", workers=1)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def ddp_runs(
    synthetic_server: Server, val_server: Server, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """Run A: 2 epochs on 2 ranks, stopped after step 9 (epoch 1, batch 3 of 6) with a
    checkpoint there; run B: the same command resumed from that checkpoint, saving a
    checkpoint every 3 steps (one: step 12, the last batch of epoch 1)."""
    tmp = tmp_path_factory.mktemp("lightning-ddp")
    servers = ["--servers", synthetic_server.address, "--val", val_server.address]
    common = [*servers, "--devices", "2", "--epochs", "2"]
    out_a = run_example(
        *common, "--record", str(tmp / "a"), "--ckpt-dir", str(tmp / "ckpt"),
        "--save-every", "9", "--stop-after", "9",
    )  # fmt: skip
    ckpt = tmp / "ckpt" / "epoch=1-step=9.ckpt"
    assert ckpt.exists(), sorted(p.name for p in (tmp / "ckpt").iterdir())
    out_b = run_example(
        *common, "--record", str(tmp / "b"), "--ckpt", str(ckpt),
        "--ckpt-dir", str(tmp / "ckpt_b"), "--save-every", "3",
    )  # fmt: skip
    return {
        "a": records(tmp / "a"),
        "b": records(tmp / "b"),
        "out_a": out_a,
        "out_b": out_b,
        "ckpt": ckpt,
        "ckpt_end": tmp / "ckpt_b" / "epoch=1-step=12.ckpt",
    }


def test_two_ranks_resume_mid_epoch_every_sample_exactly_once(ddp_runs: dict[str, Any]) -> None:
    a, b = ddp_runs["a"], ddp_runs["b"]
    per_rank = TRAIN_IMAGES // 2 // BATCH  # 6 batches a rank an epoch
    # Epoch 0, all in run A: each rank its shard, together every index once.
    epoch0 = a[("train", 0)]
    assert sorted(samples(epoch0)) == list(range(TRAIN_IMAGES))
    assert not set(samples([r for r in epoch0 if r["rank"] == 0])) & set(
        samples([r for r in epoch0 if r["rank"] == 1])
    )
    for rank in (0, 1):
        assert steps(epoch0, rank) == list(range(per_rank))
    # Epoch 1: run A trained batches 0..2 on each rank before its checkpoint at step 9, run B
    # the rest (3..5): together every index exactly once; nothing after the stop was lost
    # (or repeated) through Lightning's restore.
    first, rest = a[("train", 1)], b[("train", 1)]
    for rank in (0, 1):
        assert steps(first, rank) == [0, 1, 2]
        assert steps(rest, rank) == [3, 4, 5]
    assert sorted(samples(first) + samples(rest)) == list(range(TRAIN_IMAGES))
    assert set(b) <= {("train", 1), ("val", 0)}  # run B trained nothing but the rest
    assert summary(ddp_runs["out_a"]) == "trained 2 epochs, 144 samples on 2 ranks, 0 stale"
    assert summary(ddp_runs["out_b"]) == "trained 1 epochs, 48 samples on 2 ranks, 0 stale"
    assert "not resumable" not in ddp_runs["out_b"]  # Lightning's mid-epoch warning


def test_checkpoint_holds_every_ranks_position(ddp_runs: dict[str, Any]) -> None:
    import torch

    ckpt = torch.load(ddp_runs["ckpt"], map_location="cpu", weights_only=False)
    state = ckpt["DataServerDataModule"]
    assert state["version"] == 1
    client = state["client"]
    assert client["epoch"] == 1 and client["world_size"] == 2
    assert [r["position"] for r in client["ranks"]] == [3 * BATCH, 3 * BATCH]
    assert [r["step"] for r in client["ranks"]] == [3, 3]
    # Run B's checkpoint on the last batch of the resumed epoch: the next epoch's start.
    ckpt = torch.load(ddp_runs["ckpt_end"], map_location="cpu", weights_only=False)
    client = ckpt["DataServerDataModule"]["client"]
    assert client["epoch"] == 2
    assert [(r["position"], r["step"]) for r in client["ranks"]] == [(0, 0), (0, 0)]


def test_validation_passes_are_whole_and_leave_training_alone(ddp_runs: dict[str, Any]) -> None:
    a, b = ddp_runs["a"], ddp_runs["b"]
    per_rank = VAL_IMAGES // 2 // BATCH  # 3 val batches a rank
    # The sanity check took 2 batches a rank (Lightning's num_sanity_val_steps) ...
    sanity = a[("sanity", 0)]
    for rank in (0, 1):
        assert steps(sanity, rank) == [0, 1]
    # ... and every validation run after it is a whole pass from the start: run A validated
    # at the end of epoch 0 and when it stopped, run B at the end of epoch 1 (a resumed fit
    # does no sanity check). Each pass: every val index once across the ranks.
    runs_a, runs_b = a[("val", 0)], b[("val", 0)]
    for rank in (0, 1):
        assert steps(runs_a, rank) == list(range(per_rank)) * 2
        assert steps(runs_b, rank) == list(range(per_rank))
    assert sorted(samples(runs_a)) == sorted(list(range(VAL_IMAGES)) * 2)
    assert sorted(samples(runs_b)) == list(range(VAL_IMAGES))
    assert all(r["mode"] == "regular" for r in runs_a + runs_b)
    # (and epoch 0's training, which ran after the sanity check, is exactly once: above)
    assert sorted(samples(a[("train", 0)])) == list(range(TRAIN_IMAGES))


def test_checkpoint_on_an_epochs_last_batch_resumes_at_the_next_epoch(
    synthetic_server: Server, tmp_path: Path
) -> None:
    per_epoch = TRAIN_IMAGES // BATCH  # one rank: 12 batches
    common = ["--servers", synthetic_server.address, "--epochs", "2"]
    run_example(
        *common, "--record", str(tmp_path / "c"), "--ckpt-dir", str(tmp_path / "ckpt"),
        "--save-every", str(per_epoch), "--stop-after", str(per_epoch),
    )  # fmt: skip
    ckpt = tmp_path / "ckpt" / f"epoch=0-step={per_epoch}.ckpt"
    out = run_example(*common, "--record", str(tmp_path / "d"), "--ckpt", str(ckpt))
    c, d = records(tmp_path / "c"), records(tmp_path / "d")
    assert set(c) == {("train", 0)} and set(d) == {("train", 1)}
    assert sorted(samples(c[("train", 0)])) == list(range(TRAIN_IMAGES))
    assert steps(d[("train", 1)], 0) == list(range(per_epoch))
    assert sorted(samples(d[("train", 1)])) == list(range(TRAIN_IMAGES))
    assert "discards the loaded state" not in out
    assert summary(out) == f"trained 1 epochs, {TRAIN_IMAGES} samples on 1 ranks, 0 stale"


def test_feedback_stitching_across_a_resume_keeps_exactly_once_and_validates(
    synthetic_server: Server, val_server: Server, tmp_path: Path
) -> None:
    """Stitcher's feedback with tau 1.0 stitches most batches: the epochs are shorter than
    ``len(loader)`` (counted as if regular), Lightning still reaches each epoch's end
    (validation runs), and a resume mid-epoch goes on in the checkpoint's mode."""
    common = [
        "--servers", synthetic_server.address, "--val", val_server.address, "--epochs", "2",
        "--feedback", "--threshold", "1.0",
    ]  # fmt: skip
    out_e = run_example(
        *common, "--record", str(tmp_path / "e"), "--ckpt-dir", str(tmp_path / "ckpt"),
        "--save-every", "2", "--stop-after", "2",
    )  # fmt: skip
    out_f = run_example(
        *common, "--record", str(tmp_path / "f"), "--ckpt", str(tmp_path / "ckpt" / "epoch=0-step=2.ckpt")
    )  # fmt: skip
    e, f = records(tmp_path / "e"), records(tmp_path / "f")
    assert steps(e[("train", 0)], 0) == [0, 1]
    epoch0 = e[("train", 0)] + f[("train", 0)]
    assert [r["step"] for r in epoch0] == list(range(len(epoch0)))
    for epoch in (epoch0, f[("train", 1)]):
        assert sorted(samples(epoch)) == list(range(TRAIN_IMAGES))
    stitched = [r for r in epoch0 + f[("train", 1)] if r["mode"] == "stitch"]
    assert stitched and all(len(image) == 4 for r in stitched for image in r["indices"])
    assert len(f[("train", 1)]) < TRAIN_IMAGES // BATCH  # shortened by stitching ...
    # ... and validated at both epochs' ends all the same (whole passes, 6 batches each).
    assert len(f[("val", 0)]) == 2 * VAL_IMAGES // BATCH
    assert sorted(samples(f[("val", 0)])) == sorted(list(range(VAL_IMAGES)) * 2)
    assert summary(out_e).endswith(" 0 stale") and summary(out_f).endswith(" 0 stale")
