"""The backend registry: one entry per backend (its module, imported when chosen, and its
capabilities), the backend chosen once, and capabilities asked instead of names."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from cluster import backends
from cluster.backends import (EXEC, NODE_CHECKS, REGISTRY, SYNC, choose, node_checks,
                              supports)
from cluster.errors import InputError
from cluster.spec import Host, Inventory

ROOT = Path(__file__).resolve().parents[2]


def test_every_entry_names_a_module_with_the_hooks() -> None:
    for name, entry in REGISTRY.items():
        module = entry.load()
        for hook in ("nodes", "configure", "create", "recorded"):
            assert callable(getattr(module, hook)), f"{name}: no {hook}()"


def test_a_backend_module_loads_only_when_chosen() -> None:
    code = ("import sys, cluster.api, cluster.cli.main; "
            "print(sorted(m for m in sys.modules if m.startswith('cluster.backends.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, check=True).stdout
    assert "cluster.backends.ssh" not in out and "cluster.backends.slurm'" not in out, out


def test_supports_by_name_and_by_backend() -> None:
    assert supports("ssh", SYNC) and not supports("local", SYNC)
    assert supports("local", NODE_CHECKS) and not supports("slurm", NODE_CHECKS)
    assert not supports("nosuch", EXEC)
    local = backends.create("local", Inventory(hosts=(Host(name="a", address="a"),)))
    slurm = backends.create("slurm", Inventory(hosts=(Host(name="a", address="a"),)))
    try:
        assert supports(local, EXEC) and node_checks(local) is local
        assert node_checks(slurm) is None
        assert not hasattr(slurm, "check") and not hasattr(slurm, "push")
    finally:
        local.close()
        slurm.close()


def test_the_backend_is_chosen_once() -> None:
    inv = Inventory(hosts=(Host(name="a", address="a"),), backend="slurm")
    assert choose(None, False, None) == "local"
    assert choose(None, False, inv) == "slurm"
    assert choose("ssh", False, inv) == "ssh"
    assert choose(None, True, inv) == "local"
    with pytest.raises(InputError, match="contradict"):
        choose("ssh", True, None)
    with pytest.raises(InputError, match="valid: local, ssh, slurm"):
        choose("k8s", False, None)


def test_cluster_up_offers_the_registry_s_names() -> None:
    from cluster.cli.up import up
    choice = next(p for p in up.params if p.name == "backend").type
    assert list(choice.choices) == list(backends.NAMES)


# Modules that still compare a backend's name (each is to ask supports() instead): none.
STILL_BRANCHING: set[str] = set()


def test_the_inventorys_backend_names_are_the_registrys() -> None:
    """The inventory is read below the registry (it cannot import it): its copies of the
    names, and of which backends allocate their nodes, must agree with it."""
    from cluster import spec
    assert sorted(spec.BACKENDS) == sorted(backends.NAMES)
    assert sorted(spec.ALLOCATING) == sorted(n for n in backends.NAMES
                                             if backends.supports(n, backends.ALLOCATES))


def test_no_branch_on_a_backend_s_name_outside_the_backends() -> None:
    import ast
    root = ROOT / "cluster"
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(("backends/", "remote/")) or rel in STILL_BRANCHING:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                named = [s.value for s in sides if isinstance(s, ast.Constant) and s.value in REGISTRY]
                names = [e.value for s in sides if isinstance(s, (ast.Tuple, ast.List, ast.Set))
                         for e in s.elts if isinstance(e, ast.Constant) and e.value in REGISTRY]
                if named or names:
                    found.append(f"{rel}:{node.lineno}")
    assert not found, f"ask backends.supports() instead of comparing a backend's name: {found}"


@pytest.mark.parametrize("option", [["--min-nodes", "1"], ["--hang-timeout", "60"]])
def test_a_backend_without_restarts_refuses_what_watches_an_attempt(option, tmp_path, monkeypatch,
                                                                     capsys) -> None:
    """Asked by capability: every backend without RESTARTS refuses the options of cluster's
    own restarts and watchdog, before anything is created; the ones with it take them."""
    from cluster.backends import RESTARTS
    from cluster.cli import run_cli
    monkeypatch.chdir(tmp_path)
    without = [n for n in backends.NAMES if not supports(n, RESTARTS)]
    assert without == ["slurm"]
    for name in without:
        code = run_cli(["up", "--backend", name, "--nodes", "2", *option, "--dry-run", "--", "t.py"])
        err = capsys.readouterr().err
        assert code == 2 and option[0] in err and "requeues itself" in err, err
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
    assert run_cli(["up", "--local", *option, "--dry-run", "--", "t.py"]) == 0


def test_max_restarts_under_a_backend_that_requeues_reaches_its_batch_script(tmp_path, monkeypatch,
                                                                           capsys) -> None:
    """SLURM takes --max-restarts (REQUEUES): the batch script spends it on failure requeues;
    the launcher itself restarts nothing."""
    from cluster.api import prepare
    from cluster.backends import REQUEUES, RESTARTS
    from cluster.request import Request
    monkeypatch.chdir(tmp_path)
    assert [n for n in backends.NAMES if supports(n, REQUEUES)] == ["slurm"]
    assert not supports("slurm", RESTARTS)
    prepared = prepare(Request(command=("t.py",), backend="slurm", nodes=2, max_restarts=2,
                               dry_run=True))
    try:
        assert prepared.options.restarts == 0
        assert prepared.inventory.restarts == 2
        script = prepared.backend.plan(prepared.inventory, prepared.job, prepared.templates).script
        assert "cluster_after_failure" in script and "#SBATCH --requeue\n" in script
    finally:
        prepared.backend.close()
