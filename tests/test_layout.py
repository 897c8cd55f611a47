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


# Writes to another object's attribute that the client allows, each with its reason.
FOREIGN_WRITES_ALLOWED: set[tuple[str, str]] = {
    # pyzmq sets CURVE keys as socket attributes (its API for socket options).
    ("links", "curve_serverkey"),
    ("links", "curve_publickey"),
    ("links", "curve_secretkey"),
    # The mmengine bridge fills mmengine's own objects the way mmengine documents.
    ("mmengine", "gt_instances"),
    ("mmengine", "endless"),
    ("mmengine", "dataloader_iterator"),
}
# Exception chaining (``raise ... from`` spelled out) is the language's, not an object's.
ALLOWED_EVERYWHERE = {"__cause__"}


def _record_fields(tree: ast.Module) -> set[str]:
    """Fields of the dataclasses a module defines: records it creates and fills itself."""
    fields: set[str] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef):
            continue
        if not any("dataclass" in ast.unparse(d) for d in node.decorator_list):
            continue
        for stmt in node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                fields.add(stmt.target.id)
    return fields


def foreign_writes(path: Path) -> list[str]:
    """Assignments, augmented assignments and deletions of ``X.attr`` where ``X`` is not
    ``self`` (nor ``cls``), except fields of a dataclass the same module defines."""
    tree = ast.parse(path.read_text())
    own = _record_fields(tree)
    targets: list[ast.expr] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            targets.extend(node.targets)
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets.append(node.target)
        elif isinstance(node, ast.Delete):
            targets.extend(node.targets)
    flat: list[ast.expr] = []
    while targets:
        t = targets.pop()
        if isinstance(t, ast.Tuple | ast.List):
            targets.extend(t.elts)
        else:
            flat.append(t)
    out = []
    for t in flat:
        if not isinstance(t, ast.Attribute):
            continue
        owner = t.value
        if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
            continue
        if (
            t.attr in own
            or t.attr in ALLOWED_EVERYWHERE
            or (path.stem, t.attr) in FOREIGN_WRITES_ALLOWED
        ):
            continue
        out.append(f"{path.name}:{t.lineno}: {ast.unparse(t)}")
    return out


def test_no_client_module_writes_another_objects_fields() -> None:
    """A field is written only by methods of the object that holds it (STYLE.md)."""
    base = PACKAGES["dataserver_client"]
    found = [w for p in sorted(base.rglob("*.py")) for w in foreign_writes(p)]
    assert not found, "writes into another object's fields:\n" + "\n".join(found)
