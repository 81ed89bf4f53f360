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
# backends.*).
LAYERS = [
    ["cluster.__main__"],
    ["cluster.cli"],
    ["cluster.api"],
    ["cluster.doctor", "cluster.execute", "cluster.clean", "cluster.top", "cluster.pull"],
    ["cluster.deep"],
    ["cluster.launch", "cluster.resolve", "cluster.tuning"],
    ["cluster.check"],
    ["cluster.watch", "cluster.hang", "cluster.timeline_png"],
    ["cluster.backends"],
    ["cluster.preflight", "cluster.hang_timeout", "cluster.timeline", "cluster.slow"],
    ["cluster.runs"],
    ["cluster.sbatch"],
    ["cluster.plan"],
    ["cluster.network", "cluster.inventory"],
    ["cluster.spec", "cluster.request", "cluster.torchrun_options", "cluster.sbatch_options",
     "cluster.container_options"],
    ["cluster.console", "cluster.nodes", "cluster.readers"],
    ["cluster.errors"],
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
