"""What cluster leaves on a node, checked over real SSH nodes (one network namespace each) by
what runs in each node's namespace, independently of the run-id scan cluster itself uses:

- `cluster logs -f` stopped by SIGTERM (`timeout`) or SIGINT leaves no follower on any node,
  quiet nodes included; followed to the end it says the run's outcome in its exit code;
- a child that left the run's identity (`setsid env -i ...`) is stopped by `cluster down`,
  by the stop after a failure and by Ctrl-C;
- the job gets the node login's umask (its files 0644 under 022), cluster's own stay private;
- `cluster status` and run.json say how a stop went: within the grace after SIGTERM, or
  SIGKILL after it.

The node scripts are small templates (no torch), so each case takes seconds.
"""
from __future__ import annotations

import json
import signal
import stat
from pathlib import Path

import pytest

try:
    from tests.integration.conftest import Cli, node_leftovers, wait_until
except ImportError:  # run with tests/integration on sys.path
    from conftest import Cli, node_leftovers, wait_until  # type: ignore

pytestmark = [pytest.mark.integration]


def template(cli: Cli, name: str, body: str) -> str:
    """A templates folder whose node.sh.j2 is body (Jinja: `rank` is the node's rank)."""
    d = cli.cwd / name
    d.mkdir()
    (d / "node.sh.j2").write_text(body)
    return str(d)


def up(cli: Cli, ssh_nodes4, tpl: str, *extra: str, detach: bool = True, nodes: int = 2):
    inv = ssh_nodes4.write_inventory(cli.home / "inv.yaml")
    args = ["up", "-i", inv, "--nodes", str(nodes), "--no-preflight", "--templates", tpl, *extra]
    args += (["--detach"] if detach else []) + ["--", "unused"]
    return cli.run(*args, timeout=120) if detach else cli.start(*args)


def matching(ssh_nodes4, text: str, *nodes: int) -> dict[str, list[str]]:
    """Per node, the processes in its namespace whose command line holds text."""
    found = {name: [c for c in cmds if text in c]
             for name, cmds in node_leftovers(ssh_nodes4, *nodes).items()}
    return {name: cmds for name, cmds in found.items() if cmds}


def all_clean(ssh_nodes4, *nodes: int) -> None:
    assert wait_until(lambda: not node_leftovers(ssh_nodes4, *nodes), 15) is not None, \
        node_leftovers(ssh_nodes4, *nodes)


# --- logs -f: no follower outlives it; its exit code is the run's outcome ---------------------

QUIET = "{% if rank == 0 %}echo a0\n{% endif %}sleep 300\n"     # node2 prints nothing at all


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL],
                         ids=["SIGTERM", "SIGINT", "SIGKILL"])
def test_a_stopped_logs_follow_leaves_no_follower_on_any_node(ssh_nodes4, cli, sig):
    started = up(cli, ssh_nodes4, template(cli, "tpl", QUIET))
    assert started.popen.returncode == 0, started.dump()
    run_id = started.run_id()
    logs = cli.start("logs", "-f", run_id)
    logs.wait_for(lambda p: "[node1 0] a0" in p.out, 60, "node1's line")
    assert wait_until(lambda: set(matching(ssh_nodes4, "supervisor logs", 1, 2)) == {"node1", "node2"},
                      15) is not None, node_leftovers(ssh_nodes4, 1, 2)     # one follower per node
    logs.popen.send_signal(sig)           # as `timeout 12 cluster logs -f`, Ctrl-C, kill -9 do
    logs.wait(30)
    assert wait_until(lambda: not matching(ssh_nodes4, "supervisor logs", 1, 2), 10) is not None, \
        matching(ssh_nodes4, "supervisor logs", 1, 2)
    down = cli.run("down", run_id, timeout=90)
    assert down.popen.returncode == 0, down.dump()
    all_clean(ssh_nodes4, 1, 2)


def test_logs_follow_ends_with_the_runs_outcome(ssh_nodes4, cli):
    """`cluster logs -f && cluster down` can tell: a failed run exits non-zero (4) naming the
    node and its code; a successful one exits 0."""
    failing = up(cli, ssh_nodes4, template(cli, "bad", "echo r{{ rank }}; sleep 2; exit {{ rank * 3 }}\n"))
    assert failing.popen.returncode == 0, failing.dump()
    logs = cli.run("logs", "-f", failing.run_id(), timeout=60)
    assert logs.popen.returncode == 4, logs.dump()
    assert "did not succeed: node [node2 1] exited with code 3" in logs.stderr, logs.dump()
    assert "[node1 0] r0" in logs.out and "[node2 1] r1" in logs.out, logs.dump()

    fine = up(cli, ssh_nodes4, template(cli, "good", "echo r{{ rank }}; sleep 2\n"))
    assert fine.popen.returncode == 0, fine.dump()
    logs = cli.run("logs", "-f", fine.run_id(), timeout=60)
    assert logs.popen.returncode == 0, logs.dump()
    assert "succeeded: every node exited 0" in logs.stderr, logs.dump()
    all_clean(ssh_nodes4, 1, 2)


# --- a child without the run's identity: stopped by down, by a failure's stop, by Ctrl-C ------

SCRUBBED = "setsid env -i sleep 1000 &\necho started\n"


def scrubbed_on(ssh_nodes4, *nodes: int) -> bool:
    return set(matching(ssh_nodes4, "sleep 1000", *nodes)) == {f"node{i}" for i in nodes}


def test_down_stops_a_child_that_left_the_runs_identity(ssh_nodes4, cli):
    started = up(cli, ssh_nodes4, template(cli, "tpl", SCRUBBED + "sleep 300\n"))
    assert started.popen.returncode == 0, started.dump()
    run_id = started.run_id()
    assert wait_until(lambda: scrubbed_on(ssh_nodes4, 1, 2), 30) is not None, node_leftovers(ssh_nodes4, 1, 2)
    down = cli.run("down", run_id, timeout=90)
    assert down.popen.returncode == 0, down.dump()
    assert "still alive" not in down.stderr, down.dump()
    all_clean(ssh_nodes4, 1, 2)
    # the stop was graceful (the script ends on SIGTERM): said so, not "signal 9"
    status = cli.run("status", run_id, timeout=60)
    rows = [line for line in status.out if "node" in line and "stopped" in line]
    assert len(rows) == 2 and all("SIGTERM: ended within the 30 s grace" in r for r in rows), status.dump()
    assert "signal 9" not in status.stdout and "SIGKILL" not in status.stdout, status.dump()
    meta = json.loads((cli.cwd / "runs" / run_id / "run.json").read_text())
    assert meta["stops"] == {"node1": "term", "node2": "term"}, meta.get("stops")


def test_the_stop_after_a_failure_and_ctrl_c_reach_it_too(ssh_nodes4, cli):
    failing = up(cli, ssh_nodes4, template(
        cli, "fail", SCRUBBED + "{% if rank == 1 %}sleep 3; exit 1{% else %}sleep 300{% endif %}\n"),
        detach=False)
    assert failing.wait(120) == 4, failing.dump()
    all_clean(ssh_nodes4, 1, 2)
    meta = json.loads((cli.cwd / "runs" / failing.run_id() / "run.json").read_text())
    assert meta["stops"] == {"node1": "term"}, meta       # node2 failed; node1 was stopped

    attached = up(cli, ssh_nodes4, template(cli, "int", SCRUBBED + "sleep 300\n"), detach=False)
    attached.wait_for(lambda p: sum("started" in line for line in p.out) == 2, 60, "both nodes")
    assert wait_until(lambda: scrubbed_on(ssh_nodes4, 1, 2), 30) is not None
    attached.popen.send_signal(signal.SIGINT)
    assert attached.wait(90) == 130, attached.dump()
    all_clean(ssh_nodes4, 1, 2)


def test_a_stop_that_needs_sigkill_says_so(ssh_nodes4, cli):
    """A worker that ignores SIGTERM is killed after the grace (1 s here): status says so."""
    stubborn = "bash -c \"trap '' TERM; echo ready; while true; do sleep 0.2; done\" &\nwait\n"
    started = up(cli, ssh_nodes4, template(cli, "tpl", stubborn), "--stop-grace", "1", nodes=1)
    assert started.popen.returncode == 0, started.dump()
    run_id = started.run_id()
    assert wait_until(lambda: matching(ssh_nodes4, "sleep 0.2", 1), 30) is not None
    down = cli.run("down", run_id, timeout=60)
    assert down.popen.returncode == 0 and "SIGKILL after the grace" in down.stderr, down.dump()
    all_clean(ssh_nodes4, 1)
    status = cli.run("status", run_id, timeout=60)
    assert "SIGTERM, then SIGKILL after the 1 s grace" in status.stdout, status.dump()


# --- the job's umask is the user's; cluster's files stay private ----------------------------


def test_the_job_gets_the_node_logins_umask(ssh_nodes4, cli):
    inv = ssh_nodes4.write_inventory(cli.home / "inv.yaml")
    login = cli.run("exec", "-i", inv, "--hosts", "node1", "--", "sh", "-c", "umask", timeout=60)
    assert login.popen.returncode == 0 and "[node1] 0022" in login.out, login.dump()
    body = "umask\ntouch ckpt-{{ rank }}\necho \"$PWD/ckpt-{{ rank }}\"\n"
    run = up(cli, ssh_nodes4, template(cli, "tpl", body), detach=False, nodes=1)
    assert run.wait(120) == 0, run.dump()
    assert "[node1 0] 0022" in run.out, run.dump()
    ckpt = Path(next(line for line in run.out if line.endswith("/ckpt-0")).split("] ", 1)[1])
    assert stat.S_IMODE(ckpt.stat().st_mode) == 0o644, run.dump()
    # cluster's own: the node's run folder and every file in it, the local record
    node_dir = next(Path(ssh_nodes4.workdir(1)).glob(f".cluster/{run.run_id()}/node1"))
    assert stat.S_IMODE(node_dir.stat().st_mode) == 0o700
    for f in node_dir.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) & 0o077 == 0, f
    record = cli.cwd / "runs" / run.run_id()
    assert stat.S_IMODE(record.stat().st_mode) == 0o700


# --- a node's disk full under its run folder ----------------------------------------------------

def test_a_full_disk_under_the_run_folder_leaves_the_job_and_its_stream_alive(tmp_path: Path):
    """The node's run folder on a tiny tmpfs (256 KiB) that the job's own output fills: the
    job runs to its end, all it printed (2 MB) reaches the launcher's stream, the supervisor
    says once that the log could not be written, and it still reports its end."""
    import os
    import subprocess
    from cluster.nodes import Demux
    from tests.unit.test_supervisor import finish_within, start
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    d = tmp_path / "node"
    d.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k,mode=0700", "tmpfs", str(d)], check=True)
    try:
        (d / "launch.sh").write_text(
            "for i in $(seq 1 40000); do echo \"line $i of a job that prints a lot\"; done\n"
            "echo done\n")
        p = start(d)
        out = finish_within(p, 60)
        log_size = (d / "output.log").stat().st_size
    finally:
        subprocess.run(["umount", "-l", str(d)], check=True)
    assert p.returncode == 0, out[-500:]
    pieces = Demux().feed(out.split(b"\n", 1)[1])           # after the pgid line
    text = b"".join(x for x in pieces if isinstance(x, bytes)).decode()
    assert text == "".join(f"line {i} of a job that prints a lot\n"
                           for i in range(1, 40001)) + "done\n"
    assert 0 < log_size < len(text)                        # the disk took what it could
    said = [r["said"] for r in pieces if isinstance(r, dict) and "said" in r]
    # once each: the log, and the exit record (the launcher has the end all the same)
    assert said == ["the node's log could not be written: No space left on device, "
                    "output still streamed",
                    "the node's exit record could not be written: No space left on device"], said
    assert [r for r in pieces if isinstance(r, dict) and "final" in r], pieces[-3:]
