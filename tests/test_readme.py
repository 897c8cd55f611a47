"""The README's two newcomer commands: they are what CI runs, and the first one works in
a fresh virtual environment on a copy of the repository."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def readme_commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    return [b.strip() for b in blocks[:2]]


def test_readme_opens_with_the_demo_and_the_test_commands() -> None:
    demo, tests = readme_commands()
    assert demo.endswith("dataserver demo") and "pip install torch==2.13.0" in demo
    assert tests.endswith("pytest") and 'pip install -e ".[test]"' in tests
    ci = (ROOT / ".ci" / "run").read_text()
    # CI installs the same way (torch pinned first), then runs the README's test command.
    assert "torch==2.14.1 torchvision==0.29.1" in tests
    assert "torch==2.14.1 torchvision==0.29.1" in ci and 'pip install --quiet -e ".[test]"' in ci
    assert ci.strip().endswith("pytest")


@pytest.mark.timeout(900)
def test_readme_demo_command_works_in_a_fresh_venv(tmp_path: Path) -> None:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs the git checkout to copy the tracked files")
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    copy = tmp_path / "repo"
    for name in files:
        src = ROOT / name
        if src.is_file():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, copy / name)
    demo, _ = readme_commands()
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if ".venv" not in p)
    proc = subprocess.run(
        ["bash", "-c", demo], cwd=copy, capture_output=True, text=True, timeout=840, env=env
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "0 stale batches" in proc.stdout
    assert " regular " in proc.stdout and " stitch " in proc.stdout
