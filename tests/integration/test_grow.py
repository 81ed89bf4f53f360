"""Re-admission on real sshd nodes: a job that shrank when it lost a node grows back to full
size once the node answers again (--grow: at the job's next checkpoint), with the reference
trainer resuming from that checkpoint; the planned restart spends none of --max-restarts."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

try:
    from tests.integration.conftest import run_processes_in, wait_until
except ImportError:  # run with tests/integration on sys.path
    from conftest import run_processes_in, wait_until  # type: ignore

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

KEEPALIVE = 6.0
GRACE = 3.0
READMIT = 2.0          # gate.readmit_every: the look at a lost node, short for the test
TRAIN = ["--", "cluster-train/train.py", "--epochs", "12", "--ckpt-every", "10",
         "--log-every", "10", "--out", "out", "--checkpoint-dir", "ckpt-grow", "--no-plot"]


def finals(proc) -> list[dict]:
    return [json.loads(line.split("FINAL", 1)[1]) for line in proc.out if "FINAL" in line]


def test_a_shrunk_job_grows_back_at_the_next_checkpoint(ssh_nodes4, cli):
    """node[1-3] (no spare), --min-nodes 2: node2's link is cut, the job goes on with node1
    and node3; the link comes back, node2 answers the look, and at the next checkpoint the
    job stops and starts again on three nodes, resuming from that checkpoint, to the end."""
    # Slower steps (the trainer's test hook; CLUSTER_ names are not for --env): the job must
    # still be training when node2 is back.
    inv = Path(ssh_nodes4.write_inventory(cli.home / "inv.yaml",
                                          setup=["export CLUSTER_TRAIN_TEST_STEP_SLEEP=0.1"]))
    inv.write_text(inv.read_text() + f"ssh: {{keepalive: {KEEPALIVE}}}\nstop_grace: {GRACE}\n"
                   f"gate: {{readmit_every: {READMIT}}}\n")
    proc = cli.start("up", "-i", str(inv), "--hosts", "node[1-3]", "--max-restarts", "1",
                     "--min-nodes", "2", "--grow", *TRAIN)
    proc.wait_for(lambda p: any(re.search(r"\bstep (1\d|2\d) loss", line) for line in p.out),
                  240, "training past step 10")
    ssh_nodes4.network.set_link(2, up=False)
    try:
        proc.wait_for(lambda p: "going on with 2 node(s)" in p.stderr, 120, "the job shrinks")
    finally:
        ssh_nodes4.network.set_link(2, up=True)
    proc.wait_for(lambda p: "node2 answers again" in p.stderr, 60, "node2 seen again")
    code = proc.wait(600)
    assert code == 0, proc.dump()
    assert "node2 set aside (lost: " in proc.stderr, proc.dump()
    assert re.search(r"node2 answers again: restarting at full size from the checkpoint of "
                     r"step \d+ \(--grow\)", proc.stderr), proc.dump()
    assert "node2 rejoins the job: 3 of 3 node(s)" in proc.stderr, proc.dump()
    run = json.loads(next((cli.cwd / "runs").glob("*/run.json")).read_text())
    attempts = run["attempts"]
    assert [len(a["nodes"]) for a in attempts] == [3, 2, 3], attempts
    assert [bool(a.get("planned")) for a in attempts] == [False, True, False], attempts
    assert sorted(n.split()[0] for n in attempts[2]["nodes"]) == ["node1", "node2", "node3"]
    # The grow restarted from the checkpoint it waited for (or the stop's own, a step later):
    # the third attempt resumed there, not from an older one.
    resumed = [int(m.group(1)) for line in proc.out
               if (m := re.search(r"resumed from \S+: epoch \d+ step (\d+)", line))]
    assert resumed and resumed[-1] >= attempts[1]["checkpoint"], (resumed, attempts[1])
    final = finals(proc)[-1]
    assert final["world_size"] == 3 and final["restart_count"] == 2, final
    assert wait_until(lambda: not any(run_processes_in(ssh_nodes4, i) for i in (1, 2, 3)),
                      30, 0.2) is not None, "every node clean"
    status = cli.run("status", timeout=60)
    assert status.popen.returncode == 0, status.dump()
