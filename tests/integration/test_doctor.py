"""`cluster doctor` and the network resolved before start, on real sshd nodes (one network
namespace each): decoy interfaces, a missing interface, a firewall that drops the master port,
a node without torch or with another torch, a real collective across three nodes, --json.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

try:
    from tests.integration.conftest import PROGRAMS, node_leftovers, wait_until
    from tests.integration.fixtures import processes_with_env
except ImportError:  # run with tests/integration on sys.path
    from conftest import PROGRAMS, node_leftovers, wait_until  # type: ignore
    from fixtures import processes_with_env  # type: ignore

pytestmark = [pytest.mark.integration]

SYNC = ["--sync", str(PROGRAMS), "--", "allreduce.py"]
CHECK_SECONDS = 15          # "in seconds": what the checks must stay under, generously


def auto_network_inventory(ssh_nodes, cli, **overrides) -> str:
    """The fixture's inventory without network.ifname: each node's interface is resolved."""
    return ssh_nodes.write_inventory(cli.home / "inv.yaml", network={"ifname": None, "ib": False},
                                     **overrides)


@pytest.fixture
def decoys(ssh_nodes4):
    """A decoy interface on every node that sorts before eth0, is up, holds an address and
    cannot reach the master (a veth pair kept inside the node: this kernel has no dummy)."""
    for n in ssh_nodes4.nodes:
        ssh_nodes4.network.run_in(n.index, f"ip link add aa0 type veth peer name aa1 && "
                                           f"ip addr add 10.77.250.{n.index}/24 dev aa0 && "
                                           f"ip link set aa1 up && ip link set aa0 up", check=True)
    yield
    for n in ssh_nodes4.nodes:
        ssh_nodes4.network.run_in(n.index, "ip link del aa0")


@pytest.fixture
def firewall(ssh_nodes4):
    """iptables rules added in a node's namespace, removed afterwards."""
    if not shutil.which("iptables"):
        pytest.skip("needs iptables")
    added: list[tuple[int, list[str]]] = []

    def drop(node: int, *rule: str) -> None:
        ssh_nodes4.network.run_in(node, ["iptables", "-A", *rule, "-j", "DROP"], check=True)
        added.append((node, list(rule)))
    yield drop
    for node, rule in added:
        ssh_nodes4.network.run_in(node, ["iptables", "-D", *rule, "-j", "DROP"])


def test_automatic_interface_is_resolved_at_the_check_and_written_into_each_script(
        ssh_nodes4, cli, decoys):
    inv = auto_network_inventory(ssh_nodes4, cli)
    proc = cli.run("up", "-i", inv, "--nodes", "2", *SYNC, timeout=240)
    assert proc.popen.returncode == 0, proc.dump()
    run = next((cli.cwd / "runs").iterdir())
    for script in sorted((run / "scripts").iterdir()):
        text = script.read_text()
        assert "export NCCL_SOCKET_IFNAME==eth0\n" in text, script     # NCCL's exact match
        assert "export GLOO_SOCKET_IFNAME=eth0\n" in text, script
        assert "cluster_ifname" not in text, "no choice is left to run time"
    env = json.loads((run / "env.json").read_text())
    assert {e["NCCL_SOCKET_IFNAME"] for e in env.values()} == {"=eth0"}
    assert {e["GLOO_SOCKET_IFNAME"] for e in env.values()} == {"eth0"}


def test_a_missing_manual_interface_fails_the_check_in_seconds(ssh_nodes4, cli):
    inv = ssh_nodes4.write_inventory(cli.home / "inv.yaml", network={"ifname": "ens9"})
    t0 = time.monotonic()
    proc = cli.run("up", "-i", inv, "--nodes", "2", *SYNC, timeout=120)
    took = time.monotonic() - t0
    assert proc.popen.returncode == 3, proc.dump()
    assert "node1: interface: interface ens9 does not exist here" in proc.stderr, proc.dump()
    assert "node2: interface" in proc.stderr and "nothing was started" in proc.stderr
    assert took < CHECK_SECONDS, took
    run_id = cli.run_ids()[-1]
    assert processes_with_env("CLUSTER_RUN_ID", run_id) == []


def test_a_firewall_dropping_the_master_port_is_named_in_seconds(ssh_nodes4, cli, firewall,
                                                                  record_property):
    port = 29100 + os.getpid() % 300
    master = ssh_nodes4.nodes[0].address
    firewall(2, "OUTPUT", "-p", "tcp", "-d", master, "--dport", str(port))
    inv = ssh_nodes4.write_inventory(cli.home / "inv.yaml")

    t0 = time.monotonic()
    doc = cli.run("doctor", "-i", inv, "--nodes", "3", "--master-port", str(port), "--json",
                  timeout=120)
    doctor_s = time.monotonic() - t0
    assert doc.popen.returncode == 3, doc.dump()
    report = json.loads(doc.stdout)
    bad = [c for c in report["checks"] if c["status"] == "fail"]
    assert [(c["node"], c["check"]) for c in bad] == [("node2", "reach master")], bad
    assert f"{master}:{port}" in bad[0]["detail"] and "firewall" in bad[0]["fix"]

    t0 = time.monotonic()
    up = cli.run("up", "-i", inv, "--hosts", "node[1-3]", "--master-port", str(port), *SYNC, timeout=120)
    up_s = time.monotonic() - t0
    assert up.popen.returncode == 3, up.dump()
    assert f"node2: reach master: cannot connect to {master}:{port}" in up.stderr, up.dump()
    assert "nothing was started" in up.stderr
    record_property("firewall_doctor_s", round(doctor_s, 2))
    record_property("firewall_up_s", round(up_s, 2))
    sys.stderr.write(f"\n[timing] firewall named by doctor in {doctor_s:.1f} s, by up in {up_s:.1f} s\n")
    assert doctor_s < CHECK_SECONDS and up_s < CHECK_SECONDS


def fake_torch_python(root: Path, version: str | None) -> str:
    """A venv whose python has no torch (version None) or a torch that says `version`."""
    venv = root / f"venv-{version or 'none'}"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    if version:
        site = next(venv.glob("lib/python3*/site-packages"))
        pkg = site / "torch"
        (pkg / "distributed").mkdir(parents=True)
        (pkg / "__init__.py").write_text(f"__version__ = {version!r}\n")
        (pkg / "version.py").write_text(f"__version__ = {version!r}\ncuda = None\n")
        (pkg / "distributed" / "run.py").write_text("raise SystemExit('not a real torch')\n")
    subprocess.run(["chmod", "-R", "a+rX", str(root)], check=True)
    return str(venv / "bin" / "python")


@pytest.fixture(scope="module")
def odd_pythons():
    # Outside pytest's 0700 temp folder: the nodes' test user runs these pythons.
    root = Path(tempfile.mkdtemp(prefix="cluster-pythons-"))
    root.chmod(0o755)
    try:
        yield {"none": fake_torch_python(root, None), "old": fake_torch_python(root, "2.0.0")}
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("which,words", [
    ("none", "torch is not installed for"),
    ("old", "torch differs: "),
])
def test_a_node_without_torch_or_with_another_torch_is_named(ssh_nodes4, cli, odd_pythons,
                                                             which, words):
    data = ssh_nodes4.inventory()
    data["hosts"][2]["python"] = odd_pythons[which]
    inv = cli.home / "inv.yaml"
    inv.write_text(json.dumps(data))
    proc = cli.run("up", "-i", str(inv), "--hosts", "node[1-3]", *SYNC, timeout=120)
    assert proc.popen.returncode == 3, proc.dump()
    assert words in proc.stderr, proc.dump()
    assert "node3" in proc.stderr
    if which == "old":
        assert "2.0.0 on node3" in proc.stderr
    doc = cli.run("doctor", "-i", str(inv), "--nodes", "3", "--json", timeout=120)
    assert doc.popen.returncode == 3, doc.dump()
    report = json.loads(doc.stdout)
    assert any(c["status"] == "fail" and (c["node"] == "node3" or "node3" in c["detail"])
               for c in report["checks"]), report["checks"]
    if which == "old":
        assert report["fingerprint"]["torch"]["2.0.0"] == ["node3"]
    else:
        [torch] = [c for c in report["checks"] if c["node"] == "node3" and c["check"] == "torch"]
        assert odd_pythons["none"] in torch["detail"], torch
        assert torch["fix"].startswith("name the python that has torch") and "--python" in torch["fix"]
        assert not any("reinstall" in c["fix"] for c in report["checks"]), report["checks"]


def test_doctor_deep_runs_a_real_collective_on_three_nodes(ssh_nodes4, cli, record_property):
    inv = ssh_nodes4.write_inventory(cli.home / "inv.yaml")
    t0 = time.monotonic()
    doc = cli.run("doctor", "-i", inv, "--nodes", "3", "--deep", "--json", timeout=300)
    record_property("doctor_deep_3_nodes_s", round(time.monotonic() - t0, 2))
    assert doc.popen.returncode == 0, doc.dump()
    report = json.loads(doc.stdout)
    deep = report["deep"]
    assert deep["sum_ok"] is True and deep["world_size"] == 3 and deep["backend"] == "gloo"
    assert [r["bytes"] for r in deep["allreduce"]] == [65536, 1 << 20, 16 << 20]
    assert all(r["busbw_gbps"] > 0 for r in deep["allreduce"])
    assert sorted(tuple(sorted((p["a"], p["b"]))) for p in deep["pairs"]) == [
        ("node1", "node2"), ("node1", "node3"), ("node2", "node3")]
    text = cli.run("doctor", "-i", inv, "--nodes", "3", "--deep", timeout=300)
    assert text.popen.returncode == 0, text.dump()
    assert "collective (gloo, 3 processes): sum right" in text.stdout
    assert "node1 <-> node2" in text.stdout or "node2 <-> node1" in text.stdout
    # Progress on stderr, one line per phase (not a terminal: no redrawn counts).
    phases = [line for line in text.stderr.splitlines() if line.startswith("cluster: ")]
    assert phases[:2] == [
        "cluster: asking 3 node(s) what they have (python, torch, GPUs, disk, clock)",
        "cluster: testing that 3 node(s) reach the master port"], text.stderr
    recorded = re.fullmatch(r"cluster: running a collective across 3 node\(s\) \(all_reduce, then "
                            r"every pair\); it is recorded as runs/(doctor-[0-9]{8}-[0-9]{6}-\w+)",
                            phases[2])
    assert recorded and recorded.group(1) in cli.run_ids(), (phases[2], cli.run_ids())
    assert "\r" not in text.stderr and "\x1b" not in text.stderr
    # The collective's steps as they end: the sum, each size, the pairs (1 + 3 + 3 rounds).
    steps = phases[phases.index("cluster: checking 3 node(s) before the collective starts") + 1:]
    assert steps[:2] == [
        "cluster: measuring in 7 steps (the sum, each message size, each round of pairs)",
        "cluster:   sum right over 3 processes"], text.stderr
    said = [re.fullmatch(r"cluster:   all_reduce (.+): ([0-9.]+) GB/s bus bandwidth", line)
            for line in steps[2:5]]
    assert all(said) and [m.group(1) for m in said] == ["64 KiB", "1 MiB", "16 MiB"], text.stderr
    reported = [float(g) for g in re.findall(r"all_reduce +[0-9.]+ MiB +bus bandwidth +([0-9.]+) GB/s",
                                             text.stdout)]
    assert len(reported) == 3 and all(abs(r - float(m.group(2))) <= 0.006   # 3 decimals and 2
                                      for r, m in zip(reported, said)), (reported, steps)
    assert re.fullmatch(r"cluster:   pairs: 3 measured, slowest node\d<->node\d [0-9.]+ GB/s",
                        steps[5]), text.stderr
    # Its collectives are recorded apart: never "the newest run" of status, logs or down.
    recorded = cli.run_ids()
    assert len(recorded) == 2 and all(r.startswith("doctor-") for r in recorded), recorded
    status = cli.run("status", timeout=60)
    assert status.popen.returncode == 2 and "no runs in runs/" in status.stderr, status.dump()
    named = cli.run("status", recorded[0], timeout=60)
    assert named.popen.returncode == 0, named.dump()
    assert wait_until(lambda: not node_leftovers(ssh_nodes4, 1, 2, 3), 10) is not None


def test_doctor_json_schema(ssh_nodes4, cli):
    inv = ssh_nodes4.write_inventory(cli.home / "inv.yaml")
    doc = cli.run("doctor", "-i", inv, "--nodes", "2", "--json", timeout=120)
    assert doc.popen.returncode == 0, doc.dump()
    report = json.loads(doc.stdout)
    assert set(report) == {"schema", "ok", "seconds", "timings", "nodes", "master", "checks",
                           "fingerprint", "deep", "tuning"}
    assert set(report["timings"]) >= {"survey"} and report["seconds"] >= report["timings"]["survey"]
    assert report["schema"] == 1 and report["ok"] is True and report["deep"] is None
    assert report["tuning"] is None
    assert report["nodes"] == ["node1", "node2"] and report["master"]["name"] == "node1"
    for c in report["checks"]:
        assert set(c) == {"node", "check", "status", "detail", "fix"}
        assert c["status"] in ("pass", "warn", "fail")
    checks = {(c["node"], c["check"]) for c in report["checks"]}
    for node in ("node1", "node2"):
        for check in ("ssh", "torch", "interface", "reach master", "clock"):
            assert (node, check) in checks, (node, check)
    assert ("node1", "master port") in checks
    clocks = [c for c in report["checks"] if c["check"] == "clock"]
    assert [c["status"] for c in clocks] == ["pass", "pass"], clocks   # one kernel clock: no skew
    assert all("give or take" in c["detail"] for c in clocks)
    assert set(report["fingerprint"]["torch"]) and all(
        sorted(nodes) == ["node1", "node2"] for nodes in report["fingerprint"]["python"].values())


# The sweep of `cluster doctor --tune-nccl`, driven as the command drives it, on two real nodes.
# gloo ignores NCCL's variables, so this checks the plumbing (each setting reaches the ranks of
# every launch, each launch measures, nothing is left), not which setting is best.
SWEEP = """
import json, sys
from cluster import deep, resolve, tuning
from cluster.plan import Templates
from cluster.request import Request
_, inv = resolve.where(Request(inventory_path=sys.argv[1], nodes=2))
backend = resolve.backend("ssh", inv, sync=[])
measure = deep.collective(inv, backend, Templates())
seen = []
def one(env):
    seen.append(measure({**env, "CLUSTER_DOCTOR_PAIRS": "0"}, (1 << 16, 1 << 20), 3))
    return seen[-1]
rows = tuning.sweep(one, tuning.grid((1, 2), (2,)))
backend.close()
print(json.dumps({"rows": [r.to_json() for r in rows], "seen": seen}))
"""


def test_the_tuning_sweep_carries_each_setting_to_every_launch(ssh_nodes4, cli):
    inv = ssh_nodes4.write_inventory(cli.home / "inv.yaml")
    done = subprocess.run([sys.executable, "-c", SWEEP, inv], cwd=cli.cwd, env=cli.env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert [r["env"] for r in out["rows"]] == [
        {}, {"NCCL_SOCKET_NTHREADS": "1", "NCCL_NSOCKS_PERTHREAD": "2"},
        {"NCCL_SOCKET_NTHREADS": "2", "NCCL_NSOCKS_PERTHREAD": "2"}]
    for row, seen in zip(out["rows"], out["seen"]):
        got = {k: v for k, v in seen["nccl"].items() if k in row["env"] or k.startswith("NCCL_NSOCKS")
               or k == "NCCL_SOCKET_NTHREADS"}
        assert got == row["env"], (row, seen["nccl"])
        assert seen["sum_ok"] is True and seen["world_size"] == 2 and seen["pairs"] == []
        assert set(row["busbw_gbps"]) == {str(1 << 16), str(1 << 20)}
        assert all(v > 0 for v in row["busbw_gbps"].values())
    assert len(cli.run_ids()) == 3, "every setting is a launch of its own, recorded like a run"
    assert wait_until(lambda: not node_leftovers(ssh_nodes4, 1, 2), 10) is not None


def test_tune_nccl_on_cpu_nodes_says_why_and_stores_nothing(cli):
    cli.env["CUDA_VISIBLE_DEVICES"] = ""      # CPU nodes, also on a machine with GPUs
    cache = Path(cli.env["XDG_CACHE_HOME"]) / "cluster" / "nccl-tuning.json"
    doc = cli.run("doctor", "--local", "--nodes", "2", "--tune-nccl", "--json", timeout=180)
    assert doc.popen.returncode == 3, doc.dump()
    report = json.loads(doc.stdout)
    [finding] = [c for c in report["checks"] if c["check"] == "nccl tuning"]
    assert finding["status"] == "fail" and "ran on gloo, not NCCL" in finding["detail"]
    assert report["tuning"] is None and not cache.exists()
    # the seconds are the whole command's, the sweep's launch included (it said the survey's)
    assert set(report["timings"]) == {"survey", "tune-nccl"}, report["timings"]
    assert report["seconds"] >= sum(report["timings"].values()) - 0.01
    assert report["timings"]["tune-nccl"] > 1.0, report["timings"]   # a real launch of torchrun


# --- --hosts with the nodes' python and user from the command line (no inventory) -----------------


def command_line_hosts(ssh_nodes, *nodes: int) -> list[str]:
    """--hosts (the nodes' addresses, which known_hosts lists) and every setting an inventory
    would give: the nodes' python, the test user, the key."""
    return ["--hosts", ",".join(ssh_nodes.nodes[i - 1].address for i in nodes),
            "--python", ssh_nodes.python, "--user", ssh_nodes.user,
            "--identity", ssh_nodes.identity_file]


def test_doctor_with_hosts_python_and_user_on_the_command_line(ssh_nodes4, cli, odd_pythons):
    doc = cli.run("doctor", *command_line_hosts(ssh_nodes4, 1, 2), "--json", timeout=120)
    assert doc.popen.returncode == 0, doc.dump()
    report = json.loads(doc.stdout)
    assert report["nodes"] == [ssh_nodes4.nodes[0].address, ssh_nodes4.nodes[1].address]
    torch = [c for c in report["checks"] if c["check"] == "torch"]
    assert [c["status"] for c in torch] == ["pass", "pass"], torch
    # A python without torch: the advice names it, and naming another python comes first.
    other = command_line_hosts(ssh_nodes4, 1)
    other[other.index("--python") + 1] = odd_pythons["none"]
    bare = cli.run("doctor", *other, timeout=120)
    assert bare.popen.returncode == 3, bare.dump()
    assert f"torch is not installed for {odd_pythons['none']}" in bare.stdout, bare.dump()
    assert "fix: name the python that has torch (`python:` in the inventory, or --python PATH)" \
        in bare.stdout and "reinstall" not in bare.stdout


def test_up_with_hosts_python_and_user_on_the_command_line(ssh_nodes4, cli):
    program = str(PROGRAMS / "allreduce.py")       # readable by the nodes' user: no sync needed
    up = cli.run("up", *command_line_hosts(ssh_nodes4, 1, 2), "--nproc-per-node", "1", "--",
                 program, "--show-env", "USER", timeout=180)
    try:
        assert up.popen.returncode == 0, up.dump()
        said = [json.loads(line.split("] ", 1)[1]) for line in up.stdout.splitlines()
                if '"rank"' in line]
        assert sorted(r["rank"] for r in said) == [0, 1] and {r["sum"] for r in said} == {3.0}
        assert {r["python"] for r in said} == {ssh_nodes4.python}
        assert {r["env"]["USER"] for r in said} == {ssh_nodes4.user}
    finally:
        run_id = cli.run_ids()[-1] if cli.run_ids() else None
        if run_id:       # the default workdir is the test user's home, shared by these nodes
            shutil.rmtree(Path(ssh_nodes4.home) / "cluster-runs" / ".cluster" / run_id,
                          ignore_errors=True)
    assert wait_until(lambda: not node_leftovers(ssh_nodes4, 1, 2), 10) is not None
