"""The documentation: the MkDocs site builds with `--strict` (a broken link or anchor, or a
page left out of the nav, fails), the README's and DEVELOPERS.md's links point at files that
exist, and no file of the repository cites a file outside it."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\]\(([^)\s]+)\)")
# Files that live beside the repository in the project's workspace, not in it.
OUTSIDE = re.compile(r"SPEC\.md|STYLE\.md|\.\./shared|(?<![\w-])DESIGN\.md")


@pytest.mark.timeout(300)
def test_the_docs_site_builds_strict(tmp_path: Path) -> None:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "index.html").is_file()
    assert (tmp_path / "failures" / "index.html").is_file()


def relative_links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return [
        link.split("#")[0]
        for link in LINK.findall(text)
        if not re.match(r"[a-z]+:", link) and not link.startswith("#")
    ]


@pytest.mark.parametrize("name", ["README.md", "DEVELOPERS.md"])
def test_links_outside_the_site_point_at_files_that_exist(name: str) -> None:
    page = ROOT / name
    links = relative_links(page)
    missing = [link for link in links if not (page.parent / link).exists()]
    assert not missing, f"{name} links to files that do not exist: {missing}"
    if name == "README.md":
        assert "docs/benchmarks.md" in links and "docs/contract.md" in links


def test_no_file_cites_a_file_outside_the_repository() -> None:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs the git checkout to list the tracked files")
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    here = Path(__file__).resolve()
    cited = []
    for name in files:
        path = ROOT / name
        if path == here or not path.is_file() or path.suffix in {".png", ".jpg", ".pt"}:
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if OUTSIDE.search(line):
                cited.append(f"{name}:{number}: {line.strip()[:100]}")
    assert not cited, "files cite files outside the repository:\n" + "\n".join(cited)
