"""deploy/ checked statically (no container engine or cluster here): the manifests parse and
agree with each other and with the CLI, the Dockerfile pins torch before the project, the
Slurm script is valid bash that runs the right commands."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from dataserver.cli import build_parser

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


def docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((DEPLOY / "k8s" / name).read_text()) if d]


def serve_args_parse(args: list[str]) -> None:
    """The CLI accepts these arguments (argparse exits on an unknown flag)."""
    parsed = build_parser().parse_args(args)
    assert parsed.command == "serve"


def test_server_deployment_and_headless_service_agree() -> None:
    service, deployment = docs("dataserver.yaml")
    assert service["kind"] == "Service" and service["spec"]["clusterIP"] == "None"
    assert deployment["kind"] == "Deployment"
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"] == labels == deployment["spec"]["selector"]["matchLabels"]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    args = container["args"]
    serve_args_parse(args)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert f"--bind=tcp://0.0.0.0:{ports['data']}" in args
    assert f"--control-bind=tcp://0.0.0.0:{ports['control']}" in args
    assert {p["targetPort"] for p in service["spec"]["ports"]} == set(ports.values())
    probe = container["readinessProbe"]["exec"]["command"]
    assert probe[:2] == ["dataserver", "stats"] and "--check" in probe
    build_parser().parse_args(probe[1:])


def test_trainer_job_runs_torchrun_against_the_service() -> None:
    service, job = docs("trainer-job.yaml")
    assert job["kind"] == "Job" and job["spec"]["completionMode"] == "Indexed"
    container = job["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["DATASERVER_ADDRESS"].startswith("tcp://dataserver.") and env[
        "DATASERVER_ADDRESS"
    ].endswith(":5555")
    command = container["command"]
    assert command[0] == "torchrun" and "--servers=$(DATASERVER_ADDRESS)" in command
    script = next(c for c in command if c.endswith(".py"))
    assert script.endswith("examples/train_detector.py")
    nnodes = next(c for c in command if c.startswith("--nnodes="))
    assert int(nnodes.split("=")[1]) == job["spec"]["completions"]
    assert job["spec"]["template"]["spec"]["subdomain"] == service["metadata"]["name"]


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


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_slurm_script_is_valid_bash_and_serves_then_trains() -> None:
    script = DEPLOY / "slurm" / "train.sbatch"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    assert re.search(r"^#SBATCH --nodes=", text, re.M)
    assert 'dataserver serve --bind "tcp://0.0.0.0:$PORT"' in text
    assert "dataserver stats" in text and "torchrun" in text and '--servers "$SERVERS"' in text
