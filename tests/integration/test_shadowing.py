"""cluster's node programs use the standard library, never a module of the same name in the
folder they start in: the user's project (local backend) or the node user's home (SSH), which
`python -c` would put first on sys.path. The job itself still sees its own folder as usual."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

try:
    from tests.integration.conftest import PROGRAMS, Cli, skip_unless_ssh_nodes, wait_until
    from tests.integration.fixtures import SshNodes, processes_with_env
except ImportError:  # run with tests/integration on sys.path
    from conftest import PROGRAMS, Cli, skip_unless_ssh_nodes, wait_until  # type: ignore
    from fixtures import SshNodes, processes_with_env  # type: ignore

pytestmark = [pytest.mark.integration]

SHADOWED = ("types", "json", "select", "signal")
# A user of its own: planting these in the shared test user's home would break the other tests
# running at the same time.
USER = "clustershadow"


def raising(name: str) -> str:
    return f"raise ImportError('the {name}.py of this folder was imported')\n"


def raising_in_node_programs(name: str) -> str:
    """Raises in cluster's node programs (the only processes started with -S), and is the
    standard module anywhere else: the job's torchrun starts in the project folder, as
    `python -m torch.distributed.run` would, and finds this file first."""
    return ("import sys\n"
            "if sys.flags.no_site:\n"
            f"    raise ImportError('the {name}.py of the project was imported by a node program')\n"
            "del sys.modules[__name__]\n"
            "_saved = sys.path[:]\n"
            "sys.path[:] = [p for p in _saved if p not in ('', __import__('os').getcwd())]\n"
            "try:\n    __import__(__name__)\nfinally:\n    sys.path[:] = _saved\n")


def test_local_up_status_down_with_the_standard_library_shadowed_in_the_project(tmp_path: Path) -> None:
    for name in SHADOWED:
        (tmp_path / f"{name}.py").write_text(raising_in_node_programs(name))
    cli = Cli(tmp_path, Path(os.environ.get("HOME", "/root")))
    cli.env["CUDA_VISIBLE_DEVICES"] = ""
    try:
        up = cli.run("up", "--local", "--detach", "--", str(PROGRAMS / "allreduce.py"),
                     "--sleep", "300")
        assert up.popen.returncode == 0, up.dump()
        run_id = up.run_id()
        assert wait_until(lambda: len(processes_with_env("CLUSTER_RUN_ID", run_id)) >= 3, 60)
        status = cli.run("status", run_id, timeout=60)
        assert status.popen.returncode == 0 and "running" in status.stdout, status.dump()
        down = cli.run("down", run_id, timeout=60)
        assert down.popen.returncode == 0, down.dump()
        assert processes_with_env("CLUSTER_RUN_ID", run_id) == []
        for proc in (up, status, down):
            assert "was imported" not in proc.stdout + proc.stderr, proc.dump()
    finally:
        cli.cleanup()


@pytest.fixture(scope="module")
def shadowed_nodes():
    skip_unless_ssh_nodes()
    with SshNodes(2, user=USER) as nodes:
        for name in SHADOWED:
            path = Path(nodes.home) / f"{name}.py"
            path.write_text(raising(name))
            os.chown(path, nodes.uid, nodes.gid)
        yield nodes


def test_ssh_up_status_down_with_the_standard_library_shadowed_in_the_nodes_home(
        shadowed_nodes: SshNodes, tmp_path: Path) -> None:
    # the planted modules are there: a plain `python -c` at the node user's home fails on them
    plain = shadowed_nodes.ssh(1, f"{shadowed_nodes.python} -S -c 'import json'")
    assert plain.returncode != 0 and "was imported" in plain.stderr, plain
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True, mode=0o700)
    shutil.copy(shadowed_nodes.known_hosts_path, home / ".ssh" / "known_hosts")
    (tmp_path / "work").mkdir()
    cli = Cli(tmp_path / "work", home)
    inv = shadowed_nodes.write_inventory(home / "inv.yaml")
    try:
        up = cli.run("up", "-i", inv, "--detach", "--sync", str(PROGRAMS), "--", "allreduce.py",
                     "--sleep", "300")
        assert up.popen.returncode == 0, up.dump()
        run_id = up.run_id()
        status = cli.run("status", run_id, timeout=60)
        assert status.popen.returncode == 0, status.dump()
        assert status.stdout.count("running") >= 2, status.dump()
        down = cli.run("down", run_id, timeout=60)
        assert down.popen.returncode == 0, down.dump()
        for proc in (up, status, down):
            assert "was imported" not in proc.stdout + proc.stderr, proc.dump()
    finally:
        cli.cleanup()
