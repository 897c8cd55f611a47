"""The layout rules of DEVELOPERS.md that a reader relies on: no import cycles among the
project's modules, and nothing on the server side imports torch."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {
    "dataserver": ROOT / "dataserver",
    "dataserver_client": ROOT / "client" / "dataserver_client",
}


def module_name(path: Path) -> str:
    for package, base in PACKAGES.items():
        if path.is_relative_to(base):
            parts = [package, *path.relative_to(base).with_suffix("").parts]
            return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    raise ValueError(path)


def imports_of(path: Path, known: set[str]) -> set[str]:
    """Project modules ``path`` imports anywhere (function bodies too), except under
    ``if TYPE_CHECKING:``."""
    tree = ast.parse(path.read_text())
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for imported in names:
            name = imported
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                out.add(name)
    return out


def graph() -> dict[str, set[str]]:
    files = [p for base in PACKAGES.values() for p in base.rglob("*.py")]
    known = {module_name(p) for p in files}
    g = {module_name(p): imports_of(p, known) for p in files}
    for name, deps in g.items():  # a package's __init__ importing its own modules is no cycle
        deps.discard(name)
    return g


def test_no_import_cycles() -> None:
    g = graph()
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for dep in sorted(g[node]):
            if dep.startswith(node + "."):
                continue  # a package importing its submodules
            if state.get(dep) == 1:
                cycle = [*path[path.index(dep) :], dep]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep)
        path.pop()
        state[node] = 2

    for node in sorted(g):
        if node not in state:
            visit(node)


def test_the_server_side_never_imports_torch() -> None:
    allowed = ("dataserver.demo", "dataserver.bench")  # trainer-side programs the CLI runs
    for path in PACKAGES["dataserver"].rglob("*.py"):
        name = module_name(path)
        if name.startswith(allowed):
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                mods = [node.module or ""]
            else:
                continue
            assert not any(
                m == "torch" or m.startswith(("torch.", "dataserver_client")) for m in mods
            ), f"{name} imports {mods}"
