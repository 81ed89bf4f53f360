"""`cluster up` on this machine, end to end, with real torchrun and gloo (no SSH, no root)."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.fixtures import processes_with_env

REPO = Path(__file__).resolve().parents[2]
ALLREDUCE = REPO / "tests" / "integration" / "programs" / "allreduce.py"
BEAT_THEN_HANG = REPO / "tests" / "integration" / "programs" / "beat_then_hang.py"

pytestmark = pytest.mark.skipif(
    subprocess.run([sys.executable, "-c", "import torch"], capture_output=True).returncode != 0,
    reason="torch is not installed for this python")


def cluster(tmp_path: Path, *args: str, timeout: float = 180, umask: int | None = None,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", NO_COLOR="1", **(env or {}))
    env.pop("CLUSTER_RUNS_DIR", None)
    return subprocess.run([sys.executable, "-m", "cluster", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=timeout,
                          preexec_fn=None if umask is None else (lambda: os.umask(umask)))


def reports(stdout: str) -> list[tuple[str, dict]]:
    """[node label] {json} lines printed by the all_reduce program."""
    out = []
    for line in stdout.splitlines():
        if line.startswith("[") and "] {" in line:
            label, _, payload = line[1:].partition("] ")
            data = json.loads(payload)
            if "sum" in data:
                out.append((label, data))
    return out


def run_processes(run_id: str) -> list[int]:
    return processes_with_env("CLUSTER_RUN_ID", run_id)


# The process that draws a run's picture after the launcher has exited (timeline_png.write_later):
# cluster's own, it ends by itself, so a look for what is left waits for it to end, first.
DRAWER = "-m cluster.observe.timeline_png"


def processes_under(folder: Path) -> list[str]:
    """Every process (but this one) working in `folder` or naming it on its command line, read
    from /proc: independent of the run-id scan cluster itself stops by. The run's picture is
    drawn beside the prompt: that process must end by itself (within 60 s), and is then gone."""
    deadline = time.monotonic() + 60
    while (drawing := [p for p in _under(folder) if DRAWER in p]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not drawing, f"the picture's process did not end by itself: {drawing}"
    return _under(folder)


def _under(folder: Path) -> list[str]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cwd = os.readlink(entry / "cwd")
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if cwd == str(folder) or cwd.startswith(f"{folder}/") or str(folder) in cmd:
            found.append(f"{entry.name} {cmd}")
    return found


def only_run(tmp_path: Path) -> Path:
    (run,) = list((tmp_path / "runs").iterdir())
    return run


def test_localhost_runs_two_gloo_processes(tmp_path: Path) -> None:
    res = cluster(tmp_path, "up", "--", str(ALLREDUCE))
    assert res.returncode == 0, res.stderr
    got = reports(res.stdout)
    assert sorted(d["rank"] for _, d in got) == [0, 1]
    assert all(d["world_size"] == 2 and d["sum"] == 3.0 for _, d in got)
    run = only_run(tmp_path)
    assert (run / "logs" / "0-localhost.log").read_text().count('"sum": 3.0') == 2
    meta = json.loads((run / "run.json").read_text())
    assert meta["backend"] == "local" and meta["exits"]["localhost 0"]["code"] == 0


def test_simulated_nodes(tmp_path: Path) -> None:
    res = cluster(tmp_path, "up", "--local", "--nodes", "2", "--", str(ALLREDUCE), umask=0o022)
    assert res.returncode == 0, res.stderr
    got = reports(res.stdout)
    assert sorted(d["rank"] for _, d in got) == [0, 1]
    assert all(d["world_size"] == 2 and d["sum"] == 3.0 for _, d in got)
    # each rank ran under its own simulated node, and its output carries that node's prefix
    assert {(label, d["node"]) for label, d in got} == {("local0 0", "local0"), ("local1 1", "local1")}
    scripts = sorted(p.name for p in (only_run(tmp_path) / "scripts").iterdir())
    assert scripts == ["0-local0.sh", "1-local1.sh"]
    # under umask 022, every folder of the run is 0700 and no file is readable by others
    for p in [tmp_path / "runs", *(tmp_path / "runs").rglob("*")]:
        mode = p.stat().st_mode & 0o777
        assert mode == 0o700 if p.is_dir() else mode & 0o077 == 0, f"{p} is {oct(mode)}"


def test_failing_rank_stops_the_other_node(tmp_path: Path) -> None:
    t0 = time.monotonic()
    res = cluster(tmp_path, "up", "--local", "--nodes", "2", "--", str(ALLREDUCE),
                  "--fail-rank", "1", "--sleep", "120")
    assert time.monotonic() - t0 < 60, "the healthy node must not wait out its sleep"
    assert res.returncode == 4, res.stderr
    # stopped from its supervisor's report of the rank's death (exit 3), before torchrun looked
    assert re.search(r"node \[local1 1\] failed first: rank 1 \(pid \d+\) died: exit code 3\n",
                     res.stderr), res.stderr
    assert re.search(r"node \[local1 1\] failed: rank 1 \(pid \d+\) died: exit code 3; "
                     r"stopped the other 1 node\(s\)", res.stderr), res.stderr
    assert "stopping the other 1 node(s)" in res.stderr
    run_id = only_run(tmp_path).name
    assert run_processes(run_id) == []
    assert processes_under(tmp_path) == []


def test_ctrl_c_leaves_no_process(tmp_path: Path) -> None:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", NO_COLOR="1")
    proc = subprocess.Popen([sys.executable, "-m", "cluster", "up", "--local", "--nodes", "2", "--",
                             str(ALLREDUCE), "--sleep", "120"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 90
    seen = ""
    while time.monotonic() < deadline and seen.count('"sleeping"') < 2:
        line = proc.stdout.readline()
        if not line:
            break
        seen += line
    assert seen.count('"sleeping"') == 2, seen
    run_id = only_run(tmp_path).name
    assert len(run_processes(run_id)) >= 4     # per node: bash->torchrun and a worker
    assert len(processes_under(tmp_path)) >= 4, "the independent scan sees the run too"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted" in err
    assert run_processes(run_id) == []
    assert processes_under(tmp_path) == []


def test_kill_9_of_the_launcher_leaves_one_stop_on_every_simulated_node(tmp_path: Path) -> None:
    """The local launcher SIGKILLed: its supervisors (sessions of their own) see their input
    close and stop their nodes; every row of status then says one stop, with one code."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", NO_COLOR="1", COLUMNS="200")
    env.pop("CLUSTER_RUNS_DIR", None)
    proc = subprocess.Popen([sys.executable, "-m", "cluster", "up", "--local", "--nodes", "2", "--",
                             str(ALLREDUCE), "--sleep", "120"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    seen = ""
    while seen.count('"sleeping"') < 2 and (line := proc.stdout.readline()):
        seen += line
    assert seen.count('"sleeping"') == 2, seen
    run_id = only_run(tmp_path).name
    proc.kill()
    proc.communicate(timeout=30)
    deadline = time.monotonic() + 30
    while run_processes(run_id) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert run_processes(run_id) == []
    status = cluster(tmp_path, "status", env={"COLUMNS": "200"})
    rows = [[c.strip() for c in line.split("│")[3:4] + line.split("│")[4:5] + line.split("│")[7:8]]
            for line in status.stdout.splitlines() if re.match(r"│ \d ", line)]
    assert rows == [["stopped", "143", "SIGTERM: ended within the 30 s grace; the launcher's "
                     "connection closed"]] * 2, status.stdout
    assert "the launcher ended without recording how the run ended" in status.stdout


def test_default_job_trains_for_real(tmp_path: Path) -> None:
    res = cluster(tmp_path, "up", timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    final = [line for line in res.stdout.splitlines() if "FINAL {" in line]
    assert final, res.stdout[-3000:]
    summary = json.loads(final[-1].split("FINAL ", 1)[1])
    assert summary["world_size"] == 2
    assert summary["val_acc"] >= 0.9
    assert (only_run(tmp_path) / "train" / "metrics.jsonl").exists()


def test_logs_follow_every_node_at_once(tmp_path: Path) -> None:
    """`cluster logs -f` interleaves nodes as their lines arrive: node 1's line, printed
    between node 0's two lines, is shown between them (not after node 0 has ended)."""
    (tmp_path / "tpl").mkdir()
    (tmp_path / "tpl" / "node.sh.j2").write_text(
        "{% if rank == 0 %}echo a0; sleep 4; echo a1\n"
        "{% else %}sleep 2; echo b0\n{% endif %}")
    res = cluster(tmp_path, "up", "--local", "--nodes", "2", "--detach", "--templates", "tpl",
                  "--", "unused")
    assert res.returncode == 0, res.stderr
    logs = cluster(tmp_path, "logs", "-f", timeout=60)
    assert logs.returncode == 0, logs.stderr
    shown = [line for line in logs.stdout.splitlines() if line.startswith("[")]
    assert shown == ["[local0 0] a0", "[local1 1] b0", "[local0 0] a1"], logs.stdout


# --- the Python API, from a program that then exits -------------------------------------------

API_SCRIPT = """
import json, sys, time
import cluster
from pathlib import Path

mode, program = sys.argv[1:3]
out = {}
run = cluster.up(None, program, ["--sleep", "3" if mode in ("detach", "detach-wait") else "120"],
                 backend="local", nodes=2, detach=mode.startswith("detach"), echo=False)
out.update(run_id=run.run_id, record=(run.path / "run.json").is_file())
if mode == "detach-wait":
    out["wait_at_once"] = run.wait(timeout=0)          # the nodes are running
    out["wait"] = run.wait(timeout=120)
    out["status"] = run.status()
elif mode == "detach-down":                            # no launcher: stopped as `cluster down`
    deadline = time.monotonic() + 120
    while set(run.status().values()) != {"running"} and time.monotonic() < deadline:
        time.sleep(0.2)
    out["down"] = run.down(timeout=120)
    out["error"] = str(run.error)
    out["status"] = run.status()
elif mode == "attached-late":                          # exit while the workers run
    deadline = time.monotonic() + 120
    while run.logs().count('"sleeping"') < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    out["status"] = run.status()
print(json.dumps(out), flush=True)
"""


def api_program(tmp_path: Path, mode: str) -> dict:
    """A program using cluster's Python API, run as a user runs one, to its exit."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", NO_COLOR="1", PYTHONPATH=str(REPO))
    env.pop("CLUSTER_RUNS_DIR", None)
    res = subprocess.run([sys.executable, "-c", API_SCRIPT, mode, str(ALLREDUCE)], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.splitlines()[-1])


def wait_for(pred, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.1)
    return bool(pred())


def test_python_api_detached_run_outlives_its_program(tmp_path: Path) -> None:
    got = api_program(tmp_path, "detach")
    assert got["record"], "run.json exists from the moment up() returns"
    run = tmp_path / "runs" / got["run_id"]
    # the program has exited; the run goes on without it and ends by itself
    assert run_processes(got["run_id"]), "the detached run must outlive its program"
    assert wait_for(lambda: run_processes(got["run_id"]) == [], 120)
    status = cluster(tmp_path, "status", got["run_id"])
    assert status.stdout.count("exited") == 2 and "│ 0 " in status.stdout, status.stdout
    logs = cluster(tmp_path, "logs", got["run_id"])
    assert sorted(d["rank"] for _, d in reports(logs.stdout)) == [0, 1], logs.stdout
    assert json.loads((run / "run.json").read_text())["detached"] is True


def test_python_api_wait_on_a_detached_run_is_none_until_it_ends(tmp_path: Path) -> None:
    got = api_program(tmp_path, "detach-wait")
    assert got["record"]
    assert got["wait_at_once"] is None, got
    assert got["wait"] == 0, got
    assert got["status"] == {"local0": "exited 0", "local1": "exited 0"}, got
    assert run_processes(got["run_id"]) == []


def test_python_api_down_stops_a_detached_run(tmp_path: Path) -> None:
    got = api_program(tmp_path, "detach-down")
    assert got["down"] == 143 and "the run was stopped" in got["error"], got
    assert set(got["status"].values()) == {"stopped"}, got
    assert run_processes(got["run_id"]) == [] and processes_under(tmp_path) == []


@pytest.mark.parametrize("when", ["early", "late"])
def test_python_api_attached_run_stops_when_its_program_exits(tmp_path: Path, when: str) -> None:
    """Early: the program ends while the nodes are checked; late: while the workers run.
    Either way nothing of the run is left, and its record says why."""
    got = api_program(tmp_path, f"attached-{when}")
    assert got["record"]
    if when == "late":
        assert got["status"] == {"local0": "running", "local1": "running"}, got
    assert run_processes(got["run_id"]) == []
    assert processes_under(tmp_path) == [], "the independent scan finds nothing either"
    meta = json.loads((tmp_path / "runs" / got["run_id"] / "run.json").read_text())
    assert meta["stopped_because"].startswith("the program that started it exited"), meta
    assert meta["exit_code"] == 143, meta
    status = cluster(tmp_path, "status", got["run_id"])
    assert "stopped because the program that started it exited" in status.stdout, status.stdout


# --- the reference trainer, launch after launch -----------------------------------------------


def final_line(stdout: str) -> dict:
    line = [ln for ln in stdout.splitlines() if "FINAL {" in ln][-1]
    return json.loads(line.split("FINAL ", 1)[1])


def test_the_quickstarts_two_commands_each_train(tmp_path: Path) -> None:
    """`cluster up`, then `cluster up --local --nodes 2` (one epoch each): the second does not
    "resume" the finished first run into 0 steps; it trains, and says why it did not resume.
    A run stopped before its end is resumed by the next launch."""
    first = cluster(tmp_path, "up", "--", "--epochs", "1", "--no-plot", timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    assert final_line(first.stdout)["steps"] == 22
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("ckpt_*")) != []
    second = cluster(tmp_path, "up", "--local", "--nodes", "2", "--", "--epochs", "1",
                     "--no-plot", timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    got = final_line(second.stdout)
    assert got["steps"] == 22 and got["resumed_from"] is None and got["images_per_s"], got
    assert "not resuming:" in second.stdout and "training anew" in second.stdout
    # unfinished: --max-steps ends it early; the next launch continues it to the end
    third = cluster(tmp_path, "up", "--", "--epochs", "1", "--max-steps", "5", "--no-plot",
                    timeout=300)
    assert third.returncode == 0 and final_line(third.stdout)["steps"] == 5, third.stderr[-3000:]
    fourth = cluster(tmp_path, "up", "--local", "--nodes", "2", "--", "--epochs", "1",
                     "--no-plot", timeout=300)
    assert fourth.returncode == 0, fourth.stderr[-3000:]
    got = final_line(fourth.stdout)
    assert got["resumed_from"].endswith("ckpt_step00000005.pt") and got["steps"] == 22, got


def test_a_missing_script_stops_the_launch_before_anything_starts(tmp_path: Path) -> None:
    """Checked on each node, from its workdir (here: this directory), with and without the
    cross-node checks: exit 3 naming node and path, and no torchrun ever started."""
    for extra in ([], ["--no-preflight"]):
        res = cluster(tmp_path, "up", "--local", "--nodes", "2", *extra, "--", "no-such.py")
        assert res.returncode == 3, res.stderr
        for node in ("local0", "local1"):
            assert (f"{node}: script: no-such.py is not a file on this node (looked for "
                    f"{tmp_path}/no-such.py") in res.stderr, res.stderr
        assert "ChildFailedError" not in res.stdout + res.stderr
        assert processes_under(tmp_path) == []
    for run in (tmp_path / "runs").iterdir():
        assert "pgids" not in json.loads((run / "run.json").read_text())    # nothing started


def test_hang_timeout_auto_learns_from_the_beats_and_stops_a_hang_within_a_minute(tmp_path: Path) -> None:
    """Issue 26: a job that beats every half second for 12 s, then hangs, under --hang-timeout
    auto with its default settings: the learned timeout said once, the job stopped within 60 s
    of its last beat, every rank's stack collected, the watchdog's exit code (4)."""
    res = cluster(tmp_path, "up", "--local", "--nodes", "2", "--nproc-per-node", "1",
                  "--hang-timeout", "auto", "--", str(BEAT_THEN_HANG), timeout=240)
    assert res.returncode == 4, res.stdout + res.stderr
    learned = [line for line in res.stderr.splitlines() if "hang timeout now" in line]
    # The floor, said once (a second line only if a loaded machine stretched one interval to 4 s)
    assert 1 <= len(learned) <= 2 and "hang timeout now 30 s: the floor" in learned[0], res.stderr
    assert re.search(r"no progress on any node for \d+ s \(--hang-timeout auto: ", res.stderr), \
        res.stderr
    run = next((tmp_path / "runs").iterdir())
    beats = sorted(tmp_path.rglob("heartbeat"))            # each node's, in its run folder
    assert len(beats) == 2, sorted(str(p) for p in tmp_path.rglob("*"))
    last_beat = max(p.stat().st_mtime for p in beats)
    hang = run / "hang"
    assert sorted(p.name for p in hang.iterdir()) == [
        "last-lines.txt", "local0-rank0.txt", "local1-rank1.txt", "summary.txt"], res.stderr
    stopped = (hang / "summary.txt").stat().st_mtime       # written once every node stopped
    took = stopped - last_beat
    print(f"last beat -> stopped, stacks collected: {took:.1f} s; {learned[0]}")
    assert 30 <= took < 60, took
    assert "beat_then_hang.py" in (hang / "summary.txt").read_text()
    assert run_processes(run.name) == []
def test_hang_timeout_auto_waits_out_a_long_checkpoint_of_the_reference_trainer(tmp_path: Path) -> None:
    """The reference trainer beats every second, so `auto` learns 30 s (the floor) within its
    first 12 s of steps (0.2 s each, a test hook); then rank 0 takes 45 s to write the
    checkpoint of step 60 (another). It says so in its heartbeat file (`section checkpoint`),
    the timeout is the start-up allowance while it lasts, and the run finishes (without the
    section, the same run was stopped: "no progress on any node for 36 s")."""
    res = cluster(tmp_path, "up", "--local", "--nodes", "2", "--nproc-per-node", "1",
                  "--hang-timeout", "auto",
                  "--", str(REPO / "train" / "train.py"), "--epochs", "10", "--max-steps", "70",
                  "--ckpt-every", "60", "--log-every", "10", "--no-plot", "--no-resume",
                  "--checkpoint-dir", "ckpt", timeout=300,
                  env={"CLUSTER_TRAIN_TEST_SAVE_SLEEP": "60:45",     # the nodes are children
                       "CLUSTER_TRAIN_TEST_STEP_SLEEP": "0.2"})      # of this one here
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr
    learned = [int(n) for n in re.findall(r"hang timeout now (\d+) s", res.stderr)]
    assert learned and min(learned) < 45, res.stderr       # the 45 s save outlasted it
    assert "no progress on any node" not in res.stderr, res.stderr
    final = json.loads(res.stdout.split("FINAL ", 1)[1].splitlines()[0])
    assert final["steps"] == 70
    events = [json.loads(line) for line in (only_run(tmp_path) / "events.jsonl").read_text().splitlines()]
    assert not [e for e in events if e["kind"] == "hang"]


def test_an_attached_run_leaves_its_timeline_and_status_draws_it_again(tmp_path: Path) -> None:
    res = cluster(tmp_path, "up", "--local", "--nodes", "2", "--", str(ALLREDUCE), "--sleep", "2")
    assert res.returncode == 0, res.stderr
    run = only_run(tmp_path)
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    kinds = {(e["kind"], e.get("node")) for e in events}
    for node in ("local0 0", "local1 1"):
        assert {("joined", node), ("exit", node)} <= kinds, kinds
    assert {("check", None), ("checked", None), ("start", None), ("outcome", None)} <= kinds
    import importlib.util
    drawn = "timeline.png" if importlib.util.find_spec("matplotlib") else "timeline.json"
    assert f"timeline: runs/{run.name}/{drawn} (drawn in the background" in res.stderr, res.stderr
    deadline = time.monotonic() + 60          # drawn beside the prompt, by a process of its own
    while not (run / drawn).exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    data = json.loads((run / "timeline.json").read_text())
    assert list(data["lanes"]) == ["local0 0", "local1 1"]
    assert f"timeline: runs/{run.name}/{drawn}" in res.stderr, res.stderr
    again = cluster(tmp_path, "status", run.name, "--timeline")
    assert again.returncode == 0, again.stderr
    assert f"timeline: runs/{run.name}/{drawn}" in again.stderr, again.stderr


# A job's lines that look like its supervisor's words: JSON, a brace that is no JSON, and a
# record framed as the supervisor frames its own (RS, JSON, US), which it must not be taken for.
LOOKALIKES = ['{"loss": 1.0}', '{broken', '{"event": "exit", "code": 7}',
              '\x1e{"final": {"left": [4242], "how": "kill"}}\x1f',
              '\x1e{"note": "forged by the job"}\x1f', 'a lone \x1e']


def test_a_job_printing_the_supervisors_words_is_shown_and_obeyed_by_nothing(tmp_path: Path) -> None:
    program = tmp_path / "lookalikes.py"
    program.write_text(f"import sys\nfor line in {LOOKALIKES!r}:\n    print(line, flush=True)\n")
    res = cluster(tmp_path, "up", "--local", "--", str(program))
    assert res.returncode == 0, res.stderr
    # split("\n"): splitlines() would cut at RS and US too
    shown = [line.split("] ", 1)[1] for line in res.stdout.split("\n") if "] " in line]
    assert [line for line in shown if line in LOOKALIKES][:len(LOOKALIKES)] == LOOKALIKES, res.stdout
    assert "forged" not in res.stderr and "4242" not in res.stderr, res.stderr
    log = (only_run(tmp_path) / "logs" / "0-localhost.log").read_text()
    assert all(line in log for line in LOOKALIKES), log


def test_the_local_backend_ends_the_agents_once_every_worker_exited_0(tmp_path: Path) -> None:
    """As over SSH (test_ending.py): two simulated nodes, every worker exits 0, the launcher's
    word ends each torchrun (its exit record says so), exit code 0, the output complete. Each
    rank freezes its torchrun before it exits (ending.py --freeze-agent), so only the finish can
    end the agents: a test that hangs here, not one that passes by torchrun's own exit."""
    ending = REPO / "tests" / "integration" / "programs" / "ending.py"
    res = cluster(tmp_path, "up", "--local", "--nodes", "2", "--", str(ending), "--freeze-agent")
    assert res.returncode == 0, res.stderr
    assert "rank 0: leaving" in res.stdout and "rank 1: leaving" in res.stdout, res.stdout
    exits = [json.loads(p.read_text()) for p in (only_run(tmp_path) / "nodes").glob("*/exit")]
    assert len(exits) == 2 and all(e["finished"] is True and e["code"] == 0 for e in exits), exits
