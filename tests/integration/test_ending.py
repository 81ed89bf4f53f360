"""The end of a job, with real torchrun on three SSH test nodes. Once every worker of every node
has exited 0 the job is done: the launcher ends the torchrun agents itself (their exit barrier
and the store's teardown are not waited out), with the job's complete output and exit code 0,
and nothing left on any node. A rank that fails after the others exited 0 is the job's failure,
with its cause; a rank that still runs while the others exited 0 keeps the job going."""
from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest

try:
    from tests.integration.conftest import PROGRAMS, Cli, Proc, node_leftovers, wait_until
    from tests.integration.test_faults import failure_lines
except ImportError:  # run with tests/integration on sys.path
    from conftest import PROGRAMS, Cli, Proc, node_leftovers, wait_until  # type: ignore
    from test_faults import failure_lines  # type: ignore

pytestmark = [pytest.mark.integration]

NODES = [1, 2, 3]


@pytest.fixture
def stamps():
    """A folder the nodes' user may write (tmp_path's parents are not open to it)."""
    d = Path(tempfile.mkdtemp(prefix="cluster-stamps-"))
    d.chmod(0o777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def launch(ssh_nodes4, cli: Cli, stamps: Path, *args: str) -> Proc:
    """cluster up of ending.py on nodes 1-3, its ranks stamping their exits into `stamps`."""
    inv = ssh_nodes4.write_inventory(cli.home / "inv.yaml", nodes=NODES)
    return cli.start("up", "-i", inv, "--sync", str(PROGRAMS), "--", "ending.py",
                     "--stamps", str(stamps), *args)


def exit_records(ssh_nodes4, run_id: str) -> dict[int, dict]:
    """Each node's supervisor's exit record, read from the node's own run folder."""
    return {i: json.loads((Path(ssh_nodes4.workdir(i)) / ".cluster" / run_id / f"node{i}" /
                           "exit").read_text()) for i in NODES}


def nothing_left(ssh_nodes4) -> None:
    assert wait_until(lambda: not node_leftovers(ssh_nodes4, *NODES), 20, 0.1), \
        node_leftovers(ssh_nodes4, *NODES)


def test_every_worker_exited_0_so_the_launcher_ends_the_agents_code_0_output_complete(
        ssh_nodes4, cli: Cli, stamps: Path) -> None:
    proc = launch(ssh_nodes4, cli, stamps, "--freeze-agent")
    assert proc.wait(180) == 0, proc.dump()
    back = time.time()
    for rank in range(3):
        assert f"rank {rank}: leaving" in "\n".join(proc.out), proc.dump()
    assert "all 3 node(s) finished" in "\n".join(proc.err), proc.dump()
    records = exit_records(ssh_nodes4, proc.run_id())
    # the launcher's word ended each torchrun: the record says so, and the code is the job's
    assert all(r["finished"] is True and r["code"] == 0 and not r["stopped"]
               for r in records.values()), records
    last = max(float(p.read_text()) for p in stamps.iterdir())
    print(f"\n[timing] the prompt back {back - last:.2f} s after the last worker's exit "
          f"(bench/launch.py measures it)", file=sys.stderr)
    nothing_left(ssh_nodes4)


def test_a_rank_failing_after_the_others_exited_0_is_the_failure_with_its_cause(
        ssh_nodes4, cli: Cli, stamps: Path) -> None:
    proc = launch(ssh_nodes4, cli, stamps, "--late-rank", "2", "--late", "2", "--late-code", "1")
    assert proc.wait(180) != 0, proc.dump()
    assert "rank 2: late line" in "\n".join(proc.out), proc.dump()
    failed = failure_lines(proc)
    assert failed and all("[node3 2]" in line for line in failed), proc.dump()
    assert any("exit code 1" in line for line in proc.err if "[node3 2]" in line), proc.dump()
    records = exit_records(ssh_nodes4, proc.run_id())
    assert not any(r.get("finished") for r in records.values()), records
    nothing_left(ssh_nodes4)


def test_a_rank_still_running_while_the_others_exited_0_keeps_the_job_going(
        ssh_nodes4, cli: Cli, stamps: Path) -> None:
    proc = launch(ssh_nodes4, cli, stamps, "--late-rank", "1", "--late", "3", "--freeze-agent")
    assert proc.wait(180) == 0, proc.dump()
    back = time.time()
    assert "rank 1: late line" in "\n".join(proc.out), proc.dump()
    stamped = {int(p.name): float(p.read_text()) for p in stamps.iterdir()}
    assert sorted(stamped) == [0, 1, 2]
    assert stamped[1] - max(stamped[0], stamped[2]) > 2.0      # it ran on after the others
    assert back > stamped[1]
    records = exit_records(ssh_nodes4, proc.run_id())
    assert all(r["finished"] is True and r["code"] == 0 for r in records.values()), records
    nothing_left(ssh_nodes4)
