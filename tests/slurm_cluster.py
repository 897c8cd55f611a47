"""A real Slurm cluster on one machine, for tests/test_slurm.py: Debian's ``slurm-wlm`` and
``munge``, one ``slurmctld`` and one ``slurmd`` per node, every daemon in a network namespace
of its own (``tests/netns_nodes.py``'s bridged ``Cluster``), each with its own address and
its own hostname (a UTS namespace: torchrun and slurmctld look at it), names resolved by a
private hosts file per namespace (``ip netns exec`` bind-mounts ``/etc/netns/<ns>/hosts``).
One private ``munged`` (its own key and socket) serves them all: munge talks over a unix
socket, which no network namespace hides. Nothing is written outside the cluster's
directory, munge's directory in /tmp, ``/etc/netns/`` and the namespaces, and nothing is
mounted in this mount namespace (each daemon's hosts file is bind-mounted in a mount
namespace of its own); ``close()`` takes it all down, also after a failed start.

    why = slurm_unavailable()             # None, or why these tests must skip
    with SlurmCluster(tmp_path) as slurm:  # partitions cpu = n1, gpu = n2,n3, all = n1-n3
        job = slurm.sbatch("--partition=cpu", "script.sbatch", env={...})
        slurm.wait_job(job, timeout=120)

Root only. ``slurm_unavailable()`` installs ``slurm-wlm`` and ``munge`` with apt-get when
they are missing (as .ci/run does)."""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from pathlib import Path
from typing import IO, Any

from netns_nodes import Cluster

NODES = {"n1": 1, "n2": 2, "n3": 3}  # host part of each node's address
CONTROLLER = ("ctl", 254)  # slurmctld's namespace, where the tests' commands run too
PARTITIONS = {"cpu": ["n1"], "gpu": ["n2", "n3"], "all": ["n1", "n2", "n3"]}
DEFAULT_PARTITION = "all"
GPU_NODES = ("n2", "n3")  # each says it has GPUS_PER_NODE GPUs (files: no device behind them)
GPUS_PER_NODE = 8  # as train-hetjob.sbatch's #SBATCH --gpus-per-node asks for
NODE_CPUS = 2  # per node, whatever the machine has (SlurmdParameters=config_overrides)
DAEMONS = ("slurmctld", "slurmd", "munged", "sbatch", "scontrol", "sinfo")
FINISHED = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
}


def _apt_install(*packages: str) -> str | None:
    """Install Debian packages; None when done, else why not."""
    if shutil.which("apt-get") is None:
        return "no apt-get to install them with"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive", RUNLEVEL="1")  # start no service
    steps = [
        ["apt-get", "update", "-qq"],
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *packages],
    ]
    for step in steps:
        try:
            done = subprocess.run(step, capture_output=True, text=True, timeout=300, env=env)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"{' '.join(step)}: {exc}"
        if done.returncode != 0:
            return f"{' '.join(step)}: {done.stderr.strip()[-500:]}"
    return None


def slurm_unavailable() -> str | None:
    """None when a cluster can be built here (installing Slurm and munge if need be), else
    why these tests must skip."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, slurmd)"
    for tool in ("ip", "unshare", "nsenter", "mount"):
        if shutil.which(tool) is None:
            return f"needs {tool} (iproute2, util-linux)"
    if any(shutil.which(d) is None for d in DAEMONS):
        why = _apt_install("slurm-wlm", "munge")
        missing = [d for d in DAEMONS if shutil.which(d) is None]
        if missing:
            return f"Slurm is not installed ({', '.join(missing)} missing) and {why or '?'}"
    return None


def slurm_version() -> str:
    out = subprocess.run(["slurmd", "-V"], capture_output=True, text=True, timeout=20)
    return out.stdout.strip()


class Daemon:
    """One long-running process of the cluster, its stdout and stderr in ``log``."""

    def __init__(self, name: str, argv: list[str], log: Path, env: dict[str, str]) -> None:
        self.name, self.log = name, log
        self._out: IO[bytes] = open(log, "ab")  # (closed in stop)
        self.proc = subprocess.Popen(
            argv, stdout=self._out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, grace: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._out.close()


class SlurmCluster:
    """The cluster (see the module's docstring); everything lives under ``root``."""

    def __init__(self, root: Path, kill_wait: int = 30) -> None:
        self.root = root
        self.kill_wait = kill_wait
        self.daemons: list[Daemon] = []
        self.net: Cluster | None = None
        self.munge_dir: Path | None = None
        self.logs = root / "log"
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    # -------------------------------------------------------------- start

    def _start(self) -> None:
        for sub in ["log", "state", "jobs", *(f"spool/{n}" for n in NODES)]:
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self.net = Cluster({**NODES, CONTROLLER[0]: CONTROLLER[1]})
        self.addr = {name: self.net.ip(host) for name, host in [*NODES.items(), CONTROLLER]}
        hosts_text = "127.0.0.1 localhost\n" + "".join(f"{a} {n}\n" for n, a in self.addr.items())
        for name in self.addr:
            self.net.resolver(name).write_text(hosts_text)
        self._munged()
        self.conf = self.root / "slurm.conf"
        self.conf.write_text(self._slurm_conf())
        # GPUs slurmd accepts: a device file each (gres/gpu drops GPUs without File=), here
        # copies of /dev/null; with task/none nothing confines a step to its GPUs.
        devices = self.root / "dev"
        devices.mkdir(exist_ok=True)
        null = os.stat("/dev/null").st_rdev
        for i in range(GPUS_PER_NODE):
            try:
                os.mknod(devices / f"gpu{i}", 0o600 | stat.S_IFCHR, null)
            except OSError:  # (a nodev file system: slurmd logs an error and goes on)
                (devices / f"gpu{i}").touch()
        (self.root / "gres.conf").write_text(
            f"NodeName={','.join(GPU_NODES)} Name=gpu File={devices}/gpu[0-{GPUS_PER_NODE - 1}]\n"
        )
        # No cgroup is used (proctrack/linuxproc, task/none), but slurmd still starts its
        # cgroup plugin; on cgroup v2 without systemd it must not ask systemd for a scope.
        (self.root / "cgroup.conf").write_text("CgroupPlugin=autodetect\nIgnoreSystemd=yes\n")
        # (Nothing of a Slurm job these tests might run in: only this cluster's config.)
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        self.env["SLURM_CONF"] = str(self.conf)
        self._spawn("slurmctld", CONTROLLER[0], ["slurmctld", "-D", "-i", "-f", str(self.conf)])
        self._wait_for(self._controller_up, 30, "slurmctld did not answer")
        for node in NODES:
            self._spawn(f"slurmd-{node}", node, ["slurmd", "-D", "-N", node, "-f", str(self.conf)])
        self._wait_for(self._nodes_idle, 60, "the nodes did not become idle")

    def _munged(self) -> None:
        # munged wants every directory on its socket's path searchable by all (a pytest
        # tmp_path is not): a directory of its own in /tmp.
        self.munge_dir = m = Path(tempfile.mkdtemp(prefix="dsmunge-"))
        m.chmod(0o755)
        key = m / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o400)
        self.munge_socket = m / "munge.socket"
        argv = [
            "munged",
            "--foreground",
            "--force",
            f"--socket={self.munge_socket}",
            f"--key-file={key}",
            f"--log-file={self.logs / 'munged.log'}",
            f"--pid-file={m / 'munged.pid'}",
            f"--seed-file={m / 'munged.seed'}",
        ]
        self.daemons.append(Daemon("munged", argv, self.logs / "munged.out", dict(os.environ)))
        self._wait_for(self.munge_socket.exists, 20, "munged did not create its socket")

    def _slurm_conf(self) -> str:
        r = self.root
        ctl, _ = CONTROLLER
        lines = [
            "ClusterName=dstest",
            "MailProg=/bin/true",
            f"SlurmctldHost={ctl}({self.addr[ctl]})",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            # Every daemon has a namespace, hence ports, of its own.
            "SlurmctldPort=6817",
            "SlurmdPort=6818",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool'}/%n",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={self.logs / 'slurmctld.log'}",
            f"SlurmdLogFile={self.logs / 'slurmd-%n.log'}",
            "SlurmctldDebug=info",
            f"SlurmdDebug={os.environ.get('DS_SLURMD_DEBUG', 'info')}",
            # No cgroups: processes are tracked by parentage, tasks are not confined.
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "SwitchType=switch/none",
            "MpiDefault=none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/backfill",
            # Heterogeneous jobs are started by the backfill scheduler only (every 30 s).
            "SchedulerParameters=bf_interval=1",
            "SlurmdParameters=config_overrides",
            "ReturnToService=2",
            f"KillWait={self.kill_wait}",
            "InactiveLimit=0",
            "MinJobAge=600",
            "GresTypes=gpu",
        ]
        for node in NODES:
            gres = f" Gres=gpu:{GPUS_PER_NODE}" if node in GPU_NODES else ""
            lines.append(
                f"NodeName={node} NodeAddr={self.addr[node]} NodeHostname={node} "
                f"CPUs={NODE_CPUS} RealMemory=1000{gres} State=UNKNOWN"
            )
        for part, nodes in PARTITIONS.items():
            default = "YES" if part == DEFAULT_PARTITION else "NO"
            lines.append(
                f"PartitionName={part} Nodes={','.join(nodes)} Default={default} "
                "MaxTime=INFINITE State=UP"
            )
        return "\n".join(lines) + "\n"

    def prefix(self, name: str) -> list[str]:
        """Run a command on node ``name``: in its network namespace, with its hostname (a
        UTS namespace of the command's own) and the cluster's hosts file (bind-mounted in
        a mount namespace of its own). Not ``ip netns exec``: that mounts a fresh /sys,
        without the cgroup file systems slurmd looks for."""
        assert self.net is not None
        etc = Path("/etc/netns") / self.net.namespaces[name]
        resolv = f"mount --bind {etc / 'resolv.conf'} /etc/resolv.conf"
        script = (
            f"mount --bind {etc / 'hosts'} /etc/hosts && "
            f"{{ [ ! -e /etc/resolv.conf ] || {resolv}; }}"
            f' && hostname {name} && exec "$@"'
        )
        unshare = ["unshare", "--mount", "--propagation", "private", "--uts"]
        ns = f"--net=/run/netns/{self.net.namespaces[name]}"
        return ["nsenter", ns, *unshare, "sh", "-c", script, "sh"]

    def _spawn(self, name: str, node: str, argv: list[str]) -> None:
        out = self.logs / f"{name}.out"
        self.daemons.append(Daemon(name, [*self.prefix(node), *argv], out, self.env))

    def _wait_for(self, ready: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [d.name for d in self.daemons if not d.alive()]
            if dead:
                raise RuntimeError(f"{what}: {', '.join(dead)} exited\n{self.dump()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} within {timeout:g} s\n{self.dump()}")
            time.sleep(0.5)

    def _controller_up(self) -> bool:
        return self.run("scontrol", "ping", check=False).returncode == 0

    def node_states(self) -> dict[str, str]:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %T", check=False).stdout
        return dict(line.split() for line in out.splitlines() if line.strip())

    def _nodes_idle(self) -> bool:
        states = self.node_states()
        return all(states.get(n) == "idle" for n in NODES)

    # -------------------------------------------------------------- use

    def run(
        self, *argv: str, check: bool = True, env: dict[str, str] | None = None, timeout: float = 30
    ) -> subprocess.CompletedProcess[str]:
        """A command on the controller's node (sbatch, scontrol, squeue, scancel...)."""
        done = subprocess.run(
            [*self.prefix(CONTROLLER[0]), *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**self.env, **(env or {})},
        )
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: {done.stdout}{done.stderr}")
        return done

    def sbatch(self, *args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> int:
        """Submit; the job's id. Its output goes to ``job_output(id)``."""
        out = self.root / "jobs" / "%j.out"
        argv = ["sbatch", "--parsable", f"--output={out}"]
        if cwd is not None:
            argv.append(f"--chdir={cwd}")
        done = self.run(*argv, *args, env=env)
        return int(done.stdout.strip().split(";")[0].split("+")[0])

    def job_output(self, job: int) -> str:
        path = self.root / "jobs" / f"{job}.out"
        return path.read_text(errors="replace") if path.exists() else ""

    def job(self, job: int) -> dict[str, str]:
        """``scontrol show job -o`` of the job (a het job: its first component's line)."""
        out = self.run("scontrol", "show", "job", "-o", str(job), check=False).stdout
        line = out.splitlines()[0] if out.strip() else ""
        return dict(re.findall(r"(\w+)=(\S*)", line))

    def job_components(self, job: int) -> list[dict[str, str]]:
        out = self.run("scontrol", "show", "job", "-o", str(job), check=False).stdout
        return [dict(re.findall(r"(\w+)=(\S*)", line)) for line in out.splitlines() if line]

    def wait_state(self, job: int, states: set[str], timeout: float) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job)
            if info.get("JobState") in states:
                return info
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job} not {sorted(states)} after {timeout:g} s: {info}")
            time.sleep(0.5)

    def wait_job(self, job: int, timeout: float) -> dict[str, str]:
        """Wait until the job has finished and is done completing (a cancelled job is
        CANCELLED at once, while its steps and batch script still run down); its
        ``scontrol`` record."""
        deadline = time.monotonic() + timeout
        self.wait_state(job, FINISHED, timeout)
        while True:
            components = self.job_components(job)
            listed = self.run("squeue", "-h", "-j", str(job), check=False).stdout.strip()
            if all(c.get("JobState") in FINISHED for c in components) and not listed:
                return components[0]
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job} still completing after {timeout:g} s: {listed}")
            time.sleep(0.5)

    def node_pids(self, node: str) -> list[int]:
        """Every process in the node's network namespace (slurmd, steps, tasks)."""
        assert self.net is not None
        ns = self.net.namespaces[node]
        out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]

    def node_processes(self, node: str) -> dict[int, str]:
        """Pid -> command line of every process on the node but its slurmd."""
        found = {}
        for pid in self.node_pids(node):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if cmd.split(" ", 1)[0].endswith("slurmd") or cmd.startswith(("nsenter ", "unshare ")):
                continue
            found[pid] = cmd.strip()
        return found

    def dump(self, tail: int = 60) -> str:
        """The last lines of every daemon's log, for a failed test's report."""
        parts = []
        for path in sorted(self.logs.glob("*")):
            lines = path.read_text(errors="replace").splitlines()[-tail:]
            if lines:
                parts.append(f"----- {path.name}\n" + "\n".join(lines))
        return "\n".join(parts)

    # -------------------------------------------------------------- stop

    def close(self) -> None:
        """Cancel every job, stop the daemons, kill whatever is left in the namespaces (a
        step's processes outlive slurmd), delete the namespaces. Safe to call twice."""
        if self.net is not None and any(d.alive() for d in self.daemons):
            try:
                self.run("scancel", "--user=root", check=False, timeout=20)
            except (OSError, subprocess.TimeoutExpired):
                pass
        for daemon in reversed(self.daemons):
            if daemon.name != "munged":
                daemon.stop()
        if self.net is not None:
            for node in self.net.namespaces:
                for _ in range(3):
                    pids = self.node_pids(node) if node != "bridge" else []
                    if not pids:
                        break
                    for pid in pids:
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                    time.sleep(0.2)
            self.net.close()
            self.net = None
        for daemon in self.daemons:
            daemon.stop()
        self.daemons = []
        if self.munge_dir is not None:
            shutil.rmtree(self.munge_dir, ignore_errors=True)
            self.munge_dir = None

    def __enter__(self) -> SlurmCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
