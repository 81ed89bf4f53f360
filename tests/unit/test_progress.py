"""The progress hook of the check and sync phases (SupervisedBackend.progress) and its line
(console.NodeProgress), with fake transports: no node is contacted."""
from __future__ import annotations

import io
import threading

from cluster.backends.local import LocalTransport, local_inventory
from cluster.backends.supervised import SupervisedBackend
from cluster.console import NodeProgress
from cluster.errors import ClusterError, PreflightError
from cluster.plan import Job, Templates, render


class Unreachable(LocalTransport):
    def spawn(self, command: str):  # type: ignore[override]
        raise ClusterError("connection refused")


def test_each_tells_progress_as_every_node_finishes() -> None:
    heard: list[tuple[str, int, int]] = []
    backend = SupervisedBackend(lambda host: LocalTransport(), progress=lambda *a: heard.append(a))
    release = threading.Event()

    def work(n: int) -> int:
        if n == 2:
            raise ClusterError("node 2 failed")     # a failed node is finished too
        release.wait(5)
        return n
    try:
        release.set()
        results = backend.each(range(5), work, phase="sync")
    finally:
        backend.close()
    assert [r for _, r in results if not isinstance(r, Exception)] == [0, 1, 3, 4]
    assert sorted(heard) == [("sync", i, 5) for i in range(1, 6)]
    assert [d for _, d, _ in heard] == [1, 2, 3, 4, 5], "done counts only go up"


def test_no_phase_no_progress_and_a_broken_display_does_not_fail_the_work() -> None:
    calls: list[tuple] = []

    def broken(*args: object) -> None:
        calls.append(args)
        raise RuntimeError("terminal gone")
    backend = SupervisedBackend(lambda host: LocalTransport(), progress=broken)
    try:
        assert [r for _, r in backend.each([1, 2], lambda n: n * 10)] == [10, 20]
        assert calls == []
        assert [r for _, r in backend.each([1, 2], lambda n: n * 10, phase="check")] == [10, 20]
        assert len(calls) == 2
    finally:
        backend.close()


def test_the_check_phase_reports_every_node_even_when_all_fail(tmp_path) -> None:
    heard: list[tuple[str, int, int]] = []
    backend = SupervisedBackend(lambda host: Unreachable())
    backend.progress = lambda *a: heard.append(a)         # set after construction, as up does
    plan = render(local_inventory(3, gpus=[]), Job(run_id="20260101-000000-abcd", script="t.py",
                                          node_root=str(tmp_path)), Templates())
    try:
        try:
            backend.check(plan)
        except PreflightError as exc:
            assert "3 of 3 node(s) failed" in str(exc)
        else:
            raise AssertionError("the check passed on unreachable nodes")
    finally:
        backend.close()
    assert sorted(heard) == [("check", 1, 3), ("check", 2, 3), ("check", 3, 3)]


def test_progress_line_shows_done_of_total() -> None:
    out = io.StringIO()
    line = NodeProgress(out, min_nodes=8, enabled=True)
    for done in (1, 37):
        line("check", done, 128)
    line.close()
    text = out.getvalue()
    assert "cluster: checked 37/128 nodes" in text, text


def test_progress_line_is_silent_for_few_nodes_or_no_terminal() -> None:
    out = io.StringIO()
    NodeProgress(out, min_nodes=8, enabled=True)("check", 1, 4)
    NodeProgress(out)("check", 1, 100)                    # a StringIO is no terminal
    assert out.getvalue() == ""


def test_the_line_goes_away_when_the_check_is_over() -> None:
    """The check is the last phase before the nodes' own lines: its last node erases the bar."""
    import io
    from cluster.console import NodeProgress
    stream = io.StringIO()
    progress = NodeProgress(stream=stream, min_nodes=1, enabled=True)
    progress("sync", 2, 2)
    progress("check", 1, 2)
    assert progress._bar is not None                  # still checking
    progress("check", 2, 2)
    assert progress._bar is None and "checked" in stream.getvalue()
