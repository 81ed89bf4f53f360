"""The slow node, for real: three SSH test nodes running the reference trainer, one of them
throttled to a fraction of a CPU by a cpu cgroup around its sshd (its sessions, torchrun and
the workers inherit it). The run names that node, and never the others; a balanced run names
none. Every node gets a cgroup, the others half a CPU each: three nodes left to share two cores
are not balanced (twice a "balanced" run named a node, at 1.30x and at 1.35x over the whole
60 s, which was the machine's scheduler keeping one node on a shared core). The default settings (1.3x over a 60 s window): a 10 s window was tried to keep the runs
short, and on this machine's two shared cores (three nodes, one always waiting for a core) it
named nodes of the balanced run (1.3-1.5x over 10 s); 60 s is what the setting is for."""
from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest

try:
    from tests.integration.conftest import Cli
except ImportError:  # run with tests/integration on sys.path
    from conftest import Cli  # type: ignore

# Each run trains for minutes: past the suite's 300 s default on a loaded two-core machine
# (the throttled run was cut there once while other tests ran beside it).
pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

QUOTA = 0.25            # of one CPU, for the throttled node
SHARE = 0.5             # for every other node (three of them fit two cores with room to spare)
# Long enough that every node reports for more than the 60 s window, throttled or not (20
# epochs ended in 74 s in a quiet CI run, under the window once the start is counted: nothing
# was named and the test failed).
WINDOW = 60.0
TRAIN = ["--", "cluster-train/train.py", "--epochs", "60", "--ckpt-every",
         "0", "--log-every", "50", "--no-plot", "--no-resume", "--out", "out"]


def cpu_cgroup() -> Path | None:
    """The folder to make a cpu cgroup in: cgroup v2 with the cpu controller (enabled for its
    children), or v1's cpu hierarchy (cpu.cfs_quota_us); None when neither is writable."""
    v2 = Path("/sys/fs/cgroup")
    try:
        if "cpu" in (v2 / "cgroup.controllers").read_text().split():
            if "cpu" not in (v2 / "cgroup.subtree_control").read_text().split():
                (v2 / "cgroup.subtree_control").write_text("+cpu\n")
            return v2
    except OSError:
        pass
    v1 = Path("/sys/fs/cgroup/cpu")
    return v1 if (v1 / "cpu.cfs_quota_us").exists() and os.access(v1, os.W_OK) else None


class Throttle:
    """Moves one process (an sshd daemon) into a new cpu cgroup limited to `share` of a CPU."""

    def __init__(self, root: Path, pid: int, share: float) -> None:
        self.root, self.pid = root, pid
        self.dir = root / f"cluster-test-slow-{os.getpid()}-{pid}"
        self.dir.mkdir()
        period = 100_000
        if (self.dir / "cpu.max").exists():
            (self.dir / "cpu.max").write_text(f"{int(share * period)} {period}\n")
        else:
            (self.dir / "cpu.cfs_period_us").write_text(f"{period}\n")
            (self.dir / "cpu.cfs_quota_us").write_text(f"{int(share * period)}\n")
        (self.dir / "cgroup.procs").write_text(f"{pid}\n")

    def close(self) -> None:
        for pid in (self.dir / "cgroup.procs").read_text().split():
            try:
                (self.root / "cgroup.procs").write_text(f"{pid}\n")
            except OSError:
                pass
        for _ in range(50):
            try:
                self.dir.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def named(proc) -> list[str]:
    return re.findall(r"slow node \[(\S+)", proc.stderr)


def run_json(cli: Cli) -> dict:
    return json.loads((cli.cwd / "runs" / cli.run_ids()[-1] / "run.json").read_text())


def up(ssh_nodes, cli: Cli, shares: dict[str, float]) -> tuple[object, float]:
    """The run, each node's sshd (and so all it starts) held to its share of a CPU."""
    root = cpu_cgroup()
    if root is None:
        pytest.skip("no writable cpu cgroup (v2 cpu.max or v1 cpu.cfs_quota_us) on this machine")
    pids = ssh_nodes.sshd_pids()
    inv = Path(ssh_nodes.write_inventory(cli.home / "inv.yaml", nodes=[1, 2, 3]))
    throttles = []
    try:
        for name, share in shares.items():
            throttles.append(Throttle(root, pids[name], share))
        t0 = time.monotonic()
        proc = cli.run("up", "-i", str(inv), *TRAIN, timeout=840)
    finally:
        for throttle in throttles:
            throttle.close()
    return proc, time.monotonic() - t0


def names(ssh_nodes) -> list[str]:
    return [n.name for n in ssh_nodes.nodes[:3]]


def test_the_throttled_node_is_named_and_no_other(ssh_nodes4, cli):
    victim = names(ssh_nodes4)[2]
    shares = {name: QUOTA if name == victim else SHARE for name in names(ssh_nodes4)}
    proc, seconds = up(ssh_nodes4, cli, shares)
    assert proc.popen.returncode == 0, proc.dump()
    assert named(proc) == [victim], (f"run of {seconds:.0f} s", proc.dump())
    slow = run_json(cli)["attempts"][-1]["slow_nodes"]
    assert [s["node"].split()[0] for s in slow] == [victim]
    assert slow[0]["ratio"] >= 1.3 and slow[0]["part"] == "compute"
    print(f"named {victim}: ratio {slow[0]['ratio']}, after {slow[0]['after_s']} s "
          f"(run {seconds:.0f} s)")


def test_a_balanced_run_names_none(ssh_nodes4, cli):
    proc, _ = up(ssh_nodes4, cli, {name: SHARE for name in names(ssh_nodes4)})
    assert proc.popen.returncode == 0, proc.dump()
    assert named(proc) == [], proc.dump()
    attempt = run_json(cli)["attempts"][-1]
    assert "slow_nodes" not in attempt
    # not a vacuous "none": the nodes trained for longer than the window the verdict needs
    assert attempt["seconds"] > WINDOW + 10, f"the run lasted {attempt['seconds']} s; raise --epochs"
