"""The per-node supervisor, run for real on this machine with plain bash scripts (no torch).

What matters: it stops every process of the run, including ones that escaped into sessions of
their own (as torchrun's workers do), and only those; it stops the run when the controller's
connection (its stdin) goes away; status and logs read back what happened."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


from cluster.backends.supervised import SUPERVISOR

RUN_ID = f"unit-{os.getpid()}"


def tagged_pids(run_id: str, node: str) -> list[int]:
    want = {f"CLUSTER_RUN_ID={run_id}".encode(), f"CLUSTER_NODE={node}".encode()}
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            env = set(Path(f"/proc/{name}/environ").read_bytes().split(b"\0"))
            state = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if want <= env and state != "Z":
            found.append(int(name))
    return found


def wait_for(cond, timeout: float = 10.0) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def node_dir(tmp_path: Path, body: str) -> Path:
    d = tmp_path / "node"
    d.mkdir()
    (d / "launch.sh").write_text("set -euo pipefail\n" + body)
    return d


def start(d: Path, node: str = "n1", detach: bool = False) -> subprocess.Popen:
    args = [sys.executable, str(SUPERVISOR), "run", str(d), "--run-id", RUN_ID, "--node", node,
            "--grace", "1"]
    if detach:
        args.append("--detach")
    return subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)


def finish(p: subprocess.Popen) -> bytes:
    """Read to the end with stdin still open (closing it means 'controller gone')."""
    out = p.stdout.read()
    p.wait(timeout=30)
    return out


def sup(*args: str) -> dict:
    out = subprocess.run([sys.executable, str(SUPERVISOR), *args], capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


# A worker that leaves the process group (like torchrun's workers) and ignores SIGTERM.
ESCAPEE = "setsid bash -c 'trap \"\" TERM; while true; do sleep 0.1; done' &\nsleep 300\n"


def test_exit_code_output_and_status(tmp_path: Path) -> None:
    d = node_dir(tmp_path, "echo hello; echo oops >&2; exit 3\n")
    p = start(d)
    out = finish(p)
    assert p.returncode == 3
    assert out.startswith(b"@@cluster pgid=")
    assert b"hello\n" in out and b"oops\n" in out
    st = sup("status", str(d))
    assert st["state"] == "exited" and st["code"] == 3
    assert (d / "output.log").read_bytes() == b"hello\noops\n"


def test_signal_exit_is_reported_as_128_plus_signal(tmp_path: Path) -> None:
    d = node_dir(tmp_path, "kill -9 $$\n")
    p = start(d)
    finish(p)
    assert p.returncode == 128 + 9


def test_stop_reaches_escaped_processes_and_verifies(tmp_path: Path) -> None:
    d = node_dir(tmp_path, ESCAPEE)
    p = start(d)
    assert wait_for(lambda: len(tagged_pids(RUN_ID, "n1")) >= 3)
    report = sup("stop", str(d), "--grace", "0.5")
    assert report["left"] == []
    assert report["killed"], "the TERM-ignoring escapee needed SIGKILL"
    assert wait_for(lambda: not tagged_pids(RUN_ID, "n1"), 5)
    p.communicate(timeout=30)
    assert sup("status", str(d))["state"] == "stopped", "a stop asked for reads as stopped"


def test_stop_leaves_other_nodes_and_runs_alone(tmp_path: Path) -> None:
    d1 = node_dir(tmp_path, "sleep 300\n")
    d2 = tmp_path / "other"
    d2.mkdir()
    (d2 / "launch.sh").write_text("sleep 300\n")
    p1 = start(d1, node="n1")
    p2 = start(d2, node="n2")
    try:
        assert wait_for(lambda: tagged_pids(RUN_ID, "n1") and tagged_pids(RUN_ID, "n2"))
        sup("stop", str(d1), "--grace", "0.5")
        assert wait_for(lambda: not tagged_pids(RUN_ID, "n1"))
        assert tagged_pids(RUN_ID, "n2"), "stopping node n1 must not touch node n2"
    finally:
        sup("stop", str(d2), "--grace", "0.5")
        p1.communicate(timeout=30)
        p2.communicate(timeout=30)


def test_controller_gone_stops_the_run(tmp_path: Path) -> None:
    d = node_dir(tmp_path, ESCAPEE)
    p = start(d)
    assert wait_for(lambda: len(tagged_pids(RUN_ID, "n1")) >= 3)
    p.stdin.close()          # what a dropped SSH connection looks like from the node
    p.wait(timeout=30)
    assert wait_for(lambda: not tagged_pids(RUN_ID, "n1"), 5)


def test_sigterm_to_supervisor_stops_the_run(tmp_path: Path) -> None:
    d = node_dir(tmp_path, ESCAPEE)
    p = start(d)
    assert wait_for(lambda: len(tagged_pids(RUN_ID, "n1")) >= 3)
    p.send_signal(signal.SIGTERM)
    p.wait(timeout=30)
    assert wait_for(lambda: not tagged_pids(RUN_ID, "n1"), 5)


def test_orphans_are_cleaned_when_the_launcher_dies(tmp_path: Path) -> None:
    # The node's main process dies hard; its escaped worker must not outlive it.
    d = node_dir(tmp_path, "setsid sleep 300 &\nsleep 0.5\nkill -9 $$\n")
    p = start(d)
    finish(p)
    assert wait_for(lambda: not tagged_pids(RUN_ID, "n1"), 5)
    assert json.loads((d / "exit").read_text())["leftovers"], "the orphan was found and stopped"


def test_detach_status_logs_and_stop(tmp_path: Path) -> None:
    d = node_dir(tmp_path, "echo started; sleep 300\n")
    p = start(d, detach=True)
    out, _ = p.communicate(timeout=30)
    pgid = int(out.decode().strip())
    assert pgid == int((d / "pgid").read_text())
    assert wait_for(lambda: sup("status", str(d))["state"] == "running")
    assert wait_for(lambda: (d / "output.log").read_bytes() == b"started\n")
    logs = subprocess.Popen([sys.executable, str(SUPERVISOR), "logs", str(d), "--follow"],
                            stdout=subprocess.PIPE)
    time.sleep(0.5)
    assert logs.poll() is None, "logs --follow keeps going while the run runs"
    assert sup("stop", str(d), "--grace", "0.5")["left"] == []
    out, _ = logs.communicate(timeout=10)
    assert out == b"started\n"
    assert wait_for(lambda: sup("status", str(d))["state"] == "stopped")


def test_probe_reports_port_and_torch(tmp_path: Path) -> None:
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    busy = s.getsockname()[1]
    try:
        facts = sup("probe", str(tmp_path), "--addr", "127.0.0.1", "--port", str(busy))
    finally:
        s.close()
    assert facts["port_free"] is False
    assert facts["home"] == os.path.expanduser("~")
    assert ("torch" in facts)
