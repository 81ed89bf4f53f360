"""torchrun in containers on the SSH test nodes, with a real runtime: rootless podman as the
nodes' user (no daemon, so `--network host` is the node's own namespace) and an image built
here with `podman import`, no registry (fixtures/podman.py). Python and torch come from this
machine's /usr and the test venv, mounted read-only through the inventory's `mounts`.

What a user relies on: a 2-node all_reduce inside the containers; Ctrl-C and a killed rank
leaving no container and no process on any node; no environment value, secret or not, on any
command line of any node; the secret in no file a node or its runtime keeps.
"""
from __future__ import annotations

import hashlib
import shutil
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

try:
    from tests.integration.conftest import (PROGRAMS, Cli, Proc, cli_for, node_leftovers,
                                            skip_unless_ssh_nodes, wait_until)
    from tests.integration.fixtures import SshNodes, processes_with_env
    from tests.integration.fixtures.podman import PodmanImage, missing_tools
except ImportError:  # run with tests/integration on sys.path
    from conftest import (PROGRAMS, Cli, Proc, cli_for, node_leftovers,  # type: ignore
                          skip_unless_ssh_nodes, wait_until)
    from fixtures import SshNodes, processes_with_env  # type: ignore
    from fixtures.podman import PodmanImage, missing_tools  # type: ignore

pytestmark = [pytest.mark.integration]

# A user of their own for these nodes: podman keeps one long-lived process per user (outside
# any node's namespace), and the suites sharing the usual test user end its stray processes.
BOX_USER = "clusterbox"


@pytest.fixture(scope="module")
def box_nodes():
    skip_unless_ssh_nodes()
    with SshNodes(2, user=BOX_USER) as nodes:
        yield nodes


@pytest.fixture
def cli(tmp_path: Path, box_nodes: SshNodes):
    with cli_for(tmp_path, box_nodes) as c:
        yield c


SECRET = "tok-$(touch {canary}) 'q' \"dq\" 7f3a9c1e"     # the test's canary filled in
PLAIN = "plain-value-with spaces-$(id)-58e2b7"


@pytest.fixture(scope="module")
def podman(box_nodes):
    missing = missing_tools()
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (tests/run installs them)")
    with PodmanImage(box_nodes.user) as img:
        yield img


@pytest.fixture
def box(podman: PodmanImage, cli: Cli):
    podman.ensure_pause_process()
    yield podman
    for run_id in cli.run_ids():
        podman.remove_containers(f"cluster-{run_id}")


def inventory(box_nodes, cli: Cli, podman: PodmanImage, **overrides) -> str:
    """The nodes with the test image. The fake nodes' names live in per-namespace hosts files
    that podman does not copy into a container (it takes /etc/hosts from its own mount
    namespace), and torchrun resolves its own host name: `--add-host` options name them, as a
    user would on a cluster without DNS for its nodes."""
    venv = str(Path(box_nodes.python).parent.parent)
    box = podman.container_config(python=box_nodes.python, mounts=[f"{venv}:{venv}:ro"])
    box["options"] = [f"--add-host={n.name}:{n.address}" for n in box_nodes.nodes]
    return box_nodes.write_inventory(cli.home / "inv.yaml", container=box, **overrides)


def results(proc: Proc) -> list[dict]:
    out = []
    for line in proc.out:
        _, _, text = line.partition("] ")
        if text.startswith("{") and '"sum"' in text:
            out.append(json.loads(text))
    return sorted(out, key=lambda r: r["rank"])


def sleeping(n: int):
    return lambda p: sum('"sleeping"' in line for line in p.out) >= n


def leftovers(box_nodes, podman: PodmanImage, run_id: str, nodes=(1, 2)) -> dict:
    """Everything of a run still on the nodes: its containers (any state), and every process
    in the nodes' namespaces but their sshd and podman's per-user pause process."""
    pause = podman.pause_pid()
    procs = {node: [p for p in found if not p.startswith(f"{pause} ")]
             for node, found in node_leftovers(box_nodes, *nodes).items()}
    procs = {k: v for k, v in procs.items() if v}
    boxes = [n for n in podman.containers() if n.startswith(f"cluster-{run_id}")]
    return {"processes": procs, "containers": boxes,
            "tagged": processes_with_env("CLUSTER_RUN_ID", run_id)}


def nothing_left(box_nodes, podman, run_id) -> bool:
    left = leftovers(box_nodes, podman, run_id)
    return not (left["processes"] or left["containers"] or left["tagged"])


def test_allreduce_inside_containers(box_nodes, cli, box, record_property):
    inv = inventory(box_nodes, cli, box)
    t0 = time.monotonic()
    proc = cli.run("up", "-i", inv, "--nodes", "2", "--sync", str(PROGRAMS), "--", "allreduce.py",
                   timeout=300)
    seconds = time.monotonic() - t0
    record_property("container_allreduce_2_nodes_s", round(seconds, 3))
    sys.stderr.write(f"\n[container timing] 2-node all_reduce in podman: {seconds:.2f} s\n")
    assert proc.popen.returncode == 0, proc.dump()
    got = results(proc)
    assert [r["rank"] for r in got] == [0, 1], proc.dump()
    for r in got:
        assert r["sum"] == 3.0 and r["world_size"] == 2
        assert r["in_container"], "the rank did not run inside a container"
        assert r["node"] == f"node{r['rank'] + 1}"
    run_id = cli.run_ids()[-1]
    assert wait_until(lambda: nothing_left(box_nodes, box, run_id), 30) is not None, \
        leftovers(box_nodes, box, run_id)


def test_ctrl_c_leaves_no_container_and_no_process(box_nodes, cli, box, record_property):
    inv = inventory(box_nodes, cli, box)
    proc = cli.start("up", "-i", inv, "--nodes", "2", "--sync", str(PROGRAMS), "--",
                     "allreduce.py", "--sleep", "120")
    proc.wait_for(sleeping(2), 180, "every rank asleep")
    run_id = proc.run_id()
    assert len(box.containers()) >= 2 and all(
        n in box.containers() for n in (f"cluster-{run_id}-node1", f"cluster-{run_id}-node2"))
    os.kill(proc.popen.pid, signal.SIGINT)
    t0 = time.monotonic()
    assert proc.wait(90) == 130, proc.dump()
    record_property("container_ctrl_c_to_exit_s", round(time.monotonic() - t0, 3))
    gone = wait_until(lambda: nothing_left(box_nodes, box, run_id), 30)
    assert gone is not None, leftovers(box_nodes, box, run_id)
    record_property("container_ctrl_c_to_all_gone_s", round(time.monotonic() - t0, 3))


def worker_pid(run_id: str, rank: int) -> int:
    """A rank's pid as this machine sees it (the program reports its pid in the container)."""
    for pid in processes_with_env("CLUSTER_RUN_ID", run_id):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and b"LOCAL_RANK=0" in env:
            return pid
    raise AssertionError(f"no worker of rank {rank} in run {run_id}")


def test_a_killed_rank_stops_every_container(box_nodes, cli, box, record_property):
    inv = inventory(box_nodes, cli, box)
    proc = cli.start("up", "-i", inv, "--nodes", "2", "--sync", str(PROGRAMS), "--",
                     "allreduce.py", "--sleep", "120")
    proc.wait_for(sleeping(2), 180, "every rank asleep")
    run_id = proc.run_id()
    os.kill(worker_pid(run_id, 1), signal.SIGKILL)
    t0 = time.monotonic()
    assert proc.wait(90) == 4, proc.dump()
    gone = wait_until(lambda: nothing_left(box_nodes, box, run_id), 30)
    assert gone is not None, leftovers(box_nodes, box, run_id)
    seconds = time.monotonic() - t0
    record_property("container_kill9_to_all_gone_s", round(seconds, 3))
    sys.stderr.write(f"\n[container timing] kill -9 of a rank -> nothing left: {seconds:.2f} s\n")
    assert "failed first" in proc.stderr, proc.dump()


def command_lines() -> dict[int, bytes]:
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                out[int(name)] = Path(f"/proc/{name}/cmdline").read_bytes()
            except OSError:
                continue
    return out


def files_holding(value: str, roots: list[str]) -> list[str]:
    """Files under roots that hold value as it is, or as JSON writes it (podman's state is
    JSON: quotes there are escaped)."""
    needles = {value.encode(), json.dumps(value)[1:-1].encode()}
    found = []
    for root in roots:
        for dirpath, _, files in os.walk(root):
            for f in files:
                path = os.path.join(dirpath, f)
                try:
                    if os.path.islink(path) or not os.path.isfile(path):
                        continue
                    with open(path, "rb") as fh:
                        data = fh.read()
                        if any(n in data for n in needles):
                            found.append(path)
                except OSError:
                    continue
    return found


def test_env_values_and_the_secret_are_on_no_command_line(box_nodes, cli, box, canary):
    secret = SECRET.format(canary=canary)
    inv = inventory(box_nodes, cli, box, secret_env=["TOKEN"], env={"PLAIN": PLAIN})
    cli.env["TOKEN"] = secret
    proc = cli.start("up", "-i", inv, "--nodes", "2", "--sync", str(PROGRAMS), "--",
                     "allreduce.py", "--sleep", "120", "--env-hash", "TOKEN")
    proc.wait_for(sleeping(2), 180, "every rank asleep")
    run_id = proc.run_id()
    try:
        # while it runs: no process on this machine (every node) shows either value
        lines = command_lines()
        for value in (secret, PLAIN):
            shown = {pid: cmd for pid, cmd in lines.items() if value.encode() in cmd}
            assert not shown, f"{value!r} is on a command line: {shown}"
        # the secret arrived (its hash), and no file on the nodes or in podman's state holds it
        want = hashlib.sha256(secret.encode()).hexdigest()
        assert [r["env_hash"] for r in results(proc)] == [want, want], proc.dump()
        roots = [box_nodes.workdir(i) for i in (1, 2)] + box.state_dirs()
        assert files_holding(secret, roots) == []
        # the plain value is in each node's private run directory (its script and the env file
        # read inside the container), and nowhere else
        holding = files_holding(PLAIN, [box_nodes.workdir(i) for i in (1, 2)])
        assert sorted(Path(p).name for p in holding) == ["container.env"] * 2 + ["launch.sh"] * 2, holding
        assert all(os.stat(p).st_mode & 0o077 == 0 and os.stat(Path(p).parent).st_mode & 0o077 == 0
                   for p in holding)
        assert files_holding(PLAIN, box.state_dirs()) == []
    finally:
        os.kill(proc.popen.pid, signal.SIGINT)
        proc.wait(90)
    assert wait_until(lambda: nothing_left(box_nodes, box, run_id), 30) is not None, \
        leftovers(box_nodes, box, run_id)
    assert not canary.exists()


def doctor(cli: Cli, inv: str) -> tuple[int, dict]:
    proc = cli.run("doctor", "-i", inv, "--nodes", "2", "--json", timeout=300)
    return proc.popen.returncode, json.loads(proc.stdout)


def checks(report: dict, check: str) -> dict[str, dict]:
    return {c["node"]: c for c in report["checks"] if c["check"] == check}


def test_doctor_checks_the_runtime_the_image_and_inside_it(box_nodes, cli, box):
    import torch
    code, report = doctor(cli, inventory(box_nodes, cli, box))
    assert code == 0, report
    for node in ("node1", "node2"):
        assert checks(report, "container")[node]["status"] == "pass"
        inside = checks(report, "image torch")[node]
        assert inside["status"] == "pass" and f"torch {torch.__version__}" in inside["detail"]
    assert list(report["fingerprint"]["torch"]) == [torch.__version__]
    assert len(report["fingerprint"]["image"]) == 1
    assert not [n for n in box.containers() if n.startswith("cluster-doctor-")]

    # an image that is on no node, and that no registry has
    inv = inventory(box_nodes, cli, box)
    text = Path(inv).read_text().replace(box.image, "localhost/cluster-absent:1")
    Path(inv).write_text(text)
    code, report = doctor(cli, inv)
    assert code == 3
    for node in ("node1", "node2"):
        c = checks(report, "container")[node]
        assert c["status"] == "fail" and "cannot be pulled" in c["detail"], c
    assert not checks(report, "image torch")


@pytest.mark.docker
def test_doctor_names_docker_without_its_daemon(box_nodes, cli, box):
    """docker named, its client installed, no daemon running (as on this machine)."""
    if not shutil.which("docker"):
        pytest.skip("needs a docker client, which tests/run does not install")
    inv = inventory(box_nodes, cli, box)
    Path(inv).write_text(Path(inv).read_text().replace("runtime: podman", "runtime: docker"))
    code, report = doctor(cli, inv)
    assert code == 3
    c = checks(report, "container")["node1"]
    assert c["status"] == "fail" and "docker" in c["detail"] and "daemon" in c["fix"], c


def test_up_starts_nothing_when_a_node_lacks_the_image(box_nodes, cli, box):
    import yaml
    inv = inventory(box_nodes, cli, box)
    data = yaml.safe_load(Path(inv).read_text())
    data["hosts"][1]["container"] = {"image": "localhost/cluster-absent:1"}   # node2's own
    Path(inv).write_text(yaml.safe_dump(data))
    proc = cli.run("up", "-i", inv, "--nodes", "2", "--sync", str(PROGRAMS), "--", "allreduce.py",
                   timeout=120)
    assert proc.popen.returncode == 3, proc.dump()
    assert "node2: container: image localhost/cluster-absent:1 is not on this node" in proc.stderr
    assert "podman pull localhost/cluster-absent:1" in proc.stderr
    run_id = cli.run_ids()[-1]
    assert not [n for n in box.containers() if n.startswith(f"cluster-{run_id}")]
    assert processes_with_env("CLUSTER_RUN_ID", run_id) == []


def test_hang_watchdog_collects_every_stack_inside_containers(box_nodes, cli, box):
    """Two workers per node: each dump pauses torchrun, which in a container is not the
    script's process group leader but the workers' parent inside the container."""
    inv = inventory(box_nodes, cli, box, nproc_per_node=2)
    proc = cli.run("up", "-i", inv, "--nodes", "2", "--hang-timeout", "20", "--sync", str(PROGRAMS),
                   "--", "allreduce.py", "--hang-rank", "1", "--hang", "300", timeout=300)
    assert proc.popen.returncode == 4, proc.dump()
    run_id = cli.run_ids()[-1]
    hang = cli.cwd / "runs" / run_id / "hang"
    dumps = sorted(p.name for p in hang.iterdir())
    assert dumps == ["last-lines.txt", "node1-rank0.txt", "node1-rank1.txt", "node2-rank2.txt", "node2-rank3.txt",
                     "summary.txt"], dumps
    summary = (hang / "summary.txt").read_text()
    assert "odd one(s) out: rank 1 (node1): main in allreduce.py" in summary, summary
    assert wait_until(lambda: nothing_left(box_nodes, box, run_id), 30) is not None, \
        leftovers(box_nodes, box, run_id)


def test_a_restart_runs_in_fresh_containers(box_nodes, cli, box):
    """A rank killed once every rank is asleep: its torchrun's report of the failed worker
    proves the rendezvous was complete, with nothing to wait for (no scan of the workers from
    outside the container); the job restarts, in containers named for the attempt, and
    completes."""
    inv = inventory(box_nodes, cli, box)
    proc = cli.start("up", "-i", inv, "--nodes", "2", "--max-restarts", "1", "--sync", str(PROGRAMS),
                     "--", "allreduce.py", "--sleep", "300", "--sleep-first")
    proc.wait_for(sleeping(2), 180, "every rank asleep")
    run_id = proc.run_id()
    os.kill(worker_pid(run_id, 1), signal.SIGKILL)
    assert proc.wait(300) == 0, proc.dump()
    got = results(proc)
    assert sorted((r["restart"], r["rank"]) for r in got) == [(0, 0), (0, 1), (1, 0), (1, 1)], got
    assert all(r["in_container"] for r in got)
    records = sorted(Path(box_nodes.workdir(1)).glob(f".cluster/{run_id}/node1*/container.json"))
    assert [json.loads(p.read_text())["name"] for p in records] == [
        f"cluster-{run_id}-node1", f"cluster-{run_id}-node1-a1"]
    assert wait_until(lambda: nothing_left(box_nodes, box, run_id), 30) is not None, \
        leftovers(box_nodes, box, run_id)


def test_detached_run_stopped_by_cluster_down(box_nodes, cli, box):
    inv = inventory(box_nodes, cli, box)
    up = cli.run("up", "-i", inv, "--nodes", "2", "--detach", "--sync", str(PROGRAMS), "--",
                 "allreduce.py", "--sleep", "300", timeout=120)
    assert up.popen.returncode == 0, up.dump()
    run_id = up.run_id()
    names = {f"cluster-{run_id}-node1", f"cluster-{run_id}-node2"}
    assert wait_until(lambda: names <= set(box.containers()), 60) is not None, box.containers()
    assert wait_until(lambda: len(processes_with_env("CLUSTER_RUN_ID", run_id)) >= 4, 60)
    down = cli.run("down", run_id, timeout=120)
    assert down.popen.returncode == 0, down.dump()
    assert "still alive" not in down.stderr, down.dump()
    assert wait_until(lambda: nothing_left(box_nodes, box, run_id), 30) is not None, \
        leftovers(box_nodes, box, run_id)
