"""The hang watchdog on a fake clock: progress of any kind (an output line, a heartbeat, the
workers joining) keeps a quiet job alive, and it fires after hang_timeout seconds of silence,
not before. The test moves the clock and waits for the watcher to have looked at it."""
from __future__ import annotations

import queue
import threading
from typing import Any

import pytest

from cluster.backends import NodeExit
from cluster.observe.watch import Watcher, WatchResult
from tests.unit.test_watch import console

TIMEOUT = 10.0


class FakeClock:
    """Monotonic seconds set by the test; counts what each thread read, so that the test can
    wait until the watcher's own thread has compared the time it was set to."""

    def __init__(self) -> None:
        self.now = 0.0
        self.cond = threading.Condition()
        self.reads: dict[int, int] = {}

    def __call__(self) -> float:
        with self.cond:
            me = threading.get_ident()
            self.reads[me] = self.reads.get(me, 0) + 1
            self.cond.notify_all()
            return self.now

    def set(self, now: float) -> None:
        with self.cond:
            self.now = now

    def looked(self, thread: threading.Thread, times: int = 3) -> None:
        """Return once `thread` has read the clock `times` more times: the watcher compares
        the time with its last progress each time its queue stays empty for `poll` seconds."""
        with self.cond:
            want = self.reads.get(thread.ident or 0, 0) + times
            assert self.cond.wait_for(lambda: self.reads.get(thread.ident or 0, 0) >= want, 10), \
                "the watcher stopped looking at the clock"


class QuietNode:
    """A node that says only what the test feeds it and runs until it is stopped."""

    def __init__(self, label: str) -> None:
        self.node = type("N", (), {"label": label})()
        self.feed: queue.Queue[Any] = queue.Queue()
        self.handled = threading.Semaphore(0)
        self.stacks_asked = threading.Event()

    def output(self):
        while (item := self.feed.get()) is not None:
            yield item
            self.handled.release()          # the watcher asks for the next: it handled this one

    def say(self, item: bytes | dict[str, Any]) -> None:
        self.feed.put(item)
        assert self.handled.acquire(timeout=10), "the watcher did not take the node's output"

    def request_stacks(self) -> None:
        self.stacks_asked.set()
        self.feed.put({"dumped": 0})

    def stop(self) -> dict[str, Any]:
        self.feed.put(None)
        return {"signalled": [], "killed": [], "left": []}

    def wait(self) -> NodeExit:
        return NodeExit(signal=15)


def watching(node: QuietNode, clock: FakeClock) -> tuple[threading.Thread, list[WatchResult]]:
    watcher = Watcher([node], console()[0], {}, settle=5, hang_timeout=TIMEOUT, clock=clock,
                      poll=0.01)
    out: list[WatchResult] = []
    thread = threading.Thread(target=lambda: out.append(watcher.run()), daemon=True)
    thread.start()
    return thread, out


@pytest.mark.parametrize("progress", [{"beat": 1.0}, b"step 7 loss 0.3\n",
                                      {"joined": True, "group_rank": 0}],
                         ids=["heartbeat", "output line", "workers joined"])
def test_progress_keeps_a_quiet_job_alive_and_silence_fires_at_the_timeout(progress) -> None:
    clock, node = FakeClock(), QuietNode("a 0")
    thread, out = watching(node, clock)
    for now in (6.0, 12.0, 18.0, 24.0, 30.0):          # 30 s in all, never 10 s quiet
        clock.set(now)
        node.say(progress)
        clock.looked(thread)
        assert not node.stacks_asked.is_set(), f"fired at {now} s despite progress"
    clock.set(30.0 + TIMEOUT - 0.1)                    # quiet, just short of the timeout
    clock.looked(thread)
    assert not node.stacks_asked.is_set() and thread.is_alive(), "fired before the timeout"
    clock.set(30.0 + TIMEOUT)
    thread.join(10)
    assert not thread.is_alive() and node.stacks_asked.is_set()
    result = out[0]
    assert result.hang is not None and result.hang.seconds == pytest.approx(TIMEOUT)
    assert result.exits == {"a 0": NodeExit(signal=15)}


def test_a_silent_job_is_stopped_at_the_timeout_and_not_before() -> None:
    clock, node = FakeClock(), QuietNode("a 0")
    thread, out = watching(node, clock)
    clock.set(TIMEOUT - 0.1)
    clock.looked(thread)
    assert not node.stacks_asked.is_set() and thread.is_alive()
    clock.set(TIMEOUT)
    thread.join(10)
    assert node.stacks_asked.is_set() and out[0].hang is not None
    assert out[0].hang.seconds == pytest.approx(TIMEOUT)

