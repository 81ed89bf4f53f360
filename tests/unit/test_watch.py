"""The watcher, with fake nodes: first failure stops the others at once, every node reports."""
from __future__ import annotations

import io
import threading
import time
from pathlib import Path

from cluster.backends import NodeExit
from cluster.observe.watch import TORCHRUN_FAILED, Console, LineSplitter, Watcher, WorkerErrors


class FakeNode:
    def __init__(self, label: str, lines: list[bytes], exit: NodeExit | None, delay: float = 0.0):
        self.node = type("N", (), {"label": label})()
        self.lines, self.exit, self.delay = lines, exit, delay
        self.stopped = threading.Event()
        self.stop_calls = 0

    def output(self):
        for line in self.lines:
            yield line
        if self.exit is None:           # runs until stopped
            self.stopped.wait(30)
        else:
            time.sleep(self.delay)

    def wait(self) -> NodeExit:
        self.ended_at = time.monotonic()
        return self.exit or NodeExit(code=143, signal=15)

    def stop(self) -> dict:
        self.stop_calls += 1
        self.stopped_at = time.monotonic()
        self.stopped.set()
        return {"signalled": [1], "killed": [], "left": []}


def console() -> tuple[Console, io.StringIO, io.StringIO]:
    out, err = io.StringIO(), io.StringIO()
    return Console(out, err, color=False), out, err


def test_all_succeed(tmp_path: Path) -> None:
    c, out, _ = console()
    nodes = [FakeNode("a 0", [b"hello\n"], NodeExit(code=0)), FakeNode("b 1", [b"hi\n"], NodeExit(code=0))]
    res = Watcher(nodes, c, {"a 0": tmp_path / "a.log"}).run()
    assert res.ok and set(res.exits) == {"a 0", "b 1"}
    assert "[a 0] hello\n" in out.getvalue() and "[b 1] hi\n" in out.getvalue()
    assert (tmp_path / "a.log").read_bytes() == b"hello\n"
    assert all(n.stop_calls == 0 for n in nodes)


def test_first_failure_stops_the_others_at_once(tmp_path: Path) -> None:
    c, _, err = console()
    lines = [f"line {i}\n".encode() for i in range(30)]
    failing = FakeNode("b 1", lines, NodeExit(code=7), delay=0.1)
    others = [FakeNode("a 0", [], None), FakeNode("c 2", [], None)]
    t0 = time.monotonic()
    res = Watcher([others[0], failing, others[1]], c, {}).run()
    assert time.monotonic() - t0 < 5
    assert res.first_failure == ("b 1", NodeExit(code=7))
    assert all(n.stop_calls == 1 for n in others) and failing.stop_calls == 0
    text = err.getvalue()
    assert "node [b 1] failed first: exit code 7" in text
    tail = res.tails["b 1"]                  # the last 20 lines, for the final error's evidence
    assert tail[-1] == "line 29" and tail[0] == "line 10" and "line 9" not in tail
    assert set(res.exits) == {"a 0", "b 1", "c 2"}


CHILD_FAILED = [b"[rank1]: RuntimeError: boom\n", b"Traceback (most recent call last):\n",
                b"torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n",
                b"============================================================\n"]


def test_torchruns_own_failure_line_stops_the_others_before_its_exit() -> None:
    """torchrun's interpreter takes half a second to end after it reports a failed worker:
    the other nodes are stopped from the line, and the failure is still this node's exit."""
    c, _, err = console()
    failing = FakeNode("b 1", CHILD_FAILED, NodeExit(code=1), delay=1.0)
    others = [FakeNode("a 0", [], None), FakeNode("c 2", [], None)]
    res = Watcher([others[0], failing, others[1]], c, {}).run()
    assert all(n.stop_calls == 1 for n in others) and failing.stop_calls == 0
    assert all(n.stopped_at < failing.ended_at - 0.5 for n in others)
    assert res.first_failure == ("b 1", NodeExit(code=1))
    assert set(res.exits) == {"a 0", "b 1", "c 2"} and not res.ok
    assert "node [b 1] failed first: its torchrun reported a failed worker" in err.getvalue()


def test_a_workers_death_reported_by_its_node_stops_every_node_that_one_too() -> None:
    """Its supervisor saw a worker die (a record): that node failed first, named by the dead
    rank and how, and every node is stopped at once, that one included (its torchrun has yet
    to notice); torchrun's own report of the death, if the stop lets it come, does not lead.
    A line a node's supervisor says about itself is shown under the node's name."""
    c, _, err = console()
    died = {"died": "rank 1 (pid 4242) died: signal 9", "rank": 1, "pid": 4242}
    said = {"said": "the node's log could not be written: No space left on device, "
                    "output still streamed"}
    report = [b"Root Cause (first observed failure):\n", b"  rank      : 1 (local_rank: 0)\n",
              b"  exitcode  : -9 (pid: 4242)\n"]
    stopped = [b"Traceback (most recent call last):\n", b'  File "run.py", line 9\n',
               b"SignalException: Process 77 got signal: 15\n"]      # torchrun, stopped
    failing = FakeNode("b 1", [said, died, CHILD_FAILED[2]] + report + stopped, None)
    others = [FakeNode("a 0", [], None), FakeNode("c 2", [], None)]
    res = Watcher([others[0], failing, others[1]], c, {}, settle=5).run()
    assert all(n.stop_calls == 1 for n in others + [failing])
    assert res.first_failure == ("b 1", NodeExit(detail="rank 1 (pid 4242) died: signal 9"))
    assert not res.ok and "b 1" in res.had_workers and "b 1" not in res.causes
    text = err.getvalue()
    assert "node [b 1] failed first: rank 1 (pid 4242) died: signal 9\n" in text, text
    assert "[b 1] the node's log could not be written: No space left on device, output " \
           "still streamed\n" in text, text


def test_a_dead_workers_own_error_printed_before_its_death_leads() -> None:
    c, _, err = console()
    died = {"died": "rank 1 (pid 4242) died: exit code 1", "rank": 1, "pid": 4242}
    lines = [b"[rank1]: Traceback (most recent call last):\n", b'[rank1]:   File "t.py"\n',
             b"[rank1]: RuntimeError: the loss is NaN\n", died]
    failing = FakeNode("b 1", lines, None)
    res = Watcher([FakeNode("a 0", [], None), failing], c, {}, settle=5).run()
    assert res.causes["b 1"] == "RuntimeError: the loss is NaN"
    assert "node [b 1] failed first: rank 1 (pid 4242) died: exit code 1: RuntimeError: the " \
           "loss is NaN\n" in err.getvalue(), err.getvalue()


def test_a_node_that_reports_failure_but_never_ends_is_stopped_after_settle() -> None:
    c, _, _ = console()
    stuck = FakeNode("b 1", CHILD_FAILED, None)           # runs on until stopped
    other = FakeNode("a 0", [], None)
    res = Watcher([other, stuck], c, {}, settle=0.5).run()
    assert other.stop_calls == 1 and stuck.stop_calls == 1
    assert res.first_failure[0] == "b 1" and not res.ok


def test_the_line_on_a_single_node_waits_for_its_exit() -> None:
    c, _, _ = console()
    only = FakeNode("a 0", CHILD_FAILED, NodeExit(code=1), delay=0.2)
    res = Watcher([only], c, {}).run()
    assert only.stop_calls == 0 and res.first_failure == ("a 0", NodeExit(code=1))


def test_lost_connection_is_a_failure() -> None:
    c, _, err = console()
    lost = FakeNode("a 0", [], NodeExit(lost=True, reason="socket closed"))
    other = FakeNode("b 1", [], None)
    res = Watcher([lost, other], c, {}).run()
    assert res.first_failure[1].lost and other.stop_calls == 1
    assert "connection lost: socket closed" in err.getvalue()


def test_line_splitter_handles_partial_lines_and_carriage_returns() -> None:
    clock = iter([0.0, 0.2, 1.5, 1.6]).__next__
    sp = LineSplitter(clock=clock)
    assert sp.feed(b"hel") == []
    assert sp.feed(b"lo\nwor") == ["hello"]
    assert sp.feed(b"ld\r\n") == ["world"]
    assert sp.feed(b"\r 10%") == [" 10%"]          # first progress state shows
    assert sp.feed(b"\r 20%") == []                # within a second: not repeated
    assert sp.feed(b"\r 90%") == [" 90%"]
    assert sp.feed(b"\r100%\n") == ["100%"]
    assert sp.feed(b"tail") == [] and sp.flush() == ["tail"]


def test_console_colours_only_when_asked() -> None:
    out = io.StringIO()
    Console(out, io.StringIO(), color=True).node_line("a 0", 0, "x")
    assert out.getvalue().startswith("\x1b[")
    out = io.StringIO()
    Console(out, io.StringIO(), color=False).node_line("a 0", 0, "x")
    assert out.getvalue() == "[a 0] x\n"


# --- the worker's own error leads the failure report --------------------------------------------

FAILURES = Path(__file__).parent / "torchrun_failures"     # real torchrun 2.13 output, captured


def run_failure(captured: str, tmp_path: Path) -> tuple[str, str]:
    """A node that prints a captured failing torchrun's output and exits 1, beside a healthy
    one, through the whole launch outcome: (the failure said at once, the final error)."""
    from cluster.errors import RunFailed
    from cluster.launch import _outcome
    c, _, err = console()
    lines = [ln + b"\n" for ln in (FAILURES / captured).read_bytes().splitlines()]
    res = Watcher([FakeNode("a 0", [], None), FakeNode("b 1", lines, NodeExit(code=1))],
                  c, {}).run()
    plan = type("P", (), {"run_id": "r", "logs_hint": "runs/r/logs/", "node_count": 2})()
    try:
        _outcome(res, plan, c)
    except RunFailed as exc:
        return err.getvalue(), str(exc)
    raise AssertionError("the failure was not raised")


def test_the_final_error_leads_with_the_workers_own_error_not_torchruns_banner(tmp_path: Path) -> None:
    said, final = run_failure("runtime_error.log", tmp_path)
    lead = final.splitlines()[0]
    assert lead.startswith("node [b 1] failed: RuntimeError: boom: the loss is NaN at step 3 "
                           "(exit code 1)"), final
    assert "failed first: its torchrun reported a failed worker: RuntimeError: boom" in said
    # the evidence under it is the worker's own traceback, not torchrun's closing banner
    assert "rank 1's traceback ([b 1]):\n  | Traceback (most recent call last):" in final, final
    assert "ChildFailedError" not in final and "To enable traceback" not in final, final


def test_the_evidence_is_the_raising_ranks_traceback_then_its_peers_errors(tmp_path: Path) -> None:
    """Two nodes of one run (`cluster up --local --nodes 2`, rank 1 raised, rank 0 then lost
    its peer in gloo; each node's real log): the final error shows rank 1's frames and error,
    then rank 0's gloo error after it, as what came of it, whichever node's lines came first."""
    from cluster.errors import RunFailed
    from cluster.launch import _outcome
    c, _, _ = console()
    peer, raised = (
        [ln + b"\n" for ln in (FAILURES / name).read_bytes().splitlines()]
        for name in ("two_nodes_peer.log", "two_nodes_raised.log"))
    res = Watcher([FakeNode("local0 0", peer, None),
                   FakeNode("local1 1", raised, NodeExit(code=1), delay=0.2)], c, {}).run()
    plan = type("P", (), {"run_id": "r", "logs_hint": "runs/r/logs/", "node_count": 2})()
    try:
        _outcome(res, plan, c)
        raise AssertionError("the failure was not raised")
    except RunFailed as exc:
        details = exc.details
    assert details.splitlines()[:7] == [
        "rank 1's traceback ([local1 1]):",
        "  | Traceback (most recent call last):",
        '  |   File "/tmp/sumrep/boom.py", line 8, in <module>',
        "  |     deeper()",
        '  |   File "/tmp/sumrep/boom.py", line 5, in deeper',
        '  |     raise RuntimeError("boom: the loss is NaN at step 3")',
        "  | RuntimeError: boom: the loss is NaN at step 3"], details
    assert details.splitlines()[7:9] == [
        "then 1 other rank(s) failed, most likely because it did:",
        "  | [local0 0] rank 0: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/"
        "transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:23203. This is "
        "typically caused by a remote worker crashing. Check the logs of the remote worker "
        "before reporting an error. GLHF! \U0001f3d6\ufe0f"], details
    assert "ChildFailedError" not in details and "SignalException" not in details


def test_a_peer_rank_on_the_same_node_comes_after_the_root_cause(tmp_path: Path) -> None:
    _, final = run_failure("two_ranks.log", tmp_path)
    details = final.split("\n", 1)[1]
    assert details.index("RuntimeError: boom") < details.index("Connection closed by peer")
    assert "  | [b 1] rank 0: RuntimeError: [/__w/pytorch" in details, details


def test_the_other_ranks_errors_are_shown_up_to_a_few() -> None:
    """At scale every other rank says its peer is gone: a few are shown, then how many more."""
    from cluster.launch import OTHER_ERRORS, _evidence
    from cluster.observe.watch import WatchResult
    result = WatchResult(tracebacks={"b 1": (1, ["RuntimeError: boom"])},
                         then=[f"[n{i} {i}] rank {i}: RuntimeError: Connection closed by peer"
                               for i in range(100)])
    lines = _evidence(result, "b 1").splitlines()
    assert lines[2] == "then 100 other rank(s) failed, most likely because it did:"
    assert len(lines) == 3 + OTHER_ERRORS + 1
    assert lines[-1] == f"  | ... and {100 - OTHER_ERRORS} more (each node's log has its own)"


def test_a_worker_without_a_traceback_keeps_the_last_lines(tmp_path: Path) -> None:
    _, final = run_failure("worker_exit_code.log", tmp_path)
    assert "\nlast 20 line(s):\n" in final and "exitcode  : 7" in final, final


def test_the_root_cause_rank_is_named_not_the_peer_that_lost_it(tmp_path: Path) -> None:
    """Two ranks on the node: rank 1 raised, rank 0 then lost its peer; torchrun's report
    names rank 1 as the root cause, and rank 1's own error leads."""
    _, final = run_failure("two_ranks.log", tmp_path)
    assert final.splitlines()[0].startswith(
        "node [b 1] failed: RuntimeError: boom: the loss is NaN at step 3"), final


def test_python_that_cannot_start_the_script_or_import_is_the_lead(tmp_path: Path) -> None:
    _, final = run_failure("missing_script.log", tmp_path)
    assert "failed: /opt/cluster-venv/bin/python: can't open file '/tmp/fail6/missing.py': " \
           "[Errno 2] No such file or directory (exit code 1)" in final.splitlines()[0], final
    _, final = run_failure("import_error.log", tmp_path)
    assert final.splitlines()[0].startswith(
        "node [b 1] failed: ModuleNotFoundError: No module named 'not_a_module_anywhere'"), final


def test_a_worker_that_exits_without_a_word_is_named_with_its_code(tmp_path: Path) -> None:
    """A rank that calls os._exit(7) right after init_process_group prints no traceback:
    torchrun's root-cause report (rank 1, exitcode 7) is then the worker's own word, not
    torchrun's exit code 1 alone (tried on three SSH nodes: 'failed: exit code 1')."""
    _, final = run_failure("worker_exit_code.log", tmp_path)
    # Only the final error: the note said at once comes from torchrun's banner, before the
    # root-cause report that names the code has been read.
    assert final.splitlines()[0].startswith(
        "node [b 1] failed: worker rank 1 exited with code 7 (exit code 1)"), final


def test_a_worker_killed_by_a_signal_is_named_with_the_signal() -> None:
    errors = WorkerErrors()
    for line in ["Root Cause (first observed failure):", "[0]:", "  rank      : 3 (local_rank: 1)",
                 "  exitcode  : -9 (pid: 123)",
                 "  traceback : Signal 9 (SIGKILL) received by PID 123"]:
        errors.feed(line)
    assert errors.cause() is None                # torchrun's banner was not seen: not a report
    errors = WorkerErrors()
    errors.feed(TORCHRUN_FAILED)
    for line in ["Root Cause (first observed failure):", "[0]:", "  rank      : 3 (local_rank: 1)",
                 "  exitcode  : -9 (pid: 123)"]:
        errors.feed(line)
    assert errors.cause() == "worker rank 3 was killed by SIGKILL"


def test_the_word_said_at_once_does_not_depend_on_how_much_of_torchruns_report_came() -> None:
    """The first word is said on torchrun's banner; its root-cause report comes after, maybe
    already read, maybe not. printed_only (what the first word uses) gives the same answer
    either way: the workers' own printed error, or nothing; the final error has the report."""
    silent, chatty = WorkerErrors(), WorkerErrors()
    for line in ["[rank3]: Traceback (most recent call last):", '[rank3]:   File "t.py", line 1',
                 "[rank3]: RuntimeError: boom"]:
        chatty.feed(line)
    for errors in (silent, chatty):
        errors.feed(TORCHRUN_FAILED)
        banner_only = errors.cause(printed_only=True)
        for line in ["Root Cause (first observed failure):", "[0]:",
                     "  rank      : 3 (local_rank: 1)", "  exitcode  : -9 (pid: 123)"]:
            errors.feed(line)
        assert errors.cause(printed_only=True) == banner_only
    assert silent.cause(printed_only=True) is None
    assert silent.cause() == "worker rank 3 was killed by SIGKILL"
    assert chatty.cause(printed_only=True) == chatty.cause() == "RuntimeError: boom"


def test_no_worker_error_leaves_the_exit_alone(tmp_path: Path) -> None:
    c, _, _ = console()
    res = Watcher([FakeNode("b 1", [b"Traceback (most recent call last):\n",
                                    b"  File \"x\", line 1\n"], NodeExit(code=3))], c, {}).run()
    assert res.causes == {}


class ClosedPipe(io.StringIO):
    """A console stream whose reader went away (`cluster up 2>&1 | head -3`)."""

    def __init__(self, lines_before_close: int) -> None:
        super().__init__()
        self.left = lines_before_close

    def write(self, text: str) -> int:
        if self.left <= 0:
            raise BrokenPipeError(32, "Broken pipe")
        self.left -= 1
        return super().write(text)


def test_a_closed_console_stops_the_display_not_the_watch(tmp_path: Path) -> None:
    """Output and notes piped into `head`: once the pipe is closed, lines are no longer shown,
    but every node is still watched to its end and every line still reaches its log file (the
    launcher used to wait forever, its pumps dead on the broken pipe, after the nodes ended)."""
    pipe = ClosedPipe(lines_before_close=3)
    c = Console(pipe, pipe, color=False)
    lines = [f"line {i}\n".encode() for i in range(10)]
    nodes = [FakeNode("a 0", lines, NodeExit(code=0)), FakeNode("b 1", lines, NodeExit(code=0))]
    logs = {"a 0": tmp_path / "a.log", "b 1": tmp_path / "b.log"}
    done: list = []
    t = threading.Thread(target=lambda: done.append(Watcher(nodes, c, logs).run()), daemon=True)
    t.start()
    t.join(timeout=10)
    assert done, "the watch did not end after every node had ended"
    assert done[0].ok and set(done[0].exits) == {"a 0", "b 1"}
    assert all(p.read_bytes() == b"".join(lines) for p in logs.values())
    c.info("after the pipe closed")            # a note is dropped too, never raised


class PipeNode:
    """A node whose output one thread can select on among many (backends.Selectable), as
    local and SSH nodes are: a pipe, written by the test."""

    def __init__(self, label: str) -> None:
        self.node = type("N", (), {"label": label})()
        self.r, self.w = __import__("os").pipe()
        self.asked = self.stop_calls = 0
        self.threads_seen = 0

    def fileno(self) -> int:
        return self.r

    def read_ready(self):
        data = __import__("os").read(self.r, 65536)
        return [data] if data else None

    def output(self):
        raise AssertionError("a selectable node is read by the selector thread")

    def wait(self) -> NodeExit:
        self.threads_seen = threading.active_count()
        return NodeExit(code=143 if self.asked else 0, signal=15 if self.asked else None)

    def request_stop(self) -> None:
        self.asked += 1
        __import__("os").close(self.w)

    def stop(self) -> dict:
        self.stop_calls += 1
        return {"signalled": [1], "killed": [], "left": []}


def test_one_thread_reads_every_node_and_a_stop_asks_every_node_first(tmp_path: Path) -> None:
    """200 nodes: their output is read by one thread (the launcher's threads do not grow with
    the node count); the first failure asks every other node to stop before waiting for any."""
    import os
    c, out, _ = console()
    nodes = [PipeNode(f"n{i} {i}") for i in range(200)]
    before = threading.active_count()
    for n in nodes[1:]:
        os.write(n.w, f"hello from {n.node.label}\n".encode())
    failing = nodes[0]

    def fail_later() -> None:
        time.sleep(0.3)
        os.write(failing.w, b"boom\n")
        os.close(failing.w)
    threading.Thread(target=fail_later, daemon=True).start()
    failing.wait = lambda: NodeExit(code=3)              # type: ignore[method-assign]
    res = Watcher(nodes, c, {}, settle=5).run()
    assert res.first_failure is not None and res.first_failure[0] == "n0 0"
    assert all(n.asked == 1 and n.stop_calls == 1 for n in nodes[1:])
    assert all(f"[{n.node.label}] hello from {n.node.label}" in out.getvalue() for n in nodes[1:])
    # the reader, the few exit waiters, the stop's waiters: a constant, not a thread per node
    assert max(n.threads_seen for n in nodes[1:]) - before <= 1 + 8 + 32


def test_the_other_ranks_errors_are_in_the_order_they_arrived_across_nodes(tmp_path: Path) -> None:
    c, _, _ = console()
    order: list = []

    def erring(label: str, rank: int, after: threading.Event | None, then: threading.Event):
        lines = [f"[rank{rank}]: Traceback (most recent call last):\n".encode(),
                 f"[rank{rank}]: RuntimeError: peer of rank {rank} gone\n".encode()]

        class Node(FakeNode):
            def output(self):
                if after is not None:
                    after.wait(5)
                yield from lines
                order.append(rank)
                then.set()
                self.stopped.wait(30)
        return Node(label, lines, None)
    first, second = threading.Event(), threading.Event()
    late, early = erring("a 0", 0, first, second), erring("c 2", 2, None, first)
    failing = FakeNode("b 1", [b"[rank1]: Traceback (most recent call last):\n",
                               b"[rank1]: RuntimeError: boom\n"], NodeExit(code=1), delay=0.3)
    res = Watcher([late, failing, early], c, {}).run()
    assert res.then == ["[c 2] rank 2: RuntimeError: peer of rank 2 gone",
                        "[a 0] rank 0: RuntimeError: peer of rank 0 gone"], (res.then, order)


def test_a_beats_detail_is_the_furthest_step_and_the_slowest_ranks_times() -> None:
    from cluster.observe.watch import beat_detail
    assert beat_detail({"beat": 1.0, "at": {"step": 12, "checkpoint": 10},
                        "steps": {"0": [0.2, 0.01], "1": [0.31, 0.005]}}) == \
        {"step": 12, "work": 0.31, "data": 0.01}
    assert beat_detail({"beat": 1.0}) == {}
    assert beat_detail({"beat": 1.0, "steps": {"0": ["x", 1]}, "at": {"step": "9"}}) == {}
    assert beat_detail({"beat": 1.0, "steps": {"0": [float("nan"), 0.1]}}) == {}


class FinishingNode(FakeNode):
    """A node whose supervisor says `done` (every worker exited 0), then lingers as torchrun
    does in its exit barrier until told `finish` (backends.Finishes)."""

    def __init__(self, label: str, done_after: float | None, linger: float = 20.0) -> None:
        super().__init__(label, [], NodeExit(code=0))
        self.done_after, self.linger = done_after, linger
        self.finished = threading.Event()
        self.finish_calls = 0

    def output(self):
        if self.done_after is not None:
            time.sleep(self.done_after)
            yield {"done": [0]}
        self.finished.wait(self.linger)

    def request_finish(self) -> None:
        self.finish_calls += 1
        self.finished.set()


def test_every_node_done_the_launcher_finishes_them_all_at_once_and_only_then() -> None:
    """Two nodes say done, a moment apart: only after the second is every node told to
    finish, once each; they end at once (not after their 20 s), and the run is a success."""
    c, _, _ = console()
    nodes = [FinishingNode("a 0", 0.1), FinishingNode("b 1", 0.6)]
    t0 = time.monotonic()
    res = Watcher(nodes, c, {}).run()
    assert res.ok and time.monotonic() - t0 < 10
    assert [n.finish_calls for n in nodes] == [1, 1]
    assert all(n.ended_at - t0 >= 0.6 for n in nodes)       # none before the last was done
    assert all(n.stop_calls == 0 for n in nodes)


def test_a_node_not_done_keeps_every_node_unfinished() -> None:
    """One node never says done (its worker still runs, then its torchrun ends by itself): no
    node is told to finish."""
    c, _, _ = console()
    nodes = [FinishingNode("a 0", 0.1, linger=1.0), FinishingNode("b 1", None, linger=1.0)]
    res = Watcher(nodes, c, {}).run()
    assert res.ok and [n.finish_calls for n in nodes] == [0, 0]
