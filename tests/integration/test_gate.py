"""The health gate and the node ledger on three real sshd nodes, where node2 has an nvidia-smi
of its own (a stand-in answering from recorded H200 output edited for each fault, mounted on
node2's PATH in its own mount namespace) and node1 and node3 are CPU nodes. Each fault is named
on node2 with its evidence and nothing starts on any node; a CPU node is never failed for GPU
facts; two gate failures on the hardware quarantine node2, the next launch leaves it out where
it can and says so, and `cluster nodes release` lets it back in after its deep check.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

try:
    from tests.integration.conftest import (PROGRAMS, Cli, cli_for, node_leftovers,
                                            skip_unless_ssh_nodes)
    from tests.integration.fixtures import SshNodes
except ImportError:  # run with tests/integration on sys.path
    from conftest import (PROGRAMS, Cli, cli_for, node_leftovers,  # type: ignore
                          skip_unless_ssh_nodes)
    from fixtures import SshNodes  # type: ignore

pytestmark = [pytest.mark.integration]

FAKES = Path(__file__).resolve().parents[1] / "fakes"
SETS = Path(__file__).resolve().parents[1] / "unit" / "fixtures" / "nvidia_smi"
SYNC = ["--sync", str(PROGRAMS), "--", "allreduce.py"]


@pytest.fixture(scope="module")
def gpu_dir():
    """node2's own programs: the nvidia-smi stand-in and the fixture set it answers from."""
    folder = Path(tempfile.mkdtemp(prefix="cluster-gpu-node-"))
    folder.chmod(0o755)
    shutil.copy(FAKES / "nvidia-smi", folder / "nvidia-smi")
    (folder / "nvidia-smi").chmod(0o755)
    (folder / "scenario").write_text(f"{SETS / 'healthy_h200x8'}\n")
    (folder / "scenario").chmod(0o644)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def small_disk():
    """A 4 MiB tmpfs, 3 MiB of it taken, mounted before the nodes start (so theirs is too)."""
    folder = Path(tempfile.mkdtemp(prefix="cluster-small-disk-"))
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=1777", "tmpfs",
                       str(folder)]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    (folder / "filler").write_bytes(b"\0" * (3 << 20))
    yield folder
    subprocess.run(["umount", "-l", str(folder)])
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def nodes3(gpu_dir, small_disk):
    skip_unless_ssh_nodes()
    with SshNodes(3, programs={2: str(gpu_dir)}) as nodes:
        yield nodes


@pytest.fixture
def gpu_cli(tmp_path: Path, nodes3: SshNodes):
    with cli_for(tmp_path, nodes3) as c:
        c.env["XDG_STATE_HOME"] = str(tmp_path / "state")      # this test's own ledger
        yield c


def scenario(gpu_dir: Path, name: str) -> None:
    (gpu_dir / "scenario").write_text(f"{SETS / name}\n")     # the copy finds no sets beside it


def inventory(nodes3: SshNodes, cli: Cli, **hosts_extra) -> str:
    """The fixture's nodes, node2's job given its (stand-in) GPUs: the fixture's sshd hides
    every GPU from a session (CUDA_VISIBLE_DEVICES=), and the gate judges only the job's."""
    data = nodes3.inventory()
    for host in data["hosts"]:
        if host["name"] == "node2":
            host["env"] = {"CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in range(8))}
        host.update(hosts_extra.get(host["name"], {}))
    path = cli.cwd / "inv.yaml"
    path.write_text(json.dumps(data, indent=1))
    return str(path)


def assert_nothing_started(nodes3: SshNodes, proc) -> None:
    assert proc.popen.returncode == 3, proc.dump()
    assert "nothing was started" in proc.stderr, proc.dump()
    assert node_leftovers(nodes3, 1, 2, 3) == {}, "no process of the run on any node"


def test_node2_sees_its_own_nvidia_smi_and_the_cpu_nodes_none(nodes3: SshNodes) -> None:
    assert "NVIDIA H200" in nodes3.ssh(2, "nvidia-smi -L").stdout
    assert nodes3.ssh(1, "command -v nvidia-smi || echo none").stdout.strip() == "none"


@pytest.mark.parametrize("fault, extra, named", [
    ("foreign_process", {}, "node2: gpu memory: GPU 3: PID "),
    ("ecc", {}, "node2: ecc: GPU "),
    ("missing_gpu", {"node2": {"gpus": 8}}, "node2: gpu health: the inventory says gpus: 8, "
                                            "nvidia-smi lists 7"),
])
def test_each_gpu_fault_is_named_on_node2_and_nothing_starts(nodes3, gpu_dir, gpu_cli, fault,
                                                             extra, named) -> None:
    scenario(gpu_dir, fault)
    proc = gpu_cli.run("up", "-i", inventory(nodes3, gpu_cli, **extra), *SYNC, timeout=180)
    assert_nothing_started(nodes3, proc)
    assert named in proc.stderr, proc.dump()
    assert "node1:" not in proc.stderr and "node3:" not in proc.stderr, "CPU nodes pass"
    if fault == "foreign_process":
        assert "holds 70.0 GiB" in proc.stderr and "fix: stop it on node2 (kill " in proc.stderr


def test_a_workdir_on_a_small_full_disk_is_named(nodes3, gpu_dir, gpu_cli, small_disk) -> None:
    scenario(gpu_dir, "healthy_h200x8")
    workdir = small_disk / "node2"
    proc = gpu_cli.run("up", "-i", inventory(nodes3, gpu_cli, node2={"workdir": str(workdir)}),
                       *SYNC, timeout=180)
    assert_nothing_started(nodes3, proc)
    assert f"node2: disk: 0.0 GiB free in {workdir}, below gate.min_free_disk_gib 10" \
        in proc.stderr, proc.dump()


def test_with_a_spare_the_failing_node_is_set_aside_before_anything_starts(nodes3, gpu_dir,
                                                                          gpu_cli) -> None:
    scenario(gpu_dir, "ecc")
    proc = gpu_cli.run("up", "-i", inventory(nodes3, gpu_cli), "--nodes", "2", *SYNC,
                       timeout=180)
    assert proc.popen.returncode == 0, proc.dump()
    assert "spares: node3 wait" in proc.stderr, proc.dump()
    assert "node2 set aside (failed the check); node3 takes its place" in proc.stderr, proc.dump()
    assert "[node2" not in proc.stdout and "[node3 1]" in proc.stdout, proc.dump()


def test_gate_deep_runs_the_collective_first_then_starts(nodes3, gpu_dir, gpu_cli) -> None:
    scenario(gpu_dir, "healthy_h200x8")
    proc = gpu_cli.run("up", "-i", inventory(nodes3, gpu_cli), "--gate", "deep", *SYNC,
                       timeout=240)
    assert proc.popen.returncode == 0, proc.dump()
    assert "gate: deep: checking 3 node(s) as cluster doctor --deep does" in proc.stderr
    assert "all 3 node(s) finished" in proc.stderr, proc.dump()


def test_gate_off_lets_it_start(nodes3, gpu_dir, gpu_cli) -> None:
    scenario(gpu_dir, "ecc")
    proc = gpu_cli.run("up", "-i", inventory(nodes3, gpu_cli), "--gate", "off", *SYNC,
                       timeout=180)
    assert proc.popen.returncode == 0, proc.dump()


def test_two_hardware_failures_quarantine_node2_the_next_launch_leaves_it_out_and_release(
        nodes3, gpu_dir, gpu_cli) -> None:
    inv = inventory(nodes3, gpu_cli)
    scenario(gpu_dir, "ecc")
    for _ in range(2):
        assert gpu_cli.run("up", "-i", inv, *SYNC, timeout=180).popen.returncode == 3
    listed = gpu_cli.run("nodes", "-i", inv, "--json", timeout=60)
    assert listed.popen.returncode == 0, listed.dump()
    states = json.loads(listed.stdout)["nodes"]
    assert states["node2"]["status"] == "quarantined", states
    assert states["node1"]["status"] == "healthy" and states["node3"]["status"] == "healthy"
    # The third launch has a healthy choice (--nodes 2 of three hosts): it runs without node2.
    scenario(gpu_dir, "healthy_h200x8")
    third = gpu_cli.run("up", "-i", inv, "--nodes", "2", *SYNC, timeout=180)
    assert third.popen.returncode == 0, third.dump()
    assert "leaving out quarantined node2" in third.stderr, third.dump()
    assert "[node2" not in third.stdout and "[node3 1]" in third.stdout, third.dump()
    # Every host needed: it runs on node2 and says so.
    fourth = gpu_cli.run("up", "-i", inv, *SYNC, timeout=180)
    assert fourth.popen.returncode == 0, fourth.dump()
    assert "WARNING: running on quarantined node2" in fourth.stderr, fourth.dump()
    status = gpu_cli.run("status", timeout=60)
    assert "node2 is quarantined: 2 failure(s)" in status.stdout, status.dump()
    doctor = gpu_cli.run("doctor", "-i", inv, "--json", timeout=120)
    found = json.loads(doctor.stdout)["checks"]
    assert [f["node"] for f in found if f["check"] == "ledger"] == ["node2"], found
    # Released after its deep check passes (the stand-in is healthy now).
    release = gpu_cli.run("nodes", "release", "node2", "-i", inv, timeout=180)
    assert release.popen.returncode == 0, release.dump()
    assert "node2 released" in release.stderr, release.dump()
    states = json.loads(gpu_cli.run("nodes", "-i", inv, "--json", timeout=60).stdout)["nodes"]
    assert states["node2"]["status"] == "healthy", states
    ledger = Path(gpu_cli.env["XDG_STATE_HOME"]) / "cluster" / "ledger"
    (file,) = [p for p in ledger.iterdir() if p.suffix == ".json"]
    assert oct(file.stat().st_mode & 0o777) == "0o600" and oct(ledger.stat().st_mode & 0o777) == "0o700"
    assert os.stat(file).st_uid == os.getuid()
