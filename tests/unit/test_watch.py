"""The watcher, with fake nodes: first failure stops the others at once, every node reports."""
from __future__ import annotations

import io
import threading
import time
from pathlib import Path

from cluster.backends import NodeExit
from cluster.watch import Console, LineSplitter, Watcher


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
