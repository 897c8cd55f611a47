"""deploy/ checked statically (no container engine or cluster here).

Every Kubernetes manifest validates against the Kubernetes schemas (kubernetes-validate ships
them: offline, strict, so an unknown or misspelt field fails), and the manifests agree with
each other and with the CLI: selectors, ports, probes, the drain and the grace period, the
autoscaler's target. The Dockerfile pins torch before the project. The Slurm scripts are
valid bash that, run against fake Slurm commands, build the right server list and run
commands the real CLI parser accepts."""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from dataserver.cli import build_parser

pytestmark = pytest.mark.timeout(120)

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
K8S = DEPLOY / "k8s"
SLURM = DEPLOY / "slurm"
# The oldest Kubernetes the manifests claim (autoscaling/v2, policy/v1, Indexed Jobs are all
# GA there) and the newest whose schemas the installed kubernetes-validate ships.
K8S_VERSIONS = ("1.28", kubernetes_validate.latest_version())
ALTERNATIVE_HPA = re.compile(
    r"^# --- alternative HorizontalPodAutoscaler \(begin\) ---\n(.*?)"
    r"^# --- alternative HorizontalPodAutoscaler \(end\) ---$",
    re.S | re.M,
)
# The contract's metric names (docs/contract.md, "Metrics": server, then trainer side); histograms add _bucket/_sum/_count.
METRICS = {
    "dataserver_samples_served_total",
    "dataserver_decode_seconds",
    "dataserver_task_seconds",
    "dataserver_queue_depth",
    "dataserver_workers_busy",
    "dataserver_workers",
    "dataserver_sessions",
    "dataserver_rejected_messages_total",
    "dataserver_worker_restarts_total",
    "dataserver_cache_hits_total",
    "dataserver_cache_misses_total",
    "dataserver_cache_bytes",
    "dataserver_cache_capacity_bytes",
    "dataserver_client_data_wait_seconds",
    "dataserver_client_samples_total",
    "dataserver_client_samples_per_second",
}


def docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def by_kind(name: str) -> dict[str, dict[str, Any]]:
    found = {d["kind"]: d for d in docs(name)}
    assert len(found) == len(docs(name)), f"{name}: one document of each kind"
    return found


def alternative_hpa() -> dict[str, Any]:
    """The commented-out HorizontalPodAutoscaler of prometheus-adapter.yaml, uncommented."""
    match = ALTERNATIVE_HPA.search((K8S / "prometheus-adapter.yaml").read_text())
    assert match, "prometheus-adapter.yaml: the alternative autoscaler's markers"
    lines = [re.sub(r"^# ?", "", line) for line in match.group(1).splitlines()]
    doc = yaml.safe_load("\n".join(lines))
    assert isinstance(doc, dict)
    return doc


def all_manifests() -> list[tuple[str, dict[str, Any]]]:
    found = [
        (f"{path.name}#{i}", doc)
        for path in sorted(K8S.glob("*.yaml"))
        for i, doc in enumerate(docs(path.name))
    ]
    return [*found, ("prometheus-adapter.yaml#alternative-hpa", alternative_hpa())]


def serve_args(args: list[str]) -> Any:
    """The real CLI parses these `dataserver serve` arguments (argparse exits on an unknown
    flag or a bad value)."""
    parsed = build_parser().parse_args(args)
    assert parsed.command == "serve"
    return parsed


def server_container() -> dict[str, Any]:
    container: dict[str, Any] = by_kind("dataserver.yaml")["Deployment"]["spec"]["template"][
        "spec"
    ]["containers"][0]
    return container


def container_ports(container: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container["ports"]}


# --- every manifest against the Kubernetes schemas -------------------------------------


MANIFESTS = all_manifests()


def test_every_manifest_is_found() -> None:
    kinds = sorted(doc["kind"] for _, doc in MANIFESTS)
    server = ["Service", "Deployment", "HorizontalPodAutoscaler", "PodDisruptionBudget"]
    others = ["Service", "Job", "ConfigMap", "HorizontalPodAutoscaler"]
    object_storage = ["Deployment"]  # dataserver-s3.yaml
    assert kinds == sorted([*server, *others, *object_storage])


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize(("where", "doc"), MANIFESTS, ids=[where for where, _ in MANIFESTS])
def test_manifest_validates_against_the_kubernetes_schemas(
    where: str, doc: dict[str, Any], version: str
) -> None:
    # Raises ValidationError on a bad field, SchemaNotFoundError on an unknown kind/apiVersion.
    kubernetes_validate.validate(doc, version, strict=True)


def _broken(edit: str) -> dict[str, Any]:
    kinds = by_kind("dataserver.yaml")
    if edit == "unknown field":  # a typo of terminationGracePeriodSeconds
        doc = copy.deepcopy(kinds["Deployment"])
        spec = doc["spec"]["template"]["spec"]
        spec["terminationGracePeriod"] = spec.pop("terminationGracePeriodSeconds")
    elif edit == "wrong type":
        doc = copy.deepcopy(kinds["Deployment"])
        doc["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "data"
    elif edit == "missing required field":
        doc = copy.deepcopy(kinds["HorizontalPodAutoscaler"])
        del doc["spec"]["scaleTargetRef"]
    else:  # a field misplaced one level too high
        doc = copy.deepcopy(kinds["PodDisruptionBudget"])
        doc["spec"]["matchLabels"] = doc["spec"].pop("selector")["matchLabels"]
    return doc


@pytest.mark.parametrize(
    "edit", ["unknown field", "wrong type", "missing required field", "misplaced field"]
)
def test_the_validator_rejects_a_broken_manifest(edit: str) -> None:
    """The validation above is live: a broken copy of a real manifest fails it."""
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(_broken(edit), K8S_VERSIONS[-1], strict=True)


# --- the server manifests agree with each other and with the CLI ------------------------


def test_server_deployment_and_headless_service_agree() -> None:
    kinds = by_kind("dataserver.yaml")
    service, deployment = kinds["Service"], kinds["Deployment"]
    # Headless, and only ready pods in DNS: a draining (terminating) pod leaves the name the
    # clients re-resolve, so they stop sending it work.
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is False
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"] == labels == deployment["spec"]["selector"]["matchLabels"]
    # The autoscaler owns the replica count; a value here would be re-applied over it.
    assert "replicas" not in deployment["spec"]
    container = server_container()
    args = serve_args(container["args"])
    ports = container_ports(container)
    assert args.bind == f"tcp://0.0.0.0:{ports['data']}"
    assert args.control_bind is None  # (deprecated and ignored: the server has no such port)
    assert args.metrics_port == ports["metrics"]
    assert {p["name"]: p["targetPort"] for p in service["spec"]["ports"]} == ports


def test_grace_period_covers_the_drain() -> None:
    """Kubernetes SIGKILLs a pod terminationGracePeriodSeconds after SIGTERM: the server's
    drain must end well before that."""
    pod = by_kind("dataserver.yaml")["Deployment"]["spec"]["template"]["spec"]
    assert any(a.startswith("--drain-seconds=") for a in server_container()["args"])
    drain = serve_args(server_container()["args"]).drain_seconds
    assert drain > 0
    assert pod["terminationGracePeriodSeconds"] >= drain + 10


def test_probes_run_stats_commands_the_cli_accepts() -> None:
    container = server_container()
    data_port = container_ports(container)["data"]
    for name in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = container[name]
        command = probe["exec"]["command"]
        assert command[:2] == ["dataserver", "stats"], name
        parsed = build_parser().parse_args(command[1:])
        assert parsed.address == f"tcp://127.0.0.1:{data_port}", name
        # The kubelet kills a probe after timeoutSeconds (default 1): the command's own
        # timeout must end first, or a slow answer reads as a dead server.
        assert parsed.timeout < probe.get("timeoutSeconds", 1), name
    readiness = build_parser().parse_args(container["readinessProbe"]["exec"]["command"][1:])
    assert readiness.check, "readiness waits for every worker (--check)"


def test_prometheus_scrapes_the_metrics_port() -> None:
    template = by_kind("dataserver.yaml")["Deployment"]["spec"]["template"]
    annotations = template["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/path"] == "/metrics"
    assert int(annotations["prometheus.io/port"]) == container_ports(server_container())["metrics"]
    # Prometheus scrapes the pod IP: the metrics must not listen on loopback only.
    assert serve_args(server_container()["args"]).metrics_bind == "0.0.0.0"


def test_autoscaler_scales_the_deployment_on_cpu_without_flapping() -> None:
    kinds = by_kind("dataserver.yaml")
    hpa, deployment = kinds["HorizontalPodAutoscaler"], kinds["Deployment"]
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": deployment["apiVersion"],
        "kind": "Deployment",
        "name": deployment["metadata"]["name"],
    }
    assert 2 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Resource" and metric["resource"]["name"] == "cpu"
    assert 0 < metric["resource"]["target"]["averageUtilization"] <= 100
    # CPU utilization is a share of the request: without one the autoscaler does nothing.
    assert server_container()["resources"]["requests"]["cpu"]
    down = hpa["spec"]["behavior"]["scaleDown"]
    assert down["stabilizationWindowSeconds"] >= 300
    assert all(p["type"] != "Pods" or p["value"] == 1 for p in down["policies"])


def test_disruption_budget_selects_the_server_pods_and_lets_drains_proceed() -> None:
    kinds = by_kind("dataserver.yaml")
    pdb, hpa = kinds["PodDisruptionBudget"], kinds["HorizontalPodAutoscaler"]
    labels = kinds["Deployment"]["spec"]["template"]["metadata"]["labels"]
    selector = pdb["spec"]["selector"]
    assert set(selector) == {"matchLabels"}
    assert selector["matchLabels"].items() <= labels.items()
    if "maxUnavailable" in pdb["spec"]:
        assert pdb["spec"]["maxUnavailable"] >= 1
    else:  # a budget that allows no eviction at minReplicas would block every node drain
        assert pdb["spec"]["minAvailable"] < hpa["spec"]["minReplicas"]


# --- scaling on the data tier's own metrics ---------------------------------------------


def adapter_rules() -> dict[str, Any]:
    (config_map,) = docs("prometheus-adapter.yaml")
    rules = yaml.safe_load(config_map["data"]["config.yaml"])
    assert isinstance(rules, dict)
    return rules


def test_adapter_rules_query_the_metrics_the_servers_and_clients_export() -> None:
    rules = adapter_rules()
    assert rules["rules"] and rules["externalRules"]
    for rule in rules["rules"] + rules["externalRules"]:
        for key in ("seriesQuery", "metricsQuery"):
            for name in re.findall(r"\bdataserver_\w+", rule[key]):
                assert re.sub(r"_(bucket|sum|count)$", "", name) in METRICS, (key, name)
        series = re.match(r"'?(\w+)", rule["seriesQuery"])
        assert series and re.fullmatch(rule["name"]["matches"], series.group(1))
        assert set(rule["resources"]["overrides"]) <= {"namespace", "pod"}
    queries = " ".join(r["metricsQuery"] for r in rules["rules"] + rules["externalRules"])
    for needed in ("dataserver_workers_busy", "dataserver_workers{", "data_wait_seconds"):
        assert needed in queries


def test_alternative_autoscaler_uses_the_adapters_metrics() -> None:
    alternative = alternative_hpa()
    rules = adapter_rules()
    custom = {r["name"]["as"] for r in rules["rules"]}
    external = {r["name"]["as"] for r in rules["externalRules"]}
    hpa = by_kind("dataserver.yaml")["HorizontalPodAutoscaler"]
    assert alternative["metadata"]["name"] == hpa["metadata"]["name"]  # replaces it
    assert alternative["spec"]["scaleTargetRef"] == hpa["spec"]["scaleTargetRef"]
    assert alternative["spec"]["behavior"] == hpa["spec"]["behavior"]
    types: set[str] = set()
    for metric in alternative["spec"]["metrics"]:
        types.add(metric["type"])
        if metric["type"] == "Pods":
            assert metric["pods"]["metric"]["name"] in custom
        else:
            assert metric["type"] == "External"
            assert metric["external"]["metric"]["name"] in external
    assert types == {"Pods", "External"}


# --- the trainer Job --------------------------------------------------------------------


def test_trainer_job_runs_torchrun_against_the_service() -> None:
    kinds = by_kind("trainer-job.yaml")
    service, job = kinds["Service"], kinds["Job"]
    server = by_kind("dataserver.yaml")
    assert job["spec"]["completionMode"] == "Indexed"
    pod = job["spec"]["template"]["spec"]
    container = pod["containers"][0]
    env = [e["name"] for e in container["env"]]
    address = next(e["value"] for e in container["env"] if e["name"] == "DATASERVER_ADDRESS")
    data_port = container_ports(server_container())["data"]
    assert address.startswith(f"tcp://{server['Service']['metadata']['name']}.")
    assert address.endswith(f".svc.cluster.local:{data_port}")
    # Kubernetes expands $(VAR) only from variables defined before it in the same container.
    for i, item in enumerate(container["env"]):
        for ref in re.findall(r"\$\((\w+)\)", item.get("value", "")):
            assert ref in env[:i], ref
    command = container["command"]
    for ref in re.findall(r"\$\((\w+)\)", " ".join(command)):
        assert ref in env, ref
    assert command[0] == "torchrun" and "--servers=$(DATASERVER_ADDRESS)" in command
    script = next(c for c in command if c.endswith(".py"))
    assert script.endswith("examples/train_detector.py")
    flags = {c.partition("=")[0]: c.partition("=")[2] for c in command if c.startswith("--")}
    assert int(flags["--nnodes"]) == job["spec"]["completions"] == job["spec"]["parallelism"]
    assert int(flags["--nproc-per-node"]) == container["resources"]["limits"]["nvidia.com/gpu"]
    # Rank 0's stable name: <job>-0.<subdomain>, served by the trainer's headless Service.
    assert pod["subdomain"] == service["metadata"]["name"]
    assert service["spec"]["selector"] == {"job-name": job["metadata"]["name"]}
    rdzv = f"{job['metadata']['name']}-0.{service['metadata']['name']}"
    assert flags["--rdzv-endpoint"] == f"{rdzv}:{service['spec']['ports'][0]['port']}"


# --- the image ---------------------------------------------------------------------------


def test_dockerfile_pins_torch_before_the_project_and_serves_by_default() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11", text, re.M)
    torch_at = text.index('pip install "torch==${TORCH_VERSION}"')
    project_at = text.index("pip install .")
    assert torch_at < project_at
    assert 'ENTRYPOINT ["dataserver"]' in text and '"serve", "--bind", "tcp://0.0.0.0:5555"' in text
    assert "USER dataserver" in text
    for copied in re.findall(r"^COPY (\S+)", text, re.M):
        assert (DEPLOY.parent / copied).exists(), copied


# --- Slurm, run against fake Slurm commands ----------------------------------------------

needs_bash = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")

# One fake for scontrol, srun, squeue, scancel and dataserver (it looks at its own name).
# `scontrol show hostnames` expands "cpu[01-02],gpu7"; srun, scancel and dataserver log their
# argv as JSON lines; a fake `srun ... dataserver serve` runs until SIGTERM (logged: the drain
# at the end), which `scancel --signal=TERM` of its step (step 0, as `squeue --steps` says)
# sends it; a fake `dataserver stats` answers once that server has started.
FAKE = r"""
import json, os, re, signal, sys, time

name = os.path.basename(sys.argv[0])
args = sys.argv[1:]
log = os.environ["FAKE_SLURM_LOG"]


def record(**entry):
    with open(log, "a") as f:
        f.write(json.dumps({"prog": name, "argv": args, **entry}) + "\n")


if name == "scontrol":
    if args[:2] != ["show", "hostnames"]:
        sys.exit(1)
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?", args[2]):
        m = re.fullmatch(r"(.*)\[(.*)\]", part)
        if not m:
            print(part)
            continue
        for span in m.group(2).split(","):
            lo, _, hi = span.partition("-")
            for i in range(int(lo), int(hi or lo) + 1):
                print(f"{m.group(1)}{i:0{len(lo)}d}")
elif name == "srun" and "serve" in args:
    signal.signal(signal.SIGTERM, lambda *_: (record(signal="TERM"), sys.exit(0)))
    with open(log + ".serve-pid", "w") as f:
        f.write(str(os.getpid()))
    record(started=True)
    time.sleep(60)
elif name == "squeue":
    step = next(a.split("=", 1)[1] for a in args if a.startswith("--jobs="))
    print(f"{step}.batch batch\n{step}.0 dataserver-serve")
elif name == "scancel":
    record()
    if "--signal=TERM" in args and os.path.exists(log + ".serve-pid"):
        os.kill(int(open(log + ".serve-pid").read()), signal.SIGTERM)
else:
    if name == "dataserver" and args[:1] == ["stats"]:
        deadline = time.time() + 20
        while time.time() < deadline and '"started": true' not in open(log).read():
            time.sleep(0.05)
    record()
"""


def fake_slurm(tmp_path: Path, **env: str) -> tuple[dict[str, str], Path]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("scontrol", "srun", "squeue", "scancel", "dataserver"):
        fake = bin_dir / name
        fake.write_text(f"#!{sys.executable}\n{FAKE}")
        fake.chmod(0o755)
    log = tmp_path / "calls.jsonl"
    log.touch()
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    base["PATH"] = f"{bin_dir}{os.pathsep}{base['PATH']}"
    return {**base, "FAKE_SLURM_LOG": str(log), "SLURM_JOB_ID": "42", **env}, log


def run_script(
    script: str, env: dict[str, str], *args: str, check: bool = True
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        ["bash", str(SLURM / script), *args],
        env=env,
        cwd=DEPLOY.parent,
        capture_output=True,
        text=True,
        timeout=90,
    )
    if check:
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def calls(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def after(argv: list[str], program: str) -> list[str]:
    return argv[argv.index(program) + 1 :]


def flag(argv: list[str], name: str) -> str:
    values = [a.split("=", 1)[1] for a in argv if a.startswith(f"{name}=")]
    values += [argv[i + 1] for i, a in enumerate(argv) if a == name]
    (value,) = values
    return value


@needs_bash
@pytest.mark.parametrize("script", sorted(p.name for p in SLURM.glob("*.sbatch")))
def test_slurm_script_is_valid_bash(script: str) -> None:
    subprocess.run(["bash", "-n", str(SLURM / script)], check=True)
    text = (SLURM / script).read_text()
    assert text.startswith("#!/bin/bash\n") and "set -euo pipefail" in text


@needs_bash
def test_hetjob_finds_the_data_nodes_in_its_first_components_host_list(tmp_path: Path) -> None:
    env, _ = fake_slurm(
        tmp_path,
        SLURM_JOB_NODELIST_HET_GROUP_0="cpu[01-02],cpu07",
        SLURM_JOB_NODELIST_HET_GROUP_1="gpu[1-4]",
    )
    out = run_script("train-hetjob.sbatch", env, "--print-servers").stdout.split()
    assert out == ["tcp://cpu01:5555,tcp://cpu02:5555,tcp://cpu07:5555"]
    env.update(DATASERVER_PORT="6000", DATASERVER_HOST_SUFFIX="-ib")
    out = run_script("train-hetjob.sbatch", env, "--print-servers").stdout.split()
    assert out == ["tcp://cpu01-ib:6000,tcp://cpu02-ib:6000,tcp://cpu07-ib:6000"]
    # Not a heterogeneous job: a clear error, not a server list built from nothing.
    del env["SLURM_JOB_NODELIST_HET_GROUP_1"]
    proc = run_script("train-hetjob.sbatch", env, "--print-servers", check=False)
    assert proc.returncode == 2 and "train.sbatch" in proc.stderr


@needs_bash
def test_hetjob_serves_on_cpu_nodes_waits_then_trains_on_gpu_nodes(tmp_path: Path) -> None:
    env, log = fake_slurm(
        tmp_path,
        SLURM_JOB_NODELIST_HET_GROUP_0="cpu[01-02]",
        SLURM_JOB_NODELIST_HET_GROUP_1="gpu[1-3]",
        SLURM_JOB_CPUS_PER_NODE_HET_GROUP_0="64(x2)",
        SLURM_JOB_CPUS_PER_NODE_HET_GROUP_1="96(x3)",
        METRICS_PORT="9555",
        GPUS_PER_NODE="4",
    )
    run_script("train-hetjob.sbatch", env)
    servers = ["tcp://cpu01:5555", "tcp://cpu02:5555"]
    made = calls(log)
    serve = next(c["argv"] for c in made if c["prog"] == "srun" and "serve" in c["argv"])
    assert flag(serve, "--job-name") == "dataserver-serve"
    assert serve[1:4] == ["--het-group=0", "--ntasks-per-node=1", "--cpus-per-task=64"]
    parsed = serve_args(after(serve, "dataserver"))
    assert parsed.bind == "tcp://0.0.0.0:5555" and parsed.drain_seconds < 30  # Slurm's KillWait
    assert parsed.metrics_port == 9555
    stats = [c["argv"] for c in made if c["prog"] == "dataserver"]
    assert [build_parser().parse_args(s).address for s in stats] == servers
    assert all(build_parser().parse_args(s).check for s in stats)
    (at,) = [i for i, c in enumerate(made) if c["prog"] == "srun" and "torchrun" in c["argv"]]
    assert all(i < at for i, c in enumerate(made) if c["prog"] == "dataserver"), "waits first"
    train = made[at]["argv"]
    # (a node whose torchrun fails ends the step: no waiting out torchrun's exit barrier)
    assert train[:4] == [
        "--kill-on-bad-exit=1", "--het-group=1", "--ntasks-per-node=1", "--cpus-per-task=96"
    ]  # fmt: skip
    torchrun = after(train, "torchrun")
    assert flag(torchrun, "--nnodes") == "3" and flag(torchrun, "--nproc-per-node") == "4"
    assert flag(torchrun, "--rdzv-endpoint") == "gpu1:29500"
    assert flag(torchrun, "--servers") == ",".join(servers)
    # SIGTERM (drain) for the servers at the end, to their step: srun would SIGKILL them.
    assert made[-2] == {"prog": "scancel", "argv": ["--signal=TERM", "42.0"]}
    assert made[-1].get("signal") == "TERM"


@needs_bash
def test_single_partition_script_serves_on_the_first_nodes_then_trains(tmp_path: Path) -> None:
    env, log = fake_slurm(tmp_path, SLURM_JOB_NODELIST="node[1-6]", DATA_NODES="2")
    out = run_script("train.sbatch", env, "--print-servers").stdout.split()
    assert out == ["tcp://node1:5555,tcp://node2:5555"]
    run_script("train.sbatch", env)
    made = calls(log)
    serve = next(c["argv"] for c in made if c["prog"] == "srun" and "serve" in c["argv"])
    assert flag(serve, "--nodelist") == "node1,node2"
    assert serve_args(after(serve, "dataserver")).drain_seconds < 30
    stats = [build_parser().parse_args(c["argv"]) for c in made if c["prog"] == "dataserver"]
    assert [s.address for s in stats] == ["tcp://node1:5555", "tcp://node2:5555"]
    (train_argv,) = [c["argv"] for c in made if c["prog"] == "srun" and "torchrun" in c["argv"]]
    assert flag(train_argv, "--nodelist") == "node3,node4,node5,node6"
    assert "--kill-on-bad-exit=1" in train_argv[: train_argv.index("torchrun")]
    torchrun = after(train_argv, "torchrun")
    assert flag(torchrun, "--nnodes") == "4" and flag(torchrun, "--rdzv-endpoint") == "node3:29500"
    assert flag(torchrun, "--servers") == "tcp://node1:5555,tcp://node2:5555"
    assert flag(serve, "--ntasks") == "2" and flag(train_argv, "--ntasks") == "4"
    assert made[-2] == {"prog": "scancel", "argv": ["--signal=TERM", "42.0"]}
    assert made[-1].get("signal") == "TERM"


def test_object_storage_variant_takes_credentials_from_a_secret() -> None:
    """deploy/k8s/dataserver-s3.yaml: the real CLI takes its serve arguments (a wds:s3://
    dataset, the fetch cache), credentials come from a Secret, no PersistentVolumeClaim."""
    pod = by_kind("dataserver-s3.yaml")["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = serve_args(container["args"])
    assert args.dataset.startswith("wds:s3://") and args.fetch_cache_gb > 0
    assert container["envFrom"] == [{"secretRef": {"name": "dataserver-s3"}}]
    assert not any("persistentVolumeClaim" in v for v in pod["volumes"])
