"""cluster/remote/workers.py on a fake /proc: which processes are torchrun's workers, and
whether they hold a connection to the rendezvous store (joined). The tree below has what the
functions read: <pid>/environ, <pid>/fd/<n> links to socket:[inode], <pid>/net/tcp(6)."""
from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path

import pytest

from cluster.backends.shipping import SUPERVISOR

sys.path.insert(0, str(SUPERVISOR.parent))   # as on the node: family.py beside it
_spec = importlib.util.spec_from_file_location("node_workers", SUPERVISOR.parent / "workers.py")
workers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(workers)

PORT = 29500                       # 0x733C
HEAD = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"


def tcp_row(local: str, remote: str, state: str, inode: int) -> str:
    return (f"   0: {local} {remote} {state} 00000000:00000000 00:00000000 00000000  1000        0 "
            f"{inode} 1 0000000000000000 20 4 30 10 -1\n")


def process(root: Path, pid: int, env: dict[str, str], sockets: dict[int, str] | None = None,
            tcp6: dict[int, str] | None = None) -> None:
    """A fake process: its environment, one fd per socket inode, and its network tables
    (each socket's row: its remote address, as /proc/<pid>/net/tcp writes it)."""
    d = root / str(pid)
    (d / "fd").mkdir(parents=True)
    (d / "net").mkdir()
    sockets, tcp6 = sockets or {}, tcp6 or {}
    (d / "environ").write_bytes(b"\0".join(f"{k}={v}".encode() for k, v in env.items()) + b"\0")
    os.symlink("/dev/null", d / "fd" / "0")
    for n, inode in enumerate([*sockets, *tcp6], start=3):
        os.symlink(f"socket:[{inode}]", d / "fd" / str(n))
    (d / "net" / "tcp").write_text(HEAD + "".join(
        tcp_row("0B4D000A:A1B2", remote, "01", inode) for inode, remote in sockets.items()))
    (d / "net" / "tcp6").write_text(HEAD + "".join(
        tcp_row("00000000000000000000000001000000:A1B2", remote, "01", inode)
        for inode, remote in tcp6.items()))


def worker_env(rank: int, port: int = PORT) -> dict[str, str]:
    return {"RANK": str(rank), "GROUP_RANK": "1", "MASTER_PORT": str(port), "CLUSTER_RUN_ID": "r"}


STORE = "0A4D000A:733C"            # 10.0.77.10:29500
ELSEWHERE = "0A4D000A:0016"        # the same host, port 22


@pytest.fixture
def proc(tmp_path: Path) -> Path:
    root = tmp_path / "proc"
    process(root, 100, {"CLUSTER_RUN_ID": "r"})                                  # torchrun
    process(root, 101, worker_env(2), {9001: STORE, 9002: ELSEWHERE})            # at the store
    process(root, 102, worker_env(3), {9003: ELSEWHERE})                         # not yet
    process(root, 103, worker_env(4), tcp6={9004: "0000000000000000FFFF00000A4D000A:733C"})
    process(root, 104, {**worker_env(5), "MASTER_PORT": "x"}, {9005: STORE})     # garbled port
    return root


def test_workers_are_the_processes_with_torchruns_ranks_in_rank_order(proc: Path) -> None:
    assert workers.workers_among([104, 100, 102, 101, 999], str(proc)) == [(101, 2), (102, 3), (104, 5)]
    assert workers.group_rank(101, str(proc)) == 1 and workers.group_rank(100, str(proc)) == -1


def test_connected_to_the_store_port_by_the_processs_own_sockets(proc: Path) -> None:
    assert workers.connected_to(101, PORT, str(proc))
    assert not workers.connected_to(102, PORT, str(proc))            # only port 22
    assert workers.connected_to(103, PORT, str(proc))                # over IPv6 (v4-mapped)
    assert not workers.connected_to(101, 29501, str(proc))
    assert not workers.connected_to(999, PORT, str(proc))            # gone: no error


def test_a_row_of_another_processs_socket_does_not_count(proc: Path) -> None:
    """The network table is the whole namespace's: only rows of this process's inodes count."""
    process(proc, 105, worker_env(6), {9006: ELSEWHERE})
    table = proc / "105" / "net" / "tcp"
    table.write_text(table.read_text() + tcp_row("0B4D000A:B000", STORE, "01", 7777))
    assert not workers.connected_to(105, PORT, str(proc))


def test_joined_means_every_worker_of_the_node_is_at_the_store(proc: Path) -> None:
    assert workers.joined([(101, 2)], str(proc))
    assert workers.joined([(101, 2), (103, 4)], str(proc))
    assert not workers.joined([(101, 2), (102, 3)], str(proc))       # one still on its way
    assert not workers.joined([(104, 5)], str(proc))                 # no port to look for
    process(proc, 106, {"RANK": "7", "GROUP_RANK": "1"}, {9007: STORE})
    assert not workers.joined([(106, 7)], str(proc))                 # no MASTER_PORT at all


# --- the supervisor's word on workers, from a real supervisor and plain bash "workers" ---------

# A "worker": a process in a session of its own with torchrun's rank variables, as torchrun
# starts them; the script then waits as torchrun does. It goes on only once the worker's exec
# is done, as a torchrun's workers are long before it could die: until then the process is
# the script's fork, without the rank variables, and a fast supervisor's stop looked at it
# then (no worker counted; seen in CI once the supervisor started its job without subprocess).
WORKER = ("GROUP_RANK=0 RANK=0 setsid sleep 300 &\n"
          "until tr '\\0' '\\n' < /proc/$!/environ 2>/dev/null | grep -q '^GROUP_RANK='; do\n"
          "  sleep 0.01\n"
          "done\n")


def records_of(out: bytes) -> list[dict]:
    from cluster.nodes import Demux
    return [r for r in Demux().feed(out) if isinstance(r, dict)]


def test_a_stopped_node_says_it_had_workers_and_one_before_them_does_not(tmp_path: Path) -> None:
    from tests.unit.test_supervisor import RUN_ID, finish, node_dir, start, tagged_pids, wait_for
    d = node_dir(tmp_path, WORKER + "sleep 300\n")
    p = start(d)
    assert wait_for(lambda: len(tagged_pids(RUN_ID, "n1")) >= 3)
    p.stdin.write(b"stop\n")
    p.stdin.flush()
    assert {"workers": 1} in records_of(finish(p))
    p.stdin.close()
    waiting = tmp_path / "waiting"
    waiting.mkdir()
    (waiting / "launch.sh").write_text("sleep 300\n")          # torchrun still in its rendezvous
    p = start(waiting, node="n2")
    assert wait_for(lambda: len(tagged_pids(RUN_ID, "n2")) >= 2)
    p.stdin.write(b"stop\n")
    p.stdin.flush()
    assert not [r for r in records_of(finish(p)) if "workers" in r]
    p.stdin.close()


def test_workers_left_by_a_torchrun_that_died_are_reported(tmp_path: Path) -> None:
    from tests.unit.test_supervisor import RUN_ID, finish, node_dir, start, tagged_pids
    d = node_dir(tmp_path, WORKER + "exit 9\n")                # torchrun gone, its worker not
    p = start(d)
    out = finish(p)
    assert {"workers": 1} in records_of(out)
    assert not tagged_pids(RUN_ID, "n1")
    p.stdin.close()


def test_step_times_are_read_beside_the_heartbeat_once_each(tmp_path) -> None:
    """The ranks' `<heartbeat>.steps.<RANK>` files go with the next beat, each only when it
    was rewritten; a half-written (.tmp) or malformed file is left out; a line with the
    optional "steps" and "seconds" reads as one without."""
    beat = tmp_path / "heartbeat"
    (tmp_path / "heartbeat.steps.0").write_text(
        '{"rank": 0, "compute": 0.2, "data": 0.01, "steps": 5, "seconds": 1.1}\n')
    (tmp_path / "heartbeat.steps.1").write_text('{"rank": 1, "compute": 0.3, "data": 0.02}\n')
    (tmp_path / "heartbeat.steps.2").write_text("not json\n")
    (tmp_path / "heartbeat.steps.3.tmp").write_text('{"rank": 3, "compute": 1, "data": 1}\n')
    seen: dict = {}
    assert workers.step_times(str(beat), seen) == {"0": [0.2, 0.01], "1": [0.3, 0.02]}
    assert workers.step_times(str(beat), seen) == {}
    os.utime(tmp_path / "heartbeat.steps.1", (1, 1))
    assert workers.step_times(str(beat), seen) == {"1": [0.3, 0.02]}
    assert workers.step_times(str(tmp_path / "gone" / "heartbeat"), {}) == {}


def test_the_saving_seconds_are_the_furthest_any_rank_named_and_junk_says_nothing(tmp_path) -> None:
    """progress_of: "saving" (seconds spent saving checkpoints, which only grow) is the
    largest a rank's line names; a negative, boolean or non-number one is left out."""
    beat = tmp_path / "heartbeat"
    (tmp_path / "heartbeat.steps.0").write_text(
        '{"rank": 0, "compute": 0.2, "data": 0.01, "step": 9, "checkpoint": 8, "saving": 1.25}\n')
    (tmp_path / "heartbeat.steps.1").write_text(
        '{"rank": 1, "compute": 0.2, "data": 0.01, "step": 9, "saving": 0.5}\n')
    assert workers.progress_of(str(beat)) == {"step": 9, "checkpoint": 8, "saving": 1.25}
    for junk in ('-1', 'true', '"2"', '1e12'):
        (tmp_path / "heartbeat.steps.0").write_text(f'{{"rank": 0, "compute": 0.2, "data": 0.1, "saving": {junk}}}\n')
        (tmp_path / "heartbeat.steps.1").unlink(missing_ok=True)
        assert "saving" not in workers.progress_of(str(beat)), junk


def test_a_section_is_read_from_the_heartbeat_file_and_nothing_else_is_one(tmp_path: Path) -> None:
    beat = tmp_path / "heartbeat"
    assert workers.section_of(str(beat)) is None                  # no file yet
    for content, want in [("section checkpoint\n", "checkpoint"), ("section eval", "eval"),
                          ("", None), ("1733150000.25\n", None),  # a program's own timestamp
                          ("section two words\n", None), ("section \n", None),
                          ("section " + "x" * 41, None), ("Section checkpoint", None)]:
        beat.write_text(content)
        assert workers.section_of(str(beat)) == want, content


def test_a_job_beating_faster_than_the_reports_has_its_own_pace_reported(tmp_path: Path) -> None:
    """A job that touches its heartbeat 3 times a second: the node reports a beat at most once
    a second, and each report carries the job's own pace (about 0.33 s), not the 1 s between
    reports (the hang line said '10x the 1.0 s between heartbeats' of such a job)."""
    import threading
    import time
    beat = tmp_path / "heartbeat"
    beat.write_text("")
    records: list = []
    done = threading.Event()
    progress = workers.Progress(lambda: None, str(beat), records.append, done)
    progress.start()
    t0 = time.monotonic()
    while time.monotonic() - t0 < 3.6:
        os.utime(beat)
        time.sleep(1 / 3)
    done.set()
    progress.join(5)
    paces = [r["pace"] for r in records if "pace" in r]
    assert paces and all(0.25 <= p <= 0.45 for p in paces), records


def test_the_pace_is_the_files_changes_between_two_reports() -> None:
    pace = workers.Pace()
    pace.look(10.0)
    assert pace.report(10.0) is None                  # the first report: nothing to compare
    for mtime in (10.25, 10.5, 10.5, 10.75, 11.0):    # one stat saw no change
        pace.look(mtime)
    assert pace.report(11.0) == 0.25
    pace.look(13.0)
    assert pace.report(13.0) == 2.0


# --- the watch on the workers' deaths (real processes, real pidfds) --------------------------

needs_pidfd = pytest.mark.skipif(not workers.Deaths.available(),
                                 reason="pidfds need Linux 5.3+ and Python 3.9+")


class Looks:
    """family.exit_status, counted: how often the watch looked at a process's end."""

    def __init__(self, monkeypatch) -> None:
        self.pids: list[int] = []
        real = workers.family.exit_status

        def look(pid: int):
            self.pids.append(pid)
            return real(pid)
        monkeypatch.setattr(workers.family, "exit_status", look)


def watched(children, quiet=lambda: False):
    """A started Deaths watch on children [(Popen, rank)], and what it reports."""
    import queue
    said: queue.Queue = queue.Queue()
    deaths = workers.Deaths(lambda rank, pid, cause: said.put((rank, pid, cause, time.monotonic())),
                            quiet)
    deaths.start()
    deaths.watch([(c.pid, rank) for c, rank in children])
    return deaths, said


@needs_pidfd
def test_a_killed_worker_is_reported_at_once_by_an_event(monkeypatch) -> None:
    """Three workers: one exits 0 (no failure: the job may be finishing), then one is killed
    by SIGKILL: its rank, pid and signal are reported within milliseconds, and the watch
    looked at a process's end only when one ended (two looks: no timer polls /proc)."""
    import queue
    import subprocess
    looks = Looks(monkeypatch)
    done = subprocess.Popen(["sleep", "0.3"])
    kids = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    try:
        deaths, said = watched([(done, 0), (kids[0], 1), (kids[1], 2)])
        time.sleep(1.0)                     # rank 0 ends (0), the watch sits in poll()
        assert looks.pids == [done.pid] and said.empty()
        t0 = time.monotonic()
        kids[1].kill()
        rank, pid, cause, at = said.get(timeout=5)
        assert (rank, pid, cause) == (2, kids[1].pid, "signal 9")
        assert at - t0 < 0.1, at - t0
        assert looks.pids == [done.pid, kids[1].pid]
        deaths.join(1)
        assert not deaths.is_alive()         # once: the first failure ends the watch
    finally:
        for c in [done] + kids:
            c.kill()
            c.wait()


@needs_pidfd
def test_a_worker_that_exits_non_zero_is_reported_and_none_while_quiet() -> None:
    import subprocess
    fails = subprocess.Popen(["sh", "-c", "sleep 0.2; exit 3"])
    deaths, said = watched([(fails, 5)])
    assert said.get(timeout=5)[:3] == (5, fails.pid, "exit code 3")
    fails.wait()
    quiet = subprocess.Popen(["sh", "-c", "sleep 0.2; exit 3"])      # a stop has begun
    deaths, said = watched([(quiet, 5)], quiet=lambda: True)
    quiet.wait()
    deaths.join(2)
    assert said.empty()
    deaths.close()
    deaths.join(2)
    assert not deaths.is_alive()


def _done_watch(children, job):
    """A started Deaths watch with done(): what it is told, and when."""
    import queue
    told: queue.Queue = queue.Queue()
    deaths = workers.Deaths(lambda *a: told.put(("died", a)), lambda: False,
                            done=lambda ranks: told.put(("done", ranks, time.monotonic())),
                            job=job)
    deaths.start()
    deaths.watch([(c.pid, rank) for c, rank in children])
    return deaths, told


def _workers(seconds: list[float], size: int, codes: list[int] | None = None):
    import subprocess
    codes = codes or [0] * len(seconds)
    env = dict(os.environ, LOCAL_WORLD_SIZE=str(size))
    return [subprocess.Popen(["sh", "-c", f"sleep {s}; exit {c}"], env=env)
            for s, c in zip(seconds, codes)]


@needs_pidfd
def test_done_is_told_once_every_worker_of_the_node_exited_0_and_not_before() -> None:
    """Three workers of this process (the job's own), LOCAL_WORLD_SIZE 3: two end, nothing is
    said; the third ends and done names all three ranks at once, by its event."""
    kids = _workers([0.2, 0.2, 1.0], 3)
    try:
        deaths, told = _done_watch([(k, r) for r, k in enumerate(kids)], job=os.getpid())
        time.sleep(0.6)              # two ended (zombies: this process collects them last)
        assert told.empty()
        while workers.family.exit_status(kids[2].pid) is None:     # the last one ends
            time.sleep(0.005)
        ended = time.monotonic()
        kind, ranks, at = told.get(timeout=5)
        assert (kind, ranks) == ("done", [0, 1, 2])
        assert at - ended < 0.5                 # by its event, not a later look
        time.sleep(0.2)
        assert told.empty()                   # once
        deaths.close()
    finally:
        for k in kids:
            k.kill()
            k.wait()


@needs_pidfd
def test_the_jobs_own_workers_are_found_by_the_watch_itself_even_when_short_lived() -> None:
    """Nobody tells the watch of these workers (a job of a fraction of a second ends between
    two of the run's scans): it looks at the job's own children until it holds them all, so
    done is still told, by their exits."""
    import queue
    import subprocess
    told: queue.Queue = queue.Queue()
    deaths = workers.Deaths(lambda *a: told.put(("died", a)), lambda: False,
                            done=lambda ranks: told.put(("done", ranks)), job=os.getpid())
    deaths.start()
    kids = [subprocess.Popen(["sh", "-c", "sleep 0.3"], env=dict(
        os.environ, GROUP_RANK="0", RANK=str(r), LOCAL_WORLD_SIZE="2")) for r in (4, 5)]
    try:
        assert told.get(timeout=5) == ("done", [4, 5])
        assert not deaths._looking()           # all held: no more looks, events only
        deaths.close()
        deaths.join(2)
        assert not deaths.is_alive()
    finally:
        for k in kids:
            k.kill()
            k.wait()


@needs_pidfd
@pytest.mark.parametrize("case", ["one failed", "one not seen", "not the job's own"])
def test_no_done_unless_every_worker_exited_0_and_was_the_jobs_own(case: str) -> None:
    """A worker exited 1 (the failure is reported instead); LOCAL_WORLD_SIZE 3 but two seen
    (a worker never watched says nothing); the workers' parent is not the job's process (a
    launch.sh that runs torchrun without exec may do more after it): no done."""
    kids = _workers([0.2, 0.3], 3 if case == "one not seen" else 2,
                    [0, 1] if case == "one failed" else [0, 0])
    try:
        deaths, told = _done_watch([(k, r) for r, k in enumerate(kids)],
                                   job=os.getppid() if case == "not the job's own" else os.getpid())
        time.sleep(1.0)              # both ended (zombies: collected last)
        said = [told.get_nowait() for _ in range(told.qsize())]
        assert [s[0] for s in said] == (["died"] if case == "one failed" else []), said
        deaths.close()
    finally:
        for k in kids:
            k.kill()
            k.wait()


# A torchrun stand-in: its worker (ranks in its environment, a session of its own) is collected
# only when it looks, as torchrun's monitor does (every 0.1 s by default; here never).
AGENT = ("exec python3 -c 'import os, subprocess, time\n"
         "env = dict(os.environ, GROUP_RANK=\"0\", RANK=\"3\", LOCAL_RANK=\"0\")\n"
         "subprocess.Popen([\"sleep\", \"300\"], env=env, start_new_session=True)\n"
         "time.sleep(300)'\n")


@needs_pidfd
@pytest.mark.parametrize("own_restarts", [False, True])
def test_the_supervisor_reports_a_dead_worker_at_once(tmp_path: Path, own_restarts: bool) -> None:
    """kill -9 of a worker: its supervisor says which rank died and how, at once (torchrun
    has not looked yet), and the launcher's stop follows as for any stop. Unless torchrun
    restarts its own workers (torchrun_args --max-restarts N: --own-restarts): then the death
    is torchrun's to handle, and nothing is said."""
    import signal
    from tests.unit.test_supervisor import RUN_ID, finish, node_dir, start, tagged_pids, wait_for
    d = node_dir(tmp_path, AGENT)
    p = start(d, flags=("--own-restarts",) if own_restarts else ())
    try:
        def rank3() -> list[int]:
            return [pid for pid, rank in workers.workers_among(tagged_pids(RUN_ID, "n1"))
                    if rank == 3]
        assert wait_for(rank3)
        worker = rank3()[0]
        time.sleep(2.5)                 # the supervisor's look for workers has found it
        os.kill(worker, signal.SIGKILL)
        time.sleep(0.5)                 # (a death once the stop has begun is not reported)
        p.stdin.write(b"stop\n")        # as the launcher answers the report
        p.stdin.flush()
        died = [r for r in records_of(finish(p)) if "died" in r]
        assert died == ([] if own_restarts else
                        [{"died": f"rank 3 (pid {worker}) died: signal 9", "rank": 3, "pid": worker}]), died
    finally:
        p.stdin.close()


# torchrun's stand-in at its end: two workers (its children, sessions of their own, the size in
# their environment) print and exit 0 after a second; it stays, as torchrun does in its exit
# barrier, and never collects them.
FINISHING_AGENT = (
    "exec python3 -c 'import os, subprocess, time\n"
    "for r in (0, 1):\n"
    "    env = dict(os.environ, GROUP_RANK=\"0\", RANK=str(r), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=\"2\")\n"
    "    subprocess.Popen([\"sh\", \"-c\", \"sleep 1; echo rank $RANK done\"], env=env, start_new_session=True)\n"
    "time.sleep(300)'\n")


def _until_record(p, key: str, timeout: float = 15.0) -> tuple[bytes, dict]:
    """Read the supervisor's stream until a record with `key`: what came so far, the record."""
    import select
    got = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if select.select([p.stdout], [], [], 0.1)[0]:
            chunk = os.read(p.stdout.fileno(), 65536)
            if not chunk:
                break
            got += chunk
            found = [r for r in records_of(got) if key in r]
            if found:
                return got, found[0]
    raise AssertionError(f"no {key!r} record: {got!r}")


@needs_pidfd
def test_a_node_says_its_workers_are_done_and_finish_ends_its_torchrun_with_code_0(tmp_path: Path) -> None:
    """Both workers exit 0 while their torchrun stays: the supervisor says done (after their
    output), and the launcher's word `finish` ends torchrun: the node exits 0 at once, not
    after torchrun's 300 s, and nothing of the run is left."""
    from tests.unit.test_supervisor import RUN_ID, finish, node_dir, start, tagged_pids
    p = start(node_dir(tmp_path, FINISHING_AGENT))
    try:
        said, done = _until_record(p, "done")
        assert done == {"done": [0, 1]}
        assert b"rank 0 done" in said and b"rank 1 done" in said
        p.stdin.write(b"finish\n")
        p.stdin.flush()
        rest = finish(p)                              # within its 30 s, not torchrun's 300
        assert p.returncode == 0, said + rest
        final = [r["final"] for r in records_of(said + rest) if "final" in r]
        assert final and final[0]["left"] == [] and final[0]["how"] is None, final
        assert tagged_pids(RUN_ID, "n1") == []
    finally:
        p.stdin.close()


# As FINISHING_AGENT, but its workers come 0.7 s in and live 0.3 s: between the run's scans
# for workers (0.25 s, 0.625 s, 1.2 s after the start), as a job of a second's would.
BRIEF_AGENT = FINISHING_AGENT.replace("import os, subprocess, time\n",
                                      "import os, subprocess, time\ntime.sleep(0.7)\n", 1) \
                             .replace("sleep 1;", "sleep 0.3;")


@needs_pidfd
def test_a_node_whose_workers_live_a_moment_says_done_all_the_same(tmp_path: Path) -> None:
    from tests.unit.test_supervisor import finish, node_dir, start
    assert BRIEF_AGENT != FINISHING_AGENT and "sleep 0.3;" in BRIEF_AGENT
    p = start(node_dir(tmp_path, BRIEF_AGENT))
    try:
        said, done = _until_record(p, "done")
        assert done == {"done": [0, 1]}, said
        p.stdin.write(b"finish\n")
        p.stdin.flush()
        rest = finish(p)
        assert p.returncode == 0, said + rest
    finally:
        p.stdin.close()


@needs_pidfd
def test_finish_before_the_nodes_workers_are_done_is_passed_over(tmp_path: Path) -> None:
    """The word comes while the workers still run (it is meant for a node whose workers are
    all done): nothing changes; the workers finish, done is said, and only the word after it
    ends torchrun."""
    from tests.unit.test_supervisor import finish, node_dir, start
    p = start(node_dir(tmp_path, FINISHING_AGENT))
    try:
        p.stdin.write(b"finish\n")
        p.stdin.flush()
        said, done = _until_record(p, "done")
        assert b"rank 0 done" in said and b"rank 1 done" in said and p.poll() is None
        p.stdin.write(b"finish\n")
        p.stdin.flush()
        finish(p)
        assert p.returncode == 0
    finally:
        p.stdin.close()


# The stand-in again, slow to end on TERM as torchrun is (its traceback, its garbage collection).
SLOW_AGENT = AGENT.replace("exec python3 -c 'import os, subprocess, time\n",
                           "exec python3 -c 'import os, signal, subprocess, time\n"
                           "signal.signal(signal.SIGTERM, lambda *_: time.sleep(30))\n")


@needs_pidfd
def test_a_stop_after_a_workers_death_gives_torchrun_only_its_short_grace(tmp_path: Path) -> None:
    """Its worker dead, torchrun is alone at the stop's first look: still a torchrun after its
    workers (the watch saw them), so a moment and KILL, not the stop's whole grace (5 s); and
    the stop reads as ended on TERM, as any such stop."""
    import signal
    from tests.unit.test_supervisor import RUN_ID, finish, node_dir, start, tagged_pids, wait_for
    d = node_dir(tmp_path, SLOW_AGENT)
    p = start(d, grace=5)
    try:
        def rank3() -> list[int]:
            return [pid for pid, rank in workers.workers_among(tagged_pids(RUN_ID, "n1"))
                    if rank == 3]
        assert wait_for(rank3)
        time.sleep(2.5)                 # the supervisor's look for workers has found it
        os.kill(rank3()[0], signal.SIGKILL)
        time.sleep(0.5)
        t0 = time.monotonic()
        p.stdin.write(b"stop\n")
        p.stdin.flush()
        final = [r["final"] for r in records_of(finish(p)) if "final" in r]
        took = time.monotonic() - t0
        assert final and final[0]["how"] == "term" and final[0]["left"] == [], final
        assert took < 2.0, took
    finally:
        p.stdin.close()


@pytest.mark.parametrize("args, restarts", [
    ((), False), (("--max-restarts", "0"), False), (("--max-restarts", "2"), True),
    (("--max_restarts=3",), True), (("--max-restarts=0", "--monitor-interval", "1"), False),
    (("--max-restarts", "2", "--max-restarts", "0"), False), (("--max-restarts",), False),
])
def test_torchrun_args_that_restart_workers_are_recognised(args, restarts) -> None:
    from cluster.torchrun_options import restarts_its_workers
    assert restarts_its_workers(args) is restarts


def test_the_step_and_checkpoint_the_ranks_name_are_the_furthest_and_read_after_the_end(
        tmp_path) -> None:
    """Each rank's "step" and "checkpoint" (optional): the furthest of them, from the lines
    read with the beats and, after the workers ended, from every line once more; a value
    that is not a whole number >= 0 is left out, and a line of counts alone has no times."""
    beat = tmp_path / "heartbeat"
    (tmp_path / "heartbeat.steps.0").write_text(
        '{"rank": 0, "compute": 0.2, "data": 0.01, "step": 30, "checkpoint": 20}\n')
    (tmp_path / "heartbeat.steps.1").write_text('{"rank": 1, "step": 31}\n')
    (tmp_path / "heartbeat.steps.2").write_text('{"rank": 2, "step": true, "checkpoint": -1}\n')
    (tmp_path / "heartbeat.steps.3").write_text('[1, 2]\n')
    at: dict = {}
    assert workers.step_times(str(beat), {}, at) == {"0": [0.2, 0.01]}
    assert at == {"step": 31, "checkpoint": 20}
    assert workers.progress_of(str(beat)) == {"step": 31, "checkpoint": 20}
    assert workers.progress_of(str(tmp_path / "gone" / "heartbeat")) == {}
