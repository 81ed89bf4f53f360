"""The module map (docs/architecture.md) holds: each layer of cluster/ imports only the layers
below it.

A test over the import graph, read from the sources (nothing is imported), so that a new import
that points upward fails here with the two modules named.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "cluster"

# Top to bottom (docs/architecture.md, "Module map": tests/unit/test_docs.py holds the map to this
# list). A module may import those below its own layer, and modules of its own package (cli.*,
# backends.*, recovery.*).
LAYERS = [
    ["cluster.__main__"],
    ["cluster.cli"],
    ["cluster.api"],
    ["cluster.doctor", "cluster.execute", "cluster.clean", "cluster.observe.top", "cluster.pull",
     "cluster.handle"],
    ["cluster.deep"],
    ["cluster.launch", "cluster.resolve", "cluster.tuning"],
    ["cluster.recovery.check", "cluster.observe.views"],
    ["cluster.observe.watch", "cluster.observe.hang", "cluster.observe.timeline_png",
     "cluster.observe.metrics", "cluster.observe.alerts", "cluster.recovery.pool",
     "cluster.recovery.grow"],
    ["cluster.backends", "cluster.observe.goodput"],
    ["cluster.recovery.gate", "cluster.observe.hang_timeout", "cluster.observe.timeline",
     "cluster.observe.slow", "cluster.observe.worker_errors", "cluster.recovery.ledger",
     "cluster.recovery.classes", "cluster.observe.watch_result"],
    ["cluster.runs", "cluster.recovery.hardware"],
    ["cluster.sbatch"],
    ["cluster.plan"],
    ["cluster.network", "cluster.inventory"],
    ["cluster.spec", "cluster.request", "cluster.torchrun_options", "cluster.sbatch_options",
     "cluster.container_options"],
    ["cluster.console", "cluster.nodes", "cluster.readers", "cluster.texts"],
    ["cluster.errors", "cluster.recovery", "cluster.observe", "cluster.recovery.findings"],    # the families' docstrings
]
PACKAGES = ("cluster.cli", "cluster.backends", "cluster.inventory")


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer(name: str) -> int | None:
    for rank, group in enumerate(LAYERS):
        if any(name == g or name.startswith(g + ".") for g in group):
            return rank
    return None


def package(name: str) -> str | None:
    return next((p for p in PACKAGES if name == p or name.startswith(p + ".")), None)


def imports(path: Path) -> list[tuple[str, int]]:
    """(imported module, line) for every import of cluster's own modules in one file."""
    me = module_name(path)
    base = me.split(".") if path.name == "__init__.py" else me.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            pkg = ".".join(base[:len(base) - node.level + 1]) if node.level else ""
            if node.module:
                names = [f"{pkg}.{node.module}" if pkg else node.module]
            else:                                  # from . import network
                names = [f"{pkg}.{a.name}" for a in node.names]
            found += [(n, node.lineno) for n in names if n.startswith("cluster")]
        elif isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names if a.name.startswith("cluster")]
    return found


def sources() -> list[Path]:
    """Every module but the package's own __init__ (its version) and the node-side programs."""
    return [p for p in ROOT.rglob("*.py")
            if "remote" not in p.relative_to(ROOT).parts and p != ROOT / "__init__.py"]


def test_every_module_has_a_layer() -> None:
    assert [module_name(p) for p in sources() if layer(module_name(p)) is None] == []


def test_imports_point_down() -> None:
    upward = []
    for path in sources():
        me = module_name(path)
        for target, line in imports(path):
            if target == "cluster" or package(target) and package(target) == package(me):
                continue
            if layer(target) is None or layer(me) is None:
                continue
            if layer(target) <= layer(me):
                upward.append(f"{path.relative_to(ROOT.parent)}:{line}: {me} imports {target}")
    assert upward == [], "imports that do not point down the layers:\n" + "\n".join(upward)


def test_remote_programs_import_nothing_of_cluster() -> None:
    """They run on the nodes with the standard library only (supervisor, probe, workers)."""
    for path in (ROOT / "remote").glob("*.py"):
        assert [t for t, _ in imports(path)] == [], path


def under_type_checking(tree: ast.Module) -> set[int]:
    """ids of the import nodes inside `if TYPE_CHECKING:` blocks: they never run, so they make
    no import circle (annotations only)."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skipped


def as_module(name: str, known: set[str]) -> str:
    """The module a dotted import name loads: `cluster.backends.Backend` (a name imported from
    a package) is the package `cluster.backends`."""
    while name not in known and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def runtime_imports(path: Path, known: set[str]) -> list[tuple[str, int]]:
    """(module, line) for every import of cluster's own modules that can run: at the top or
    inside a function (a lazy import still closes a circle), not under TYPE_CHECKING."""
    me = module_name(path)
    base = me.split(".") if path.name == "__init__.py" else me.split(".")[:-1]
    tree = ast.parse(path.read_text())
    skipped = under_type_checking(tree)
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom):
            pkg = ".".join(base[:len(base) - node.level + 1]) if node.level else ""
            mod = f"{pkg}.{node.module}" if pkg and node.module else pkg or node.module or ""
            # `from . import shipping` loads a module; `from .supervised import Result` a name
            names = [f"{mod}.{a.name}" for a in node.names]
            found += [(as_module(n, known), node.lineno) for n in names if n.startswith("cluster")]
        elif isinstance(node, ast.Import):
            found += [(as_module(a.name, known), node.lineno)
                      for a in node.names if a.name.startswith("cluster")]
    return [(m, line) for m, line in found if m != me]


def import_graph() -> dict[str, dict[str, str]]:
    """module -> {imported module: 'file:line' of the import}."""
    paths = sources()
    known = {module_name(p) for p in paths}
    graph: dict[str, dict[str, str]] = {}
    for path in paths:
        edges = graph.setdefault(module_name(path), {})
        for target, line in runtime_imports(path, known):
            if target in known:
                edges.setdefault(target, f"{path.relative_to(ROOT.parent)}:{line}")
    return graph


def circles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan's algorithm): each is
    at least one import circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def test_no_import_circles() -> None:
    """No module imports, however indirectly or lazily, a module that imports it back: the
    layers above forbid a circle between layers, this one inside a layer or a package."""
    graph = import_graph()
    found = []
    for group in circles(graph):
        found += [f"{graph[a][b]}: {a} imports {b}" for a in group for b in graph[a] if b in group]
    assert found == [], "import circles:\n" + "\n".join(found)


def test_the_circle_check_sees_a_lazy_circle() -> None:
    graph = {"a": {"b": "a.py:1"}, "b": {"c": "b.py:1"}, "c": {"a": "c.py:9"}, "d": {"a": ""}}
    assert circles(graph) == [["a", "b", "c"]]
