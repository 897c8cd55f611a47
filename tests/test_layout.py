"""The layout rules of DEVELOPERS.md that a reader relies on: no import cycles among the
project's modules, nothing on the server side imports torch, and no module of either package
writes another object's fields (attributes, their containers, through aliases)."""

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


def runtime_imports(path: Path) -> list[str]:
    """What ``path`` imports anywhere (function bodies too), except under
    ``if TYPE_CHECKING:``: each module, and each ``module.name`` of a ``from`` import."""
    tree = ast.parse(path.read_text())
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    names: list[str] = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return names


def imports_of(path: Path, known: set[str]) -> set[str]:
    """Project modules ``path`` imports anywhere (function bodies too), except under
    ``if TYPE_CHECKING:``."""
    out: set[str] = set()
    for imported in runtime_imports(path):
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


# The server's process boundary, as folders: the front's modules and a worker's never import
# each other's; the modules shared at ``dataserver.server`` import neither (the package's
# ``__init__``, ``serve``, starts the front and is above both).
SERVER_SIDES = ("front", "worker")


def server_side(name: str) -> str | None:
    """ "front" or "worker" for a module of those packages, "" for a shared module of
    ``dataserver.server``, None elsewhere (and for ``dataserver.server`` itself)."""
    parts = name.split(".")
    if parts[:2] != ["dataserver", "server"] or len(parts) < 3:
        return None
    return parts[2] if parts[2] in SERVER_SIDES else ""


def test_the_front_and_the_worker_never_import_each_other() -> None:
    g = graph()
    sides = {server_side(n) for n in g} - {None}
    assert sides == {"front", "worker", ""}, sides
    for name in sorted(n for n in g if server_side(n) is not None):
        side = server_side(name)
        for dep in sorted(g[name]):
            other = server_side(dep)
            what = "a shared module" if side == "" else f"the {side}"
            assert other is None or other in (side, ""), f"{name} ({what}) imports {dep} ({other})"


# The client's layers, as folders (DEVELOPERS.md, "The client's packages"): each package of
# ``dataserver_client`` may import, at run time, only its own modules, the packages below it,
# and the client's shared modules at the package's top named here. The facade
# (``dataserver_client.client``, ``__init__``) and the integrations are above them all.
LAYERS: dict[str, tuple[set[str], set[str]]] = {  # package: (packages below, shared modules)
    "plan": (set(), {"errors"}),
    "session": ({"plan"}, {"errors", "counts"}),
    "net": ({"plan"}, {"errors"}),
    "buffers": ({"plan", "session"}, {"errors", "config", "batch"}),
    "engine": (
        {"plan", "session", "net", "buffers"},
        {"errors", "config", "counts", "batch"},
    ),
}
# What a package must not import transitively, at run time (nothing below the buffers
# imports torch; the plan and the session record open no sockets).
BANNED = {"plan": ("torch", "zmq"), "session": ("torch", "zmq"), "net": ("torch",)}


def client_package(name: str) -> str | None:
    """The layer package of a client module (``dataserver_client.net.links``: "net"),
    "" for a shared module at the top, None outside the client."""
    parts = name.split(".")
    if parts[0] != "dataserver_client" or len(parts) < 2:
        return None
    return parts[1] if parts[1] in LAYERS else ""


def test_each_client_package_imports_only_the_layers_below_it() -> None:
    g = graph()
    layered = [n for n in g if client_package(n)]
    assert {client_package(n) for n in layered} == set(LAYERS), "a layer package is empty"
    for name in sorted(layered):
        own = client_package(name)
        assert own is not None
        below, shared = LAYERS[own]
        for dep in sorted(g[name]):
            pkg = client_package(dep)
            if pkg is None or pkg == own:
                continue
            if pkg == "":
                top = dep.split(".")[1] if "." in dep else ""
                assert top in shared, f"{name} imports {dep}: not a shared module {own} may use"
            else:
                assert pkg in below, f"{name} imports {dep}: {pkg} is not below {own}"


def test_the_lower_layers_import_neither_torch_nor_zmq() -> None:
    """Transitively, through the project's modules (what runs at import: not under
    ``if TYPE_CHECKING:``; the packages' ``__init__`` files import nothing)."""
    g = graph()
    paths = {module_name(p): p for base in PACKAGES.values() for p in base.rglob("*.py")}
    starts = [n for n in g if client_package(n) in BANNED]
    assert starts
    for start in sorted(starts):
        banned_roots = BANNED[client_package(start) or ""]
        seen, todo = {start}, [start]
        while todo:
            for dep in g[todo.pop()] - seen:
                seen.add(dep)
                todo.append(dep)
        for name in sorted(seen):
            banned = [m for m in runtime_imports(paths[name]) if m.split(".")[0] in banned_roots]
            assert not banned, f"{start} imports {name}, which imports {banned}"


def test_the_planning_check_sees_a_torch_import(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import zmq\n"
        "def f():\n    from torch.cuda import Stream\n"
    )
    assert runtime_imports(module) == [
        "typing",
        "typing.TYPE_CHECKING",
        "torch.cuda",
        "torch.cuda.Stream",
    ]


# ---------------------------------------------------------------- who writes what
#
# A field is written only by the object that holds it (the house style, DEVELOPERS.md): by its
# methods, or, for a record (a dataclass or a msgspec Struct), by the code of the module that
# defines the record. The test below reads every module of both packages and reports, as a
# write into another object's field:
#
# - ``x.f = v``, ``x.f += v``, ``del x.f`` where ``x`` is not ``self``/``cls`` (``self.a.f = v``
#   writes a field of the object ``self.a``, not of ``self``);
# - ``x.f[k] = v``, ``x.f[k] += v``, ``del x.f[k]`` (the container ``f`` belongs to ``x``);
# - a mutating call (``MUTATORS``) on ``x.f`` or ``x.f[k]``: ``x.f.append(v)``;
# - the same through a local alias: ``d = x.f`` (or ``x.f[k]``), then ``d.append(v)``,
#   ``d[k] = v`` or ``del d[k]``.
#
# A method writing another instance of its own class writes its own kind's fields: allowed.
# Which class ``x`` is is read from the code, without running it: annotations (parameters,
# locals, the class's ``a: T`` or ``self.a: T``), ``x = C(...)`` (``cls(...)``,
# ``ctx.socket(...)``: a ``zmq.Socket``), ``self.a = param``, ``isinstance(x, C)``, an
# element of an annotated container (``for x in xs``, ``xs[k]``, ``xs.get(k)``, ``.pop``,
# ``.values()``, ``.items()``, ``sorted``/``enumerate``/a filtering generator), a method's
# return annotation. Where it cannot be told, the write is reported: annotate the local, or
# better give the holder a method. Exemptions are by class (``FOREIGN_OWNERS_ALLOWED``),
# never by field name. Limits: an alias through a call (``d = x.items()``) or a loop
# (``for d in x.lists: d.append(v)``), and a container handed over by reference
# (``self.counts = other.counts``, then ``self.counts[k] += 1``), are not followed; a
# project class's method named like a container's (``pop``) called on another object's
# attribute is reported (give the holder a method instead).

MUTATORS = frozenset(
    {
        "append", "appendleft", "extend", "extendleft", "insert", "pop", "popleft",
        "popitem", "remove", "clear", "update", "setdefault", "add", "discard", "sort",
        "reverse", "rotate", "difference_update", "intersection_update",
        "symmetric_difference_update", "__setitem__", "__delitem__", "__iadd__",
    }
)  # fmt: skip

# Classes (as the code names them) and modules whose state code outside them may write, each
# with its reason.
FOREIGN_OWNERS_ALLOWED: dict[str, str] = {
    "zmq.Socket": "pyzmq takes socket options as attributes (sock.curve_serverkey = key): "
    "its documented API for setsockopt",
    "BaseDataElement": "mmengine's data samples take their fields as attributes "
    "(sample.gt_instances = ...), as mmengine documents",
    "IterBasedTrainLoop": "the mmengine bridge hands the loop its batches through the "
    "loop's dataloader_iterator, the attribute mmengine's loop reads them from",
    "COCO": "pycocotools' COCO is filled in memory by setting its dataset, then createIndex() "
    "(what its own loadRes does)",
    "RFDETR": "train_rfdetr ends as RFDETR.train() ends: it marks the detector trained "
    "(_has_been_trained, what train() sets)",
    "ModelContext": "RFDETR.train() syncs the trained module, args and class_names onto the "
    "detector's ModelContext by these attributes; train_rfdetr does the same",
    "ModelConfig": "RF-DETR aligns num_classes to the dataset by setting it on the pydantic "
    "ModelConfig before building its module (_align_num_classes_from_dataset)",
    "Namespace": "RF-DETR's legacy model args are an argparse Namespace it updates in place",
    "Trainer": "Lightning's Trainer keeps its callbacks in a plain list (trainer.callbacks); "
    "train_rfdetr adds its caller's trainer_callbacks to those RF-DETR's build_trainer made",
    "os": "os.environ is the process's environment, set before a library or a child reads it",
    "sys": "sys.path and sys.modules are the interpreter's import state, there to be set",
    "tarfile.TarInfo": "tarfile takes a member's header as attributes (info.size = n) before "
    "addfile, as its documentation shows",
}

SEQUENCES = {"list", "deque", "set", "frozenset", "Sequence", "Iterable", "Iterator", "tuple"}
MAPPINGS = {"dict", "OrderedDict", "defaultdict", "Mapping", "MutableMapping"}


def _unwrap(ann: ast.expr | None) -> ast.expr | None:
    """An annotation without ``| None``/``Optional`` and quotes: what a value is when set."""
    if isinstance(ann, ast.Constant) and isinstance(ann.value, str):
        try:
            ann = ast.parse(ann.value, mode="eval").body
        except SyntaxError:
            return None
    if isinstance(ann, ast.BinOp) and isinstance(ann.op, ast.BitOr):
        sides = [s for s in (ann.left, ann.right) if ast.unparse(s) != "None"]
        return _unwrap(sides[0]) if len(sides) == 1 else None
    if isinstance(ann, ast.Subscript) and ast.unparse(ann.value) in ("Optional", "typing.Optional"):
        return _unwrap(ann.slice)
    return ann


def _class_name(ann: ast.expr | None) -> str | None:
    """The class an annotation names (``C``, ``mod.C``, ``C | None``, ``C[...]``, ``"C"``)."""
    ann = _unwrap(ann)
    if isinstance(ann, ast.Subscript):
        ann = ann.value
    if isinstance(ann, ast.Name | ast.Attribute):
        name = ast.unparse(ann)
        return name if name.rpartition(".")[2].lstrip("_")[:1].isupper() else None
    return None


def _element(ann: ast.expr | None, key: bool = False) -> ast.expr | None:
    """What a container annotation holds: a sequence's items, a mapping's values (keys)."""
    ann = _unwrap(ann)
    if not isinstance(ann, ast.Subscript):
        return None
    kind = ast.unparse(ann.value).rpartition(".")[2]
    args = ann.slice.elts if isinstance(ann.slice, ast.Tuple) else [ann.slice]
    if kind in MAPPINGS and len(args) == 2:
        return args[0] if key else args[1]
    return args[0] if kind in SEQUENCES and not key else None


def _made_by(value: ast.expr | None) -> ast.expr | None:
    """The class ``C(...)`` makes (a capitalised name), or ``zmq.Socket`` for ``ctx.socket()``."""
    if not isinstance(value, ast.Call):
        return None
    if isinstance(value.func, ast.Attribute) and value.func.attr == "socket":
        return ast.parse("zmq.Socket", mode="eval").body
    return value.func if _class_name(value.func) else None


def _records(tree: ast.Module) -> dict[str, set[str]]:
    """The records a module defines (dataclasses, msgspec Structs) and their fields."""
    out: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef):
            continue
        dataclass = any("dataclass" in ast.unparse(d) for d in node.decorator_list)
        struct = any(ast.unparse(b).endswith("Struct") for b in node.bases)
        if dataclass or struct:
            out[node.name] = {
                s.target.id
                for s in node.body
                if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
            }
    return out


def _field_types(cls: ast.ClassDef) -> dict[str, ast.expr]:
    """What a class's fields hold, as it declares them (``a: T``, ``self.a: T = ...``) or
    assigns them (``self.a = C(...)``, ``self.a = param`` of an annotated parameter)."""
    out: dict[str, ast.expr] = {}
    for s in cls.body:
        if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name):
            out[s.target.id] = s.annotation
    for method in cls.body:
        if not isinstance(method, ast.FunctionDef):
            continue
        params = {a.arg: a.annotation for a in method.args.args if a.annotation is not None}
        for node in ast.walk(method):
            targets: list[ast.expr]
            ann: ast.expr | None
            if isinstance(node, ast.AnnAssign):
                targets, ann = [node.target], node.annotation
            elif isinstance(node, ast.Assign):
                value = node.value
                ann = params.get(value.id) if isinstance(value, ast.Name) else _made_by(value)
                targets = node.targets
            else:
                continue
            for t in targets:
                if isinstance(t, ast.Attribute) and ast.unparse(t.value) == "self" and ann:
                    out.setdefault(t.attr, ann)
    return out


class _Writes(ast.NodeVisitor):
    """Collects the writes into another object's fields of one module."""

    def __init__(self, path: Path, tree: ast.Module) -> None:
        self.path = path
        self.records = _records(tree)
        self.classes = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
        self.types = {name: _field_types(c) for name, c in self.classes.items()}
        self.modules = {
            (a.asname or a.name).partition(".")[0]
            for n in tree.body
            if isinstance(n, ast.Import)
            for a in n.names
        }
        self.cls: ast.ClassDef | None = None
        self.local: dict[str, ast.expr] = {}
        self.narrowed: dict[str, ast.expr] = {}  # isinstance(x, C) in the function
        self.alias: dict[str, ast.Attribute] = {}
        self.found: list[str] = []

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        outer, self.cls = self.cls, node
        self.generic_visit(node)
        self.cls = outer

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        outer = self.local, self.alias, self.narrowed
        self.local, self.alias, self.narrowed = dict(outer[0]), dict(outer[1]), dict(outer[2])
        args = node.args
        for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
            if a.annotation is not None:
                self.local[a.arg] = a.annotation
        for n in ast.walk(node):  # isinstance(x, C): x is a C where it is written
            if not (isinstance(n, ast.Call) and ast.unparse(n.func) == "isinstance"):
                continue
            if len(n.args) == 2 and isinstance(n.args[0], ast.Name) and _class_name(n.args[1]):
                self.narrowed[n.args[0].id] = n.args[1]
        self.generic_visit(node)
        self.local, self.alias, self.narrowed = outer

    visit_AsyncFunctionDef = visit_FunctionDef

    # -- what a value is

    def _type(self, expr: ast.expr) -> ast.expr | None:
        """The annotation of what ``expr`` evaluates to, where the code says it."""
        if isinstance(expr, ast.Name):
            if expr.id == "self" and self.cls is not None:
                return ast.Name(self.cls.name)
            return self.local.get(expr.id) or self.narrowed.get(expr.id)
        if isinstance(expr, ast.Attribute):
            holder = _class_name(self._type(expr.value))
            return self.types.get(holder or "", {}).get(expr.attr)
        if isinstance(expr, ast.Subscript):
            return _element(self._type(expr.value))
        if not isinstance(expr, ast.Call):
            return None
        func = expr.func
        if isinstance(func, ast.Name) and func.id == "cls" and self.cls is not None:
            return ast.Name(self.cls.name)  # a classmethod building its own class's instance
        if isinstance(func, ast.Name) and func.id in ("list", "sorted") and len(expr.args) == 1:
            item = self._items(expr.args[0])
            return ast.Subscript(ast.Name("list"), item) if item else None
        if isinstance(func, ast.Attribute) and func.attr == "__new__":
            return func.value if _class_name(func.value) else None
        if isinstance(func, ast.Attribute):
            if func.attr in ("get", "pop", "popleft", "setdefault"):
                return _element(self._type(func.value))
            made = self.classes.get(_class_name(self._type(func.value)) or "")
            for method in made.body if made else []:
                if isinstance(method, ast.FunctionDef) and method.name == func.attr:
                    return method.returns
        return _made_by(expr)

    def _items(self, expr: ast.expr) -> ast.expr | None:
        """The annotation of what iterating ``expr`` yields."""
        if isinstance(expr, ast.GeneratorExp | ast.ListComp) and len(expr.generators) == 1:
            loop = expr.generators[0]  # (x for x in xs if ...): what xs holds
            same = isinstance(loop.target, ast.Name) and ast.unparse(expr.elt) == loop.target.id
            return self._items(loop.iter) if same else None
        if isinstance(expr, ast.Call) and len(expr.args) <= 1:
            func = expr.func
            if isinstance(func, ast.Attribute) and not expr.args:
                held = self._type(func.value)
                if func.attr == "values":
                    return _element(held)
                if func.attr == "keys":
                    return _element(held, key=True)
                if func.attr == "items":
                    key, value = _element(held, key=True), _element(held)
                    return ast.Tuple([key, value]) if key and value else None
            if isinstance(func, ast.Name) and expr.args:
                if func.id in ("list", "sorted", "reversed", "tuple"):
                    return self._items(expr.args[0])
                if func.id == "enumerate":
                    item = self._items(expr.args[0])
                    return ast.Tuple([ast.Name("int"), item]) if item else None
        held = self._type(expr)
        kind = ast.unparse(_unwrap(held).value) if isinstance(_unwrap(held), ast.Subscript) else ""  # type: ignore[union-attr]
        return _element(held, key=kind.rpartition(".")[2] in MAPPINGS)

    def _bind(self, t: ast.expr, ann: ast.expr | None, value: ast.expr | None = None) -> None:
        """Note what a local name now holds: an annotated value, or another object's field
        (an alias of it)."""
        if isinstance(t, ast.Tuple | ast.List):
            values = value.elts if isinstance(value, ast.Tuple | ast.List) else None
            anns = ann.elts if isinstance(ann, ast.Tuple) else None
            for j, e in enumerate(t.elts):
                v = values[j] if values and j < len(values) else None
                a = anns[j] if anns and j < len(anns) else (self._type(v) if v else None)
                self._bind(e, a, v)
            return
        if not isinstance(t, ast.Name):
            return
        self.alias.pop(t.id, None)
        self.local.pop(t.id, None)
        if ann is not None:
            self.local[t.id] = ann
        inner = value
        while isinstance(inner, ast.Subscript):
            inner = inner.value
        if isinstance(inner, ast.Attribute) and not self._own(inner.value):
            self.alias[t.id] = inner

    # -- whose a write is

    def _class_of(self, owner: ast.expr) -> str | None:
        if isinstance(owner, ast.Name) and owner.id in self.modules:
            return owner.id
        return _class_name(self._type(owner))

    def _own(self, owner: ast.expr) -> bool:
        if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
            return True
        return self.cls is not None and self._class_of(owner) == self.cls.name

    def _check(self, field: ast.Attribute, node: ast.AST, write: str) -> None:
        owner = field.value
        if self._own(owner) or field.attr == "__cause__":
            return  # (exception chaining spelled out is the language's, not an object's)
        cls = self._class_of(owner)
        if cls in self.records or cls in FOREIGN_OWNERS_ALLOWED:
            return
        whose = f" ({cls}'s)" if cls else ""
        self.found.append(f"{self.path.name}:{getattr(node, 'lineno', 0)}: {write}{whose}")

    def _container(self, expr: ast.expr) -> ast.Attribute | None:
        """The field ``x.f`` a container expression (``x.f``, ``x.f[k]``, an alias) is."""
        while isinstance(expr, ast.Subscript):
            expr = expr.value
        if isinstance(expr, ast.Attribute):
            return expr
        if isinstance(expr, ast.Name):
            return self.alias.get(expr.id)
        return None

    def _target(self, t: ast.expr, node: ast.AST) -> None:
        if isinstance(t, ast.Tuple | ast.List):
            for e in t.elts:
                self._target(e, node)
        elif isinstance(t, ast.Starred):
            self._target(t.value, node)
        elif isinstance(t, ast.Attribute):
            self._check(t, node, ast.unparse(t))
        elif isinstance(t, ast.Subscript):
            field = self._container(t.value)
            if field is not None:
                self._check(field, node, ast.unparse(t))

    def visit_Assign(self, node: ast.Assign) -> None:
        self.generic_visit(node)
        for t in node.targets:
            self._target(t, node)
            self._bind(t, self._type(node.value), node.value)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self.generic_visit(node)
        if node.value is not None:
            self._target(node.target, node)
        self._bind(node.target, node.annotation, node.value)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self.generic_visit(node)
        self._target(node.target, node)

    def visit_Delete(self, node: ast.Delete) -> None:
        self.generic_visit(node)
        for t in node.targets:
            self._target(t, node)

    def visit_For(self, node: ast.For | ast.AsyncFor) -> None:
        self.visit(node.iter)
        self._bind(node.target, self._items(node.iter))
        for stmt in [*node.body, *node.orelse]:
            self.visit(stmt)

    visit_AsyncFor = visit_For

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in MUTATORS:
            field = self._container(func.value)
            if field is not None:
                self._check(field, node, ast.unparse(func))
        self.generic_visit(node)


def foreign_writes(path: Path) -> list[str]:
    """The writes of ``path``'s code into another object's fields (see above)."""
    tree = ast.parse(path.read_text())
    writes = _Writes(path, tree)
    writes.visit(tree)
    return writes.found


def test_no_module_writes_another_objects_fields() -> None:
    """A field is written only by methods of the object that holds it, or for a record by the
    module that defines it (the house style); in both packages."""
    found = [
        w
        for base in PACKAGES.values()
        for p in sorted(base.rglob("*.py"))
        for w in foreign_writes(p)
    ]
    assert not found, "writes into another object's fields:\n" + "\n".join(found)


def test_the_ownership_check_sees_calls_subscripts_aliases_and_held_objects(
    tmp_path: Path,
) -> None:
    """What the check above reports, and what it lets be (a guard against a check that
    silently sees nothing)."""
    source = tmp_path / "sample.py"
    source.write_text(
        """
from dataclasses import dataclass


@dataclass
class Record:
    items: list[int]


class Owner:
    def __init__(self, other: Other) -> None:
        self.other = other
        self.mine: list[int] = []
        self.others: list[Other] = []

    def work(self, rec: Record, peer: Other, k: int) -> None:
        self.mine.append(1)
        self.mine[0] = 2
        rec.items.append(3)
        self.other.free.append(k)
        self.other.count = 1
        peer.table[k] = 4
        peer.table[k] += 1
        del peer.table[k]
        alias = peer.queue
        alias.append(5)
        alias[0] = 6
        mine = self.mine
        mine.append(7)
        for o in self.others:
            o.count = 8
        thing = make()
        thing.count = 9
        sock = ctx.socket(1)
        sock.curve_serverkey = b"key"
"""
    )
    found = [w.split(": ", 1)[1] for w in foreign_writes(source)]
    assert found == [
        "self.other.free.append (Other's)",
        "self.other.count (Other's)",
        "peer.table[k] (Other's)",
        "peer.table[k] (Other's)",
        "peer.table[k] (Other's)",
        "alias.append (Other's)",
        "alias[0] (Other's)",
        "o.count (Other's)",
        "thing.count",
    ]
