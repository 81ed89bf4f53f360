"""Everyday verbs end to end on the namespaced SSH nodes, through the real `cluster` CLI:
exec (output, per-node codes, a failing and an unreachable node, Ctrl-C and a killed launcher
leaving nothing), clean (old runs removed on the nodes and here, a running one kept) and top
(rows while a run runs). "Nothing left" is read from each node's network namespace
(run_processes_in), independently of the identity scan the code under test uses."""
from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from cluster.observe.top import STALE_S

try:
    from tests.integration.conftest import PROGRAMS, Cli, run_processes_in, wait_until
    from tests.integration.fixtures import kill_pids
except ImportError:  # run with tests/integration on sys.path
    from conftest import PROGRAMS, Cli, run_processes_in, wait_until  # type: ignore
    from fixtures import kill_pids  # type: ignore

pytestmark = [pytest.mark.integration]

DAY = 86400


def inventory(ssh_nodes4, cli: Cli) -> str:
    return ssh_nodes4.write_inventory(cli.home / "inv.yaml")


def leftovers(ssh_nodes4, nodes=(1, 2, 3, 4)) -> dict[int, list[str]]:
    return {i: left for i in nodes if (left := run_processes_in(ssh_nodes4, i))}


# How long what a finished test started may take to end before it counts as left behind: the
# documented stops take under a second (docs/RELIABILITY.md), this leaves room for a loaded machine.
SETTLE = 5.0


@pytest.fixture
def nothing_left(ssh_nodes4):
    """Each exec test starts with empty nodes and must leave them empty: what is still there
    SETTLE s after the test is killed (so that the next test starts clean) and fails the test,
    named node by node."""
    assert wait_until(lambda: not leftovers(ssh_nodes4), 20) is not None, leftovers(ssh_nodes4)
    yield
    wait_until(lambda: not leftovers(ssh_nodes4), SETTLE)
    left = leftovers(ssh_nodes4)
    kill_pids(int(line.split()[0]) for lines in left.values() for line in lines)
    assert not left, f"the test left processes on the nodes (killed now): {left}"


# --- exec ---------------------------------------------------------------------------------


def test_exec_prefixes_every_line_and_reports_each_node(ssh_nodes4, cli, nothing_left):
    inv = inventory(ssh_nodes4, cli)
    # node1 and node3 exit 1, node2 and node4 exit 0; one line on stdout, one on stderr each.
    script = 'n=$(hostname); echo "out $n"; echo "err $n" >&2; exit $(( ${n#node} % 2 ))'
    proc = cli.run("exec", "-i", inv, "--", "bash", "-c", script, timeout=120)
    assert proc.popen.returncode == 4, proc.dump()
    for i in range(1, 5):
        assert f"[node{i}] out node{i}" in proc.out and f"[node{i}] err node{i}" in proc.out, proc.dump()
    assert "2 of 4 node(s) did not exit 0" in proc.stderr
    assert "  node1: exit code 1" in proc.err and "  node3: exit code 1" in proc.err
    assert not any("node2: exit" in line or "node4: exit" in line for line in proc.err)


def test_exec_passes_each_argument_whole_and_unevaluated(ssh_nodes4, cli, nothing_left):
    inv = inventory(ssh_nodes4, cli)
    proc = cli.run("exec", "-i", inv, "--nodes", "2", "--", "echo", "$(hostname)", "a  b", "'q';",
                   timeout=120)
    assert proc.popen.returncode == 0, proc.dump()
    assert sorted(proc.out) == ["[node1] $(hostname) a  b 'q';", "[node2] $(hostname) a  b 'q';"]
    assert "exec: all 2 node(s) exited 0" in proc.stderr


def test_exec_names_an_unreachable_node_and_runs_on_the_others(ssh_nodes4, cli, nothing_left):
    inv = inventory(ssh_nodes4, cli)
    ssh_nodes4.stop_sshd(3)
    try:
        proc = cli.run("exec", "-i", inv, "--", "hostname", timeout=120)
    finally:
        ssh_nodes4.start_sshd(3)
    assert proc.popen.returncode == 3, proc.dump()
    assert sorted(proc.out) == ["[node1] node1", "[node2] node2", "[node4] node4"], proc.dump()
    assert re.search(r"node3: unreachable: .*refused", proc.stderr, re.S), proc.dump()


def command_running(ssh_nodes4, nodes, marker: str) -> bool:
    return all(any(marker in line for line in run_processes_in(ssh_nodes4, i)) for i in nodes)


@pytest.mark.parametrize("how", ["sigint", "sigkill"])
def test_exec_stopped_or_killed_leaves_nothing_on_any_node(ssh_nodes4, cli, nothing_left, how):
    """Ctrl-C stops the command on every node, with a child in the background and one in a
    session of its own; a launcher killed outright is the same, from the nodes' side."""
    inv = inventory(ssh_nodes4, cli)
    proc = cli.start("exec", "-i", inv, "--nodes", "3", "--", "bash", "-c",
                     "sleep 3601 & setsid sleep 3602 & echo started; sleep 3603")
    proc.wait_for(lambda p: sum("started" in line for line in p.out) == 3, 60, "every node started")
    assert wait_until(lambda: command_running(ssh_nodes4, (1, 2, 3), "sleep 3602"), 10), \
        leftovers(ssh_nodes4)
    if how == "sigint":
        os.kill(proc.popen.pid, signal.SIGINT)
        assert proc.wait(60) == 130, proc.dump()
        assert "the command was stopped on 3 node(s)" in proc.stderr, proc.dump()
        assert wait_until(lambda: not leftovers(ssh_nodes4, (1, 2, 3)), 3) is not None, \
            f"left after Ctrl-C: {leftovers(ssh_nodes4)}"
    else:
        proc.popen.kill()
        proc.wait(10)
        gone = wait_until(lambda: not leftovers(ssh_nodes4, (1, 2, 3)), 20)
        assert gone is not None, f"left after SIGKILL of cluster exec: {leftovers(ssh_nodes4)}"


# --- clean --------------------------------------------------------------------------------


def make_old(path: Path, seconds: float) -> None:
    when = time.time() - seconds
    for p in sorted(path.rglob("*"), reverse=True) + [path]:
        os.utime(p, (when, when), follow_symlinks=False)


def test_clean_removes_old_runs_on_nodes_and_here_and_keeps_a_running_one(ssh_nodes4, cli):
    inv = inventory(ssh_nodes4, cli)
    done = cli.run("up", "-i", inv, "--nodes", "2", "--sync", str(PROGRAMS), "--", "allreduce.py")
    assert done.popen.returncode == 0, done.dump()
    going = cli.run("up", "-i", inv, "--nodes", "2", "--detach", "--sync", str(PROGRAMS), "--",
                    "allreduce.py", "--sleep", "300")
    assert going.popen.returncode == 0, going.dump()
    old, running = done.run_id(), going.run_id()
    folders = {rid: [Path(ssh_nodes4.workdir(i)) / ".cluster" / rid for i in (1, 2)]
               for rid in (old, running)}
    logs = [f / f"node{i}" / "output.log" for i, f in zip((1, 2), folders[running])]
    asleep = wait_until(lambda: all(l.is_file() and b'"sleeping"' in l.read_bytes() for l in logs),
                        120, 0.2)
    assert asleep is not None, "the detached run never reached its sleep"
    # Both a month old, as far as any clock can tell: the running one is kept for running.
    for rid in (old, running):
        for folder in folders[rid]:
            make_old(folder, 30 * DAY)
        make_old(cli.cwd / "runs" / rid, 30 * DAY)
    try:
        dry = cli.run("clean", "-i", inv, "--dry-run", timeout=120)
        assert dry.popen.returncode == 0, dry.dump()
        assert f"node1: would remove .cluster/{old}" in dry.stdout, dry.dump()
        assert all(f.is_dir() for f in folders[old]) and (cli.cwd / "runs" / old).is_dir()

        proc = cli.run("clean", "-i", inv, timeout=120)
        assert proc.popen.returncode == 0, proc.dump()
        for node in ("node1", "node2"):
            assert f"{node}: removed .cluster/{old}" in proc.stdout, proc.dump()
            assert re.search(rf"{node}: kept \.cluster/{running}: running in {node}", proc.stdout), proc.dump()
        assert f"local: removed runs/{old}" in proc.stdout
        assert re.search(rf"local: kept runs/{running}: node1: running; node2: running", proc.stdout)
        assert not any(f.exists() for f in folders[old]) and not (cli.cwd / "runs" / old).exists()
        assert all(f.is_dir() for f in folders[running]) and (cli.cwd / "runs" / running).is_dir()
        status = cli.run("status", running, timeout=60)
        assert status.stdout.count("running") >= 2, "clean disturbed the running run"
    finally:
        cli.run("down", running, timeout=120)


def snapshot(folder: Path) -> dict[str, tuple[int, int, int]]:
    """Every entry of folder (itself too): its size, mode and modification time."""
    return {str(p.relative_to(folder)): (p.lstat().st_size, p.lstat().st_mode, p.lstat().st_mtime_ns)
            for p in [folder, *sorted(folder.rglob("*"))]}


def sizes(proc, run_id: str) -> dict[str, str]:
    """The size each node's line of a clean gives for the run's folder."""
    return {m.group(1): m.group(2) for m in re.finditer(
        rf"^(node\d): (?:would remove|removed) \.cluster/{run_id} \(([\d.]+ [KMG]?B)", proc.stdout, re.M)}


def test_reading_a_run_writes_nothing_on_its_nodes_and_clean_removes_what_it_said(ssh_nodes4, cli):
    """status, logs, top, pull and clean --dry-run leave each node's run folder as it was
    (no bytecode of the supervisor's modules either: a node keeps only its code cache), so the
    size clean --dry-run gives is the size clean removes."""
    inv = inventory(ssh_nodes4, cli)
    done = cli.run("up", "-i", inv, "--nodes", "2", "--sync", str(PROGRAMS), "--", "allreduce.py")
    assert done.popen.returncode == 0, done.dump()
    run_id = done.run_id()
    folders = [Path(ssh_nodes4.workdir(i)) / ".cluster" / run_id for i in (1, 2)]
    make_old(cli.cwd / "runs" / run_id, 30 * DAY)
    for folder in folders:
        make_old(folder, 30 * DAY)
    before = [snapshot(f) for f in folders]
    for verb in (["status", run_id], ["logs", run_id], ["top", run_id, "--once"],
                 ["pull", run_id, f".cluster/{run_id}"], ["clean", "-i", inv, "--dry-run"]):
        proc = cli.run(*verb, timeout=120)
        assert proc.popen.returncode == 0, proc.dump()
        after = [snapshot(f) for f in folders]
        assert after == before, (f"cluster {verb[0]} changed a node's run folder: "
                                 f"{[sorted(set(a.items()) ^ set(b.items())) for a, b in zip(after, before)]}")
    said = sizes(proc, run_id)
    removed = cli.run("clean", "-i", inv, timeout=120)
    assert removed.popen.returncode == 0, removed.dump()
    assert not any(f.exists() for f in folders), removed.dump()
    assert sorted(said) == ["node1", "node2"] and sizes(removed, run_id) == said, \
        (proc.dump(), removed.dump())


# --- top ----------------------------------------------------------------------------------


def top_rows(proc) -> dict[str, list[str]]:
    rows = {}
    for line in proc.out:
        cells = [c.strip() for c in line.split("│")[1:-1]]
        if len(cells) >= 9 and cells[1].startswith("node"):
            rows[cells[1]] = cells
    return rows


def test_top_shows_each_node_and_the_trainers_progress_while_it_runs(ssh_nodes4, cli):
    """A top snapshot of a real run: both nodes running, rank 0's metrics, and every node's
    step rate and work per step."""
    inv = inventory(ssh_nodes4, cli)
    up = cli.run("up", "-i", inv, "--nodes", "2", "--detach", "--", "cluster-train/train.py",
                 "--epochs", "500", "--no-resume", "--out", "top-out", "--checkpoint-dir", "top-ckpt",
                 timeout=300)
    assert up.popen.returncode == 0, up.dump()
    run_id = up.run_id()
    files = [Path(ssh_nodes4.workdir(i)) / "top-out" / "metrics.jsonl" for i in (1, 2)]

    def stepped() -> bool:
        """Rank 0's node (whichever it is) has a step record."""
        for f in files:
            try:
                if any(json.loads(l).get("type") == "step" for l in f.read_text().splitlines()
                       if l.strip().endswith("}")):
                    return True
            except (OSError, ValueError):
                pass
        return False
    try:
        assert wait_until(stepped, 240, 0.5) is not None, "the trainer wrote no step record"
        t0 = time.monotonic()
        proc = cli.run("top", run_id, "--once", timeout=60)
        seconds = time.monotonic() - t0
        assert proc.popen.returncode == 0, proc.dump()
        rows = top_rows(proc)
        assert sorted(rows) == ["node1", "node2"], proc.dump()
        rank0, rank1 = (rows[n] for n in sorted(rows, key=lambda n: int(rows[n][0])))
        assert rank0[2] == rank1[2] == "running", proc.dump()
        assert rank0[3] != "-" and rank0[4] == "-" and rank0[5] == "-", "CPU nodes show no GPU"
        assert int(rank0[6]) > 0 and float(rank0[7]) > 0 and rank0[8] != "-", proc.dump()
        assert rank1[6:9] == ["-", "-", "-"], "only rank 0's node has the trainer's metrics"
        # Every node's own pace, from its ranks' step reports beside its heartbeat file:
        # steps/s (not 'stalled': they report every second) and seconds of work per step.
        assert "step/s" in proc.stdout and "work s" in proc.stdout, proc.dump()
        for cells in (rank0, rank1):
            assert float(cells[9].replace(",", "")) > 0 and float(cells[10]) > 0, proc.dump()
        assert seconds < 30, f"one refresh took {seconds:.1f} s"
        # Stopped: no report comes any more, and past 10 s the rate says so.
        down = cli.run("down", run_id, timeout=120)
        assert down.popen.returncode == 0, down.dump()
        time.sleep(STALE_S + 1)
        after = cli.run("top", run_id, "--once", timeout=60)
        assert len(top_rows(after)) == 2, after.dump()
        for cells in top_rows(after).values():
            assert cells[2] == "stopped" and cells[9].startswith("stalled "), after.dump()
            assert float(cells[10]) > 0, "the last work per step stays shown"
    finally:
        cli.run("down", run_id, timeout=120)
