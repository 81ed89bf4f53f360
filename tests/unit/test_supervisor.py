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


from cluster.nodes import read_answer
from cluster.backends.shipping import SUPERVISOR

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


def start(d: Path, node: str = "n1", detach: bool = False, config: dict | None = None,
          keepalive: float = 0.0, grace: float = 1, flags: tuple[str, ...] = ()) -> subprocess.Popen:
    args = [sys.executable, str(SUPERVISOR), "run", str(d), "--run-id", RUN_ID, "--node", node,
            "--grace", f"{grace:g}", "--keepalive", str(keepalive), *flags]
    if detach:
        args.append("--detach")
    p = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, start_new_session=True)
    p.stdin.write((json.dumps(config or {}) + "\n").encode())   # the launcher's first line
    p.stdin.flush()
    return p


def finish(p: subprocess.Popen) -> bytes:
    """Read to the end with stdin still open (closing it means 'controller gone')."""
    out = p.stdout.read()
    p.wait(timeout=30)
    return out


def finish_within(p: subprocess.Popen, seconds: float) -> bytes:
    """finish(p), or, when its output has not ended within `seconds` (a hung job), its
    launcher gone (stdin closed: the supervisor stops the run) and then what it said."""
    import threading
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(p.stdout.read()), daemon=True)
    reader.start()
    reader.join(seconds)
    if reader.is_alive():
        p.stdin.close()
        reader.join(30)
    p.wait(timeout=30)
    return got[0] if got else b""


def sup(*args: str) -> dict:
    out = subprocess.run([sys.executable, str(SUPERVISOR), *args], capture_output=True)
    said = read_answer(out.stdout)
    assert said is not None, out
    return said


# A worker that leaves the process group (like torchrun's workers) and ignores SIGTERM.
# A worker that leaves the group and ignores SIGTERM; it says so (a file beside the script) only
# once its trap is set, since a stop sent before then would find it still easy to stop.
ESCAPEE = ("setsid bash -c 'trap \"\" TERM; : > \"$1.trapped\"; while true; do sleep 0.1; done'"
           " _ \"$0\" &\nsleep 300\n")


def escapee_trapped(d: Path) -> bool:
    """True once the ESCAPEE in `d` ignores SIGTERM and runs beside the script."""
    return wait_for(lambda: (d / "launch.sh.trapped").exists()
                    and len(tagged_pids(RUN_ID, "n1")) >= 3)


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
    assert escapee_trapped(d)
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
    assert escapee_trapped(d)
    p.stdin.close()          # what a dropped SSH connection looks like from the node
    p.wait(timeout=30)
    assert wait_for(lambda: not tagged_pids(RUN_ID, "n1"), 5)


def test_sigterm_to_supervisor_stops_the_run(tmp_path: Path) -> None:
    d = node_dir(tmp_path, ESCAPEE)
    p = start(d)
    assert escapee_trapped(d)
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


def probe(d: Path, port: int) -> dict:
    """The probe's facts, as a launch's check asks for them (through the bootloader)."""
    from cluster.backends.shipping import BOOT, program
    out = subprocess.run([sys.executable, "-c", BOOT], capture_output=True, timeout=60,
                         input=program("probe", "facts", "--dir", str(d), "--port", str(port)).data)
    said = read_answer(out.stdout)
    assert said is not None, out
    return said


def test_probe_reports_port_and_torch(tmp_path: Path) -> None:
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    busy = s.getsockname()[1]
    try:
        facts = probe(tmp_path / "run", busy)
    finally:
        s.close()
    assert facts["port_free"] is False
    assert facts["home"] == os.path.expanduser("~")
    assert facts["executable"] == sys.executable
    import importlib.util
    have_torch = importlib.util.find_spec("torch") is not None
    assert bool(facts["torch"]) == have_torch
    if have_torch:
        assert facts["torch"]["run_py"].endswith("torch/distributed/run.py")


TIME_WAIT = "06"   # the state column of /proc/net/tcp (include/net/tcp_states.h)


def tcp_states(port: int) -> list[str]:
    """The states of this machine's IPv4 TCP sockets whose local port is `port`, read from
    /proc/net/tcp (the kernel's own table: no `ss`, which a node may lack)."""
    states = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        if int(local.rsplit(":", 1)[1], 16) == port:
            states.append(state)
    return states


def test_probe_counts_a_port_in_time_wait_as_free(tmp_path: Path) -> None:
    """After a run, the master port's closed connections sit in TIME_WAIT for a minute.
    torchrun's store binds with SO_REUSEADDR and can listen there: so must the probe."""
    import socket
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = server.accept()
    conn.close()               # the server side closes first: it is the one left in TIME_WAIT
    client.close()
    server.close()
    assert wait_for(lambda: TIME_WAIT in tcp_states(port), 5), tcp_states(port)
    facts = probe(tmp_path / "run", port)
    assert facts["port_free"] is True


def test_secret_env_reaches_the_run_through_stdin_only(tmp_path: Path) -> None:
    secret = f"tok-{os.getpid()}-$(touch {tmp_path}/canary) 'q' \"dq\""
    d = tmp_path / "node"
    body = (f'printf "%s" "$MY_SECRET" | sha256sum > {d}/got.txt\n'
            f'cat /proc/$$/cmdline | tr "\\0" " " > {d}/cmdline.txt\n')
    d = node_dir(tmp_path, body)
    p = start(d, config={"env": {"MY_SECRET": secret}})
    out = finish(p)
    assert p.returncode == 0, out
    import hashlib
    assert (d / "got.txt").read_text().split()[0] == hashlib.sha256(secret.encode()).hexdigest()
    assert not (tmp_path / "canary").exists()
    for f in d.iterdir():
        if f.is_file():
            assert secret.encode() not in f.read_bytes(), f
    assert secret.encode() not in out


def test_a_secret_named_like_what_the_supervisor_sets_is_the_users_value(tmp_path: Path) -> None:
    """PYTHONFAULTHANDLER is on by default for the watchdog's stacks; a secret of that name
    (as an `env` entry of that name, exported by launch.sh) is the user's choice and wins."""
    d = node_dir(tmp_path, f'printf "%s" "$PYTHONFAULTHANDLER" > {tmp_path}/got.txt\n')
    p = start(d, config={"env": {"PYTHONFAULTHANDLER": "secret-value"}})
    out = finish(p)
    assert p.returncode == 0, out
    assert (tmp_path / "got.txt").read_text() == "secret-value"
    d2 = tmp_path / "default"
    d2.mkdir()
    (d2 / "launch.sh").write_text(f'printf "%s" "$PYTHONFAULTHANDLER" > {tmp_path}/default.txt\n')
    p = start(d2)
    assert finish(p) is not None and p.returncode == 0
    assert (tmp_path / "default.txt").read_text() == "1"


def test_keepalive_stops_a_node_cut_off_from_its_launcher(tmp_path: Path) -> None:
    """No heartbeat for --keepalive seconds, yet the connection never closes (a cut network
    link looks like this from the node): the supervisor stops the run itself."""
    d = node_dir(tmp_path, ESCAPEE)
    p = start(d, keepalive=1.5)
    assert escapee_trapped(d)
    t0 = time.monotonic()
    p.wait(timeout=30)           # stdin is still open: only the missing heartbeat ends it
    took = time.monotonic() - t0
    assert wait_for(lambda: not tagged_pids(RUN_ID, "n1"), 5)
    assert took < 1.5 + 1 + 5, took       # keepalive + grace (1 s) + slack
    exit_info = json.loads((d / "exit").read_text())
    assert exit_info["stopped"] is True
    assert exit_info["reason"].startswith("lost the launcher")
    assert sup("status", str(d))["reason"].startswith("lost the launcher")
    p.stdin.close()


def test_heartbeats_keep_a_node_running(tmp_path: Path) -> None:
    d = node_dir(tmp_path, "sleep 3; echo done\n")
    p = start(d, keepalive=1.0)
    t0 = time.monotonic()
    while p.poll() is None and time.monotonic() - t0 < 30:
        time.sleep(0.3)
        try:
            p.stdin.write(b"\n")
            p.stdin.flush()
        except BrokenPipeError:
            break
    out = finish(p)
    assert p.returncode == 0 and b"done" in out
    assert json.loads((d / "exit").read_text())["stopped"] is False


def test_stop_grace_lets_a_program_finish_its_checkpoint(tmp_path: Path) -> None:
    body = (f"trap 'sleep 1.5; echo saved > {tmp_path}/node/ckpt; exit 0' TERM\n"
            "echo ready\nwhile true; do sleep 0.1; done\n")
    d = node_dir(tmp_path, body)
    args = [sys.executable, str(SUPERVISOR), "run", str(d), "--run-id", RUN_ID, "--node", "n1"]
    p = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
    p.stdin.write(b"{}\n")
    p.stdin.flush()
    assert wait_for(lambda: (d / "output.log").exists() and b"ready" in (d / "output.log").read_bytes())
    report = sup("stop", str(d), "--grace", "5")
    assert (d / "ckpt").read_text() == "saved\n", report
    assert report["killed"] == [] and report["left"] == []
    p.communicate(timeout=30)


def test_stop_never_signals_a_reused_process_group(tmp_path: Path) -> None:
    """The supervisor died (SIGKILL) and its run's group id now names someone else's
    processes: `stop` signals only processes that carry this run's identity."""
    d = node_dir(tmp_path, "sleep 300\n")
    p = start(d)
    assert wait_for(lambda: tagged_pids(RUN_ID, "n1"))
    os.killpg(p.pid, signal.SIGKILL)                       # the supervisor, gone
    p.wait(timeout=10)
    stranger = subprocess.Popen(["sleep", "300"], start_new_session=True,
                                env={"PATH": os.environ["PATH"]})
    try:
        (d / "pgid").write_text(str(stranger.pid))         # as if the id had been reused
        report = sup("stop", str(d), "--grace", "0.5")
        assert stranger.poll() is None, "a process of another owner was signalled"
        assert stranger.pid not in report["signalled"] + report["killed"]
        assert wait_for(lambda: not tagged_pids(RUN_ID, "n1"), 5), "the run's own sleep remains"
    finally:
        stranger.kill()
        stranger.wait()


def test_stop_on_its_own_channel_answers_with_what_was_left(tmp_path: Path) -> None:
    """The launcher's `stop` line: the supervisor stops every process of the run (one that
    left the group and ignores SIGTERM included), then its last record says what was left."""
    from cluster.nodes import Demux
    d = node_dir(tmp_path, ESCAPEE)
    p = start(d)
    assert escapee_trapped(d)
    t0 = time.monotonic()
    p.stdin.write(b"stop\n")
    p.stdin.flush()
    out = finish(p)
    took = time.monotonic() - t0
    records = [r for r in Demux().feed(out) if isinstance(r, dict)]
    final = [r["final"] for r in records if "final" in r]
    assert final and final[-1]["left"] == [] and final[-1]["killed"], records
    assert not tagged_pids(RUN_ID, "n1")                       # checked here, independently
    assert took < 1 + 2 + 5, took                              # grace (1 s) + KILL wait + slack
    exit_info = json.loads((d / "exit").read_text())
    assert exit_info["stopped"] is True and exit_info["reason"] == "stopped by the launcher"
    p.stdin.close()


def test_a_nodes_run_folder_is_private_up_to_the_workdirs_cluster_folder(tmp_path: Path) -> None:
    """<workdir>/.cluster/<run>/<node> holds scripts with env values: every folder cluster
    makes on the way is 0700 whatever the umask, and nothing above .cluster is touched."""
    import importlib.util
    import stat
    if str(SUPERVISOR.parent) not in sys.path:
        sys.path.insert(0, str(SUPERVISOR.parent))    # as on the node: containers.py beside it
    spec = importlib.util.spec_from_file_location("probe", SUPERVISOR.parent / "probe.py")
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    workdir = tmp_path / "work"
    old = os.umask(0o022)
    try:
        made = probe.make_dir(str(workdir / ".cluster" / "run1" / "node1"), private=True)
    finally:
        os.umask(old)
    assert made == str(workdir / ".cluster" / "run1" / "node1")
    for folder in (workdir / ".cluster", workdir / ".cluster" / "run1", Path(made)):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
    assert stat.S_IMODE(workdir.stat().st_mode) == 0o755


# --- processes that leave the run's identity; the job's umask; how a stop went ------------------

# A child in a session of its own with an empty environment (no CLUSTER_* to find it by): it
# writes its pid, then sleeps.
SCRUBBED = "setsid env -i sh -c 'echo $$ > {pidfile}; exec sleep 300' &\n"


def live(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def scrubbed_child(tmp_path: Path, rest: str) -> tuple[Path, Path]:
    pidfile = tmp_path / "scrubbed.pid"
    return node_dir(tmp_path, SCRUBBED.format(pidfile=pidfile) + rest), pidfile


def cleanup_pid(pidfile: Path) -> None:
    if pidfile.exists() and live(int(pidfile.read_text())):
        os.kill(int(pidfile.read_text()), signal.SIGKILL)


def test_stop_reaches_a_child_that_left_the_runs_identity(tmp_path: Path) -> None:
    """`setsid env -i ...` from the job: no run id in its environment, not in the run's group.
    It is still the supervisor's descendant (the supervisor is a child subreaper), so the stop
    that the launcher asks for reaches it."""
    d, pidfile = scrubbed_child(tmp_path, "sleep 300\n")
    p = start(d)
    try:
        assert wait_for(lambda: pidfile.exists() and pidfile.read_text().strip())
        pid = int(pidfile.read_text())
        assert live(pid) and pid not in tagged_pids(RUN_ID, "n1")
        p.stdin.write(b"stop\n")
        p.stdin.flush()
        finish(p)
        assert not live(pid), "the child without the run's identity outlived the stop"
    finally:
        cleanup_pid(pidfile)


def test_a_run_that_ends_takes_its_scrubbed_orphan_with_it(tmp_path: Path) -> None:
    """The job's script ends (exit 0) and leaves the scrubbed child running: re-parented to
    the supervisor, it is stopped with the run's leftovers."""
    d, pidfile = scrubbed_child(tmp_path, "sleep 0.3\n")
    p = start(d)
    try:
        finish(p)
        assert p.returncode == 0
        pid = int(pidfile.read_text())
        assert not live(pid)
        assert pid in json.loads((d / "exit").read_text())["leftovers"]
    finally:
        cleanup_pid(pidfile)


def test_stop_of_a_detached_run_is_done_by_its_supervisor(tmp_path: Path) -> None:
    """`cluster down` of a detached run: `stop` asks the run's own supervisor, which knows its
    whole family (the scrubbed child too); its report says how the stop went."""
    d, pidfile = scrubbed_child(tmp_path, "sleep 300\n")
    p = start(d, detach=True)
    p.communicate(timeout=30)
    try:
        assert wait_for(lambda: pidfile.exists() and pidfile.read_text().strip())
        pid = int(pidfile.read_text())
        report = sup("stop", str(d), "--grace", "2")
        assert not live(pid), report
        assert pid in report["signalled"] and report["left"] == [] and report["how"] == "term"
        ended = json.loads((d / "exit").read_text())
        assert ended["reason"] == "stop requested" and ended["how"] == "term"
    finally:
        cleanup_pid(pidfile)


def test_the_job_gets_the_umask_the_supervisor_started_with(tmp_path: Path) -> None:
    """cluster's own files are private; the job's are as its user's umask makes them."""
    d = node_dir(tmp_path, f"umask > {tmp_path}/job-umask\ntouch {tmp_path}/ckpt\n")
    old = os.umask(0o022)
    try:
        p = start(d)
    finally:
        os.umask(old)
    finish(p)
    assert (tmp_path / "job-umask").read_text().strip() == "0022"
    assert (tmp_path / "ckpt").stat().st_mode & 0o777 == 0o644
    for name in ("output.log", "exit", "pgid", "tag"):
        assert (d / name).stat().st_mode & 0o777 == 0o600, name


def test_status_says_whether_a_stop_ended_within_the_grace(tmp_path: Path) -> None:
    """A job that ends on SIGTERM within the grace reads "term" (with its exit code); one that
    ignores SIGTERM is killed after the grace: "kill"."""
    polite = node_dir(tmp_path, "trap 'exit 0' TERM\necho ready\nwhile true; do sleep 0.1; done\n")
    p = start(polite)
    assert wait_for(lambda: b"ready" in (polite / "output.log").read_bytes()
                    if (polite / "output.log").exists() else False)
    assert sup("stop", str(polite), "--grace", "5")["how"] == "term"
    p.communicate(timeout=30)
    st = sup("status", str(polite))
    assert (st["state"], st["how"], st["code"], st["signal"]) == ("stopped", "term", 0, None), st

    stubborn = tmp_path / "stubborn"
    stubborn.mkdir()
    (stubborn / "launch.sh").write_text(ESCAPEE)     # a worker that ignores SIGTERM
    p = start(stubborn)
    assert escapee_trapped(stubborn)
    assert sup("stop", str(stubborn), "--grace", "0.5")["how"] == "kill"
    p.communicate(timeout=30)
    st = sup("status", str(stubborn))
    assert (st["state"], st["how"], st["grace"]) == ("stopped", "kill", 0.5), st   # the stop's


def test_a_stop_with_its_own_grace_is_held_to_it_by_the_live_supervisor(tmp_path: Path) -> None:
    """`cluster down --stop-grace 0.5` of a run started with a 30 s grace: the run's own
    supervisor does the stop, and with the grace the stop was given, not its own."""
    d = tmp_path / "stubborn"
    d.mkdir()
    (d / "launch.sh").write_text(ESCAPEE)             # a worker that ignores SIGTERM
    p = start(d, grace=30)
    assert escapee_trapped(d)
    began = time.monotonic()
    report = sup("stop", str(d), "--grace", "0.5")
    took = time.monotonic() - began
    p.communicate(timeout=60)
    assert report["how"] == "kill" and report["left"] == [], report
    assert took < 15, f"the stop took {took:.1f} s: the run's 30 s grace, not the stop's 0.5 s"
    assert json.loads((d / "exit").read_text())["grace"] == 0.5


def test_a_shell_between_its_own_steps_gets_the_whole_grace(tmp_path: Path) -> None:
    """The short grace for a torchrun whose workers are gone is not given to a group leader
    that is alone only between two of its own commands (a TERM trap that saves, then exits):
    it is decided from the workers the stop found, not from one look at the group."""
    body = (f"trap 'sleep 0.6; sleep 0.6; echo saved > {tmp_path}/ckpt; exit 0' TERM\n"
            "echo ready\nwhile true; do sleep 0.05; done\n")
    d = node_dir(tmp_path, body)
    for attempt in range(5):
        p = start(d, grace=10)
        assert wait_for(lambda: (d / "output.log").exists() and b"ready" in (d / "output.log").read_bytes())
        report = sup("stop", str(d), "--grace", "10")
        p.communicate(timeout=30)
        assert (tmp_path / "ckpt").read_text() == "saved\n", (attempt, report)
        assert report["killed"] == [] and report["how"] == "term", (attempt, report)
        for name in ("ckpt", "output.log", "exit", "stop-requested"):
            (tmp_path / name if name == "ckpt" else d / name).unlink(missing_ok=True)


def test_logs_follow_ends_when_its_reader_is_gone(tmp_path: Path) -> None:
    """A follower on a node whose run prints nothing: when `cluster logs -f` is stopped its
    channel's input closes, and the follower ends with it (it would otherwise wait for the
    run's end, holding a process on the node)."""
    d = node_dir(tmp_path, "sleep 300\n")
    p = start(d, detach=True)
    p.communicate(timeout=30)
    try:
        logs = subprocess.Popen([sys.executable, str(SUPERVISOR), "logs", str(d), "--follow"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        time.sleep(0.5)
        assert logs.poll() is None, "logs --follow keeps going while the run runs"
        logs.stdin.close()
        assert logs.wait(timeout=5) == 0
    finally:
        sup("stop", str(d), "--grace", "0.5")


def test_a_stop_of_a_run_that_had_ended_says_how_it_ended(tmp_path: Path) -> None:
    """`cluster down` of a finished run: nothing is signalled, and the report carries the run's
    own end, as `cluster status` tells it, so the user reads "had already ended, exited 3",
    not "stopped"."""
    d = node_dir(tmp_path, "exit 3\n")
    finish(start(d))
    report = sup("stop", str(d), "--grace", "1")
    assert report["signalled"] == [] and report["ended"] == {
        "code": 3, "signal": None, "stopped": False, "how": None, "reason": None, "grace": 1.0
    }, report
    running = tmp_path / "running"
    running.mkdir()
    (running / "launch.sh").write_text("sleep 300\n")
    p = start(running)
    assert wait_for(lambda: tagged_pids(RUN_ID, "n1"))
    report = sup("stop", str(running), "--grace", "1")
    p.communicate(timeout=30)
    assert report["signalled"] and "ended" not in report, report



JOB_STARTS = r"""
import os, signal, sys
sys.path.insert(0, sys.argv[1])
import spawning
if sys.argv[2] == "popen":                   # a C library whose posix_spawn has no setsid
    def refuse(*args, **kwargs):
        raise NotImplementedError("setsid")
    os.posix_spawnp = refuse
leak = os.open(os.devnull, os.O_RDONLY)
os.set_inheritable(leak, True)               # as a descriptor inherited from sshd may be
signal.signal(signal.SIGPIPE, signal.SIG_IGN)
script = ("echo sid=$(ps -o sid= -p $$) umask=$(umask) fds=$(ls /proc/$$/fd | tr '\\n' ,); "
          "grep SigIgn /proc/$$/status; read x || echo stdin-empty; echo err >&2; exit 3")
pid, out = spawning.start_job(["bash", "-c", script], dict(os.environ), 0o027)
data = b""
while True:
    chunk = os.read(out, 4096)
    if not chunk:
        break
    data += chunk
print(pid, spawning.wait_job(pid), os.getsid(0), repr(data.decode()))
"""


def test_the_job_starts_as_popen_would_start_it(tmp_path: Path) -> None:
    """launch.sh starts by posix_spawn where the C library has it (the subprocess module's
    import costs a node ~4 ms), else by Popen; either way alike: a session of its own, the
    umask asked for, stdin /dev/null, stdout and stderr one pipe, no other descriptor, SIGPIPE
    not ignored, its exit code."""
    for way in ("spawn", "popen"):
        res = subprocess.run([sys.executable, "-c", JOB_STARTS, str(SUPERVISOR.parent), way],
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        pid, code, our_sid, text = res.stdout.split(" ", 3)
        text = eval(text)
        assert code == "3" and "stdin-empty" in text and "err" in text, (way, text)
        assert f"sid={pid} " in text.replace("sid= ", "sid=") and our_sid != pid, (way, text)
        assert "umask=0027" in text, (way, text)
        fds = [f for f in text.split("fds=")[1].split()[0].split(",") if f]
        assert sorted(fds)[:3] == ["0", "1", "2"] and len(fds) <= 4, (way, fds)   # + $(...)'s pipe
        ignored = int(text.split("SigIgn:")[1].split()[0], 16)
        assert not ignored & (1 << (signal.SIGPIPE - 1)), (way, text)


# A job's own lines that look like the supervisor's: JSON, a brace that is no JSON, and a
# record framed exactly as the supervisor frames its own (RS, JSON, US), a lone RS too.
FORGERIES = (b'{"loss": 1.0}\n{broken\n{"final": {"left": [1], "how": "kill"}}\n'
             b'\x1e{"final": {"left": [4242], "how": "kill"}}\x1f\n'
             b'a lone \x1e then text\n\x1e\x1e\x1f{"workers": 9}\x1f\n')


def test_a_job_that_prints_records_shows_them_as_output_and_forges_none(tmp_path: Path) -> None:
    """What the job prints comes out of the launcher's Demux byte for byte, and the only
    records are the supervisor's own: a job's `final` never stands for the supervisor's."""
    from cluster.nodes import Demux
    (tmp_path / "forged").write_bytes(FORGERIES)
    d = node_dir(tmp_path, f"cat {tmp_path / 'forged'}\n")
    p = start(d)
    out = finish(p)
    p.stdin.close()
    demux = Demux()
    pieces = demux.feed(out) + [demux.flush()]
    text = b"".join(x for x in pieces if isinstance(x, bytes))
    records = [x for x in pieces if isinstance(x, dict)]
    assert FORGERIES in text, text
    assert [r["final"]["left"] for r in records if "final" in r] == [[]], records
    assert not [r for r in records if "workers" in r], records


def test_demux_holds_what_a_read_cuts_and_gives_it_whole() -> None:
    """Every cut of an escaped stream gives the same output and records as one read."""
    from cluster.nodes import Demux
    stream = b'ab\x1e\x1ecd\x1e{"note": "x"}\x1fef\x1e\x1e'
    for cut in range(len(stream) + 1):
        demux = Demux()
        pieces = demux.feed(stream[:cut]) + demux.feed(stream[cut:]) + [demux.flush()]
        assert b"".join(x for x in pieces if isinstance(x, bytes)) == b"ab\x1ecdef\x1e", (cut, pieces)
        assert [x for x in pieces if isinstance(x, dict)] == [{"note": "x"}], (cut, pieces)


def test_a_log_that_cannot_be_written_leaves_the_job_and_its_stream_alive(tmp_path: Path) -> None:
    """The node's log on a device that refuses every write (/dev/full: ENOSPC): the job still
    runs to its end, every byte it printed (ten times a pipe's buffer) reaches the launcher,
    and the supervisor says once that its log could not be written."""
    from cluster.nodes import Demux
    d = node_dir(tmp_path, "for i in $(seq 1 8000); do echo \"line $i of the job's output\"; done\n"
                           "echo done\n")
    (d / "output.log").symlink_to("/dev/full")
    p = start(d)
    out = finish_within(p, 20)
    assert p.returncode == 0, out[-500:]
    pieces = Demux().feed(out.split(b"\n", 1)[1])        # after the pgid line
    text = b"".join(x for x in pieces if isinstance(x, bytes))
    expected = "".join(f"line {i} of the job's output\n" for i in range(1, 8001)) + "done\n"
    assert text.decode() == expected
    said = [r["said"] for r in pieces if isinstance(r, dict) and "said" in r]
    assert said == ["the node's log could not be written: No space left on device, "
                    "output still streamed"], said
    p.stdin.close()


# A job that counts the TERMs it gets (one line each, in the file named by its argument) and
# goes on, as torchrun does while it shuts its workers down.
COUNTS_TERMS = """
import signal, sys, time
def count(*_):
    with open(sys.argv[1], "a") as f:
        f.write("TERM\\n")
signal.signal(signal.SIGTERM, count)
print("ready", flush=True)
while True:
    time.sleep(0.01)
"""


class Preempted:
    """A stop's flag whose every look is followed by a pause (a longer one each time): the
    thread that looked is preempted there, and the next trigger looks meanwhile."""

    def __init__(self, event) -> None:
        self.event, self.looks = event, 0

    def is_set(self) -> bool:
        seen = self.event.is_set()
        self.looks += 1
        time.sleep(0.15 * self.looks)
        return seen

    def __getattr__(self, name: str):
        return getattr(self.event, name)


def test_two_stops_at_once_send_one_term(tmp_path: Path) -> None:
    """Two triggers of the stop at once (the launcher's connection closing while its stream
    fails, or a signal besides): the job gets one TERM, never two, even when the first is
    preempted between its look and its start."""
    import threading
    sys.path.insert(0, str(SUPERVISOR.parent))
    umask = os.umask(0o022)
    try:
        import supervisor
        import stopping
    finally:
        os.umask(umask)                  # the supervisor's import makes its own private
    counts = tmp_path / "terms"
    job = subprocess.Popen([sys.executable, "-c", COUNTS_TERMS, str(counts)],
                           env=dict(os.environ, CLUSTER_RUN_ID=RUN_ID, CLUSTER_NODE="n1"),
                           stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert job.stdout.readline() == b"ready\n"
        d = tmp_path / "run"
        d.mkdir()
        (d / "tag").write_text(json.dumps({"run_id": RUN_ID, "node": "n1"}))
        # By the run's identity alone (this test is not the job's supervisor).
        stop = stopping.StopOnce(str(d), 1.0, lambda d, grace, _: stopping.terminate(d, grace))
        stop.stopping = Preempted(stop.stopping)
        go = threading.Barrier(2)
        triggers = [threading.Thread(target=lambda why=why: (go.wait(), stop.begin(why)))
                    for why in ("the launcher's connection closed", "supervisor got SIGHUP")]
        for t in triggers:
            t.start()
        for t in triggers:
            t.join(10)
        for t in stop.threads:
            t.join(10)
        job.wait(timeout=10)               # KILLed after the grace: it ignores TERM
        assert counts.read_text() == "TERM\n"
        assert len(stop.why) == 1 and len(stop.done) == 1, (stop.why, stop.done)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
