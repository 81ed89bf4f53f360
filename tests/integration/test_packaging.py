"""What a user installs: the wheel, built from this checkout and installed into a fresh virtual
environment outside it, runs the real thing from there.

    test_wheel_contains_every_package    every package under cluster/ is in the wheel
    test_installed_wheel_runs_ssh_nodes  the installed `cluster` command (its console script,
                                         no checkout on sys.path) launches a 2-node all_reduce
                                         over SSH on the namespaced test nodes
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

try:
    from tests.integration.conftest import PROGRAMS, Cli
except ImportError:  # run with tests/integration on sys.path
    from conftest import PROGRAMS, Cli  # type: ignore

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    # Built from a copy: setuptools writes build/ and *.egg-info next to the sources.
    src = tmp_path_factory.mktemp("src") / "cluster"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(
        ".git", "runs", "build", "*.egg-info", "__pycache__", ".*cache", ".hypothesis", ".whl"))
    out = tmp_path_factory.mktemp("wheels")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    str(src), "-w", str(out)], check=True, cwd=out, capture_output=True)
    (found,) = out.glob("cluster-*.whl")
    return found


def test_wheel_contains_every_package(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    packages = {p.parent.relative_to(REPO).as_posix()
                for p in (REPO / "cluster").rglob("__init__.py")}
    for pkg in packages:
        assert f"{pkg}/__init__.py" in names, f"{pkg} is missing from {wheel.name}"
    for data in ("cluster/remote/supervisor.py", "cluster/templates/node.sh.j2",
                 "cluster/templates/sbatch.sh.j2", "cluster/train/train.py"):
        assert data in names, f"{data} is missing from {wheel.name}"


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory) -> Path:
    """A fresh venv (no access to this checkout) with the wheel and its dependencies."""
    venv = tmp_path_factory.mktemp("user") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "--disable-pip-version-check",
                          str(wheel)], capture_output=True, text=True)
    assert pip.returncode == 0, pip.stderr
    return venv


def test_installed_wheel_runs_ssh_nodes(installed: Path, ssh_nodes4, tmp_path: Path,
                                        ssh_home: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    cli = Cli(work, ssh_home, command=[str(installed / "bin" / "cluster")])
    cli.env.pop("PYTHONPATH", None)
    try:
        where = subprocess.run([str(installed / "bin" / "python"), "-c",
                                "import cluster, cluster.backends.ssh; print(cluster.__file__)"],
                               cwd=work, env=cli.env, capture_output=True, text=True)
        assert where.returncode == 0, where.stderr
        assert where.stdout.startswith(str(installed)), where.stdout
        inv = ssh_nodes4.write_inventory(ssh_home / "inv.yaml")
        proc = cli.run("up", "-i", inv, "--nodes", "2", "--sync", str(PROGRAMS), "--",
                       "allreduce.py")
        assert proc.popen.returncode == 0, proc.dump()
        sums = [json.loads(line.split("] ", 1)[1]) for line in proc.out if '"sum"' in line]
        assert sorted(r["rank"] for r in sums) == [0, 1], proc.dump()
        assert {r["sum"] for r in sums} == {3.0}
    finally:
        cli.cleanup()
