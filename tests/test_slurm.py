"""The project's Slurm scripts under a real Slurm (tests/slurm_cluster.py: Debian's slurm-wlm
and munge, slurmctld and three slurmd nodes, each in a network namespace of its own;
partitions ``cpu`` = n1, ``gpu`` = n2,n3 and ``all``). ``sbatch`` submits
deploy/slurm/train.sbatch and train-hetjob.sbatch as an operator would; the job trains a
small synthetic set (1 trainer process per node, CPU, the tiny detector) and its output
must say: servers ready, the epochs trained exactly once across the ranks with 0 stale
batches, the servers drained at the end; the job COMPLETED. Then a job cancelled with
``scancel`` mid-epoch: the servers drain and nothing is left on any node. Needs root;
installs slurm-wlm and munge with apt-get when they are missing; skipped otherwise."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from slurm_cluster import NODES, SlurmCluster, slurm_unavailable, slurm_version

pytestmark = [pytest.mark.timeout(600), pytest.mark.slurm]

REPO = Path(__file__).resolve().parent.parent
SLURM_DIR = REPO / "deploy" / "slurm"
IMAGES = 64
EPOCHS = 2
TRAINED = re.compile(r"^trained (\d+) epochs, (\d+) samples on (\d+) ranks, (\d+) stale$", re.M)
DRAINED = re.compile(r"dataserver\.front INFO drained in ([\d.]+) s")
STOPPED = re.compile(r"^data servers stopped in ([\d.]+) s \(srun exit status (\d+)\)$", re.M)
TOLD = re.compile(r"SIGTERM: draining \((\d+) session\(s\) told, (\d+) queued task")
SERVER_KILLED = re.compile(r"n1: task \d+: Killed")
HETJOB = ["--partition=cpu", "--nodes=1", ":", "--partition=gpu", "--nodes=2"]


def job_env(images: int, epochs: int) -> dict[str, str]:
    """What the scripts read from the submitting environment (sbatch exports it): the
    project's own commands first on PATH, one trainer process per node, a small CPU run."""
    return {
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "DATASET": f"synthetic:images={images},seed=1",
        "EPOCHS": str(epochs),
        "GPUS_PER_NODE": "1",
        "DATA_NODES": "1",
        "DRAIN_SECONDS": "5",
        "READY_TIMEOUT": "120",
        "SERVE_ARGS": "--workers 1 --log-level info",
        "TRAIN_ARGS": "--model tiny --image-size 64 --batch-size 8",
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    }


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    why = slurm_unavailable()
    if why:
        pytest.skip(why)
    try:
        c = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"cannot start a Slurm cluster here: {exc}")
    print(f"\n{slurm_version()}: nodes {c.node_states()}")
    yield c
    c.close()


@pytest.fixture
def slurm(cluster: SlurmCluster) -> Iterator[SlurmCluster]:
    """The cluster, emptied after the test; its daemons' logs and the jobs' output are
    printed then (pytest shows them when the test failed)."""
    before = set((cluster.root / "jobs").glob("*.out"))
    yield cluster
    cluster.run("scancel", "--user=root", check=False)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and cluster.run("squeue", "-h", check=False).stdout.strip():
        time.sleep(0.5)
    for out in sorted(set((cluster.root / "jobs").glob("*.out")) - before):
        print(f"----- job output {out.name}\n{out.read_text(errors='replace')[-6000:]}")
    print(cluster.dump())


def leftovers(slurm: SlurmCluster, timeout: float = 30.0) -> dict[str, dict[int, str]]:
    """Processes on each node besides its slurmd, once they had ``timeout`` to go."""
    deadline = time.monotonic() + timeout
    while True:
        left = {node: slurm.node_processes(node) for node in NODES}
        if not any(left.values()) or time.monotonic() > deadline:
            return {node: procs for node, procs in left.items() if procs}
        time.sleep(0.5)


def check_trained(out: str, epochs: int, images: int) -> tuple[int, int]:
    """The one ``trained ...`` line (rank 0's): every epoch once across the ranks, 0 stale."""
    lines = TRAINED.findall(out)
    assert len(lines) == 1, out
    e, n, r, s = (int(v) for v in lines[0])
    assert (e, r, s) == (epochs, 2, 0), lines[0]
    assert n == epochs * images, f"{n} samples, not {epochs} x {images}"
    return n, s


def check_drained(out: str) -> tuple[float, float, int]:
    """The server drained (its own log) and the script saw it exit, no kill needed: the
    server's drain time, the script's wait, the servers' srun's exit status."""
    assert re.search(r"dataserver\.front (INFO|WARNING) SIGTERM: draining", out), out
    drained = DRAINED.findall(out)
    stopped = STOPPED.findall(out)
    assert len(drained) == 1 and len(stopped) == 1, out
    assert "killing them" not in out and not SERVER_KILLED.search(out), out
    return float(drained[0]), float(stopped[0][0]), int(stopped[0][1])


def finished(slurm: SlurmCluster, job: int, timeout: float = 240) -> list[dict[str, str]]:
    slurm.wait_job(job, timeout)
    return slurm.job_components(job)


def test_train_sbatch_serves_on_the_first_node_and_trains_on_the_others(
    slurm: SlurmCluster,
) -> None:
    """``sbatch --nodes=3 deploy/slurm/train.sbatch`` (DATA_NODES=1): a server on n1,
    torchrun on n2 and n3, rendezvous on n2's address."""
    began = time.monotonic()
    job = slurm.sbatch(
        "--nodes=3", str(SLURM_DIR / "train.sbatch"), env=job_env(IMAGES, EPOCHS), cwd=REPO
    )
    (info,) = finished(slurm, job)
    took = time.monotonic() - began
    out = slurm.job_output(job)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), out
    assert info["NodeList"] == "n[1-3]"
    assert "data servers ready: tcp://n1:5555" in out, out
    n, stale = check_trained(out, EPOCHS, IMAGES)
    drained, stopped, status = check_drained(out)
    assert status == 0, out
    assert not leftovers(slurm)
    print(
        f"\njob {job} (train.sbatch, n[1-3]): COMPLETED in {took:.1f} s; {n} samples, "
        f"{stale} stale; server drained in {drained:.2f} s, its step gone {stopped:.1f} s "
        "after the script's SIGTERM"
    )


def test_hetjob_serves_on_the_cpu_partition_and_trains_on_the_gpu_partition(
    slurm: SlurmCluster,
) -> None:
    """``sbatch --partition=cpu --nodes=1 : --partition=gpu --nodes=2 train-hetjob.sbatch``:
    the server on n1 (component 0), torchrun on n2 and n3 (component 1, 8 GPUs a node
    asked for by the script's own #SBATCH lines)."""
    began = time.monotonic()
    job = slurm.sbatch(
        *HETJOB, str(SLURM_DIR / "train-hetjob.sbatch"), env=job_env(IMAGES, EPOCHS), cwd=REPO
    )
    components = finished(slurm, job)
    took = time.monotonic() - began
    out = slurm.job_output(job)
    assert [(c["JobState"], c["ExitCode"]) for c in components] == [("COMPLETED", "0:0")] * 2, out
    assert [c["NodeList"] for c in components] == ["n1", "n[2-3]"]
    assert [c["Partition"] for c in components] == ["cpu", "gpu"]
    assert "data servers ready: tcp://n1:5555" in out, out
    n, stale = check_trained(out, EPOCHS, IMAGES)
    drained, stopped, status = check_drained(out)
    assert status == 0, out
    assert not leftovers(slurm)
    print(
        f"\njob {job} (train-hetjob.sbatch, cpu n1 + gpu n[2-3]): COMPLETED in {took:.1f} s; "
        f"{n} samples, {stale} stale; server drained in {drained:.2f} s, "
        f"its step gone {stopped:.1f} s after the script's SIGTERM"
    )


def test_scancel_mid_epoch_drains_the_servers_and_leaves_nothing_running(
    slurm: SlurmCluster,
) -> None:
    """A heterogeneous job cancelled with a plain ``scancel`` once rank 0 is 10 steps into
    its epoch: Slurm sends every step SIGTERM, the server drains (the script does not send
    it a second one, which would stop it at once) and exits long before KillWait's
    SIGKILL; no process of the job is left on any node."""
    images = 4000
    job = slurm.sbatch(
        *HETJOB, str(SLURM_DIR / "train-hetjob.sbatch"), env=job_env(images, 1), cwd=REPO
    )
    deadline = time.monotonic() + 180
    while "epoch 0 step    10 " not in slurm.job_output(job):
        assert time.monotonic() < deadline, slurm.job_output(job)
        assert slurm.job(job).get("JobState") in ("PENDING", "RUNNING"), slurm.job_output(job)
        time.sleep(0.2)
    assert slurm.job_components(job)[0]["JobState"] == "RUNNING"
    cancelled = time.monotonic()
    slurm.run("scancel", str(job))
    components = finished(slurm, job, timeout=60)
    ended = time.monotonic() - cancelled
    left = leftovers(slurm)
    gone = time.monotonic() - cancelled
    out = slurm.job_output(job)
    assert [c["JobState"] for c in components] == ["CANCELLED"] * 2, out
    assert not TRAINED.findall(out), "the epoch was not to finish"
    assert "job cancelled: the data servers have SIGTERM from Slurm" in out, out
    drained, stopped, _ = check_drained(out)
    assert drained <= 5 and ended < 30, f"not drained before KillWait: {ended:.1f} s"
    assert not left, left
    ((told, queued),) = TOLD.findall(out)
    print(
        f"\njob {job} (train-hetjob.sbatch, scancel at rank 0's step 10 of {images // 16}): "
        f"CANCELLED {ended:.1f} s after scancel; server drained in {drained:.2f} s "
        f"({told} session(s) told, {queued} queued task(s) handed back), the script waited "
        f"{stopped:.1f} s for its step; nodes empty {gone:.1f} s after scancel"
    )
