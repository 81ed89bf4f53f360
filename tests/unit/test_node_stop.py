"""A node's stop as the launcher asks for it (SupervisedProcess.stop), with a fake channel."""
from __future__ import annotations

from cluster.backends.node import SupervisedProcess


class Reported:
    """A supervisor's channel that has said its final record and ended."""

    def __init__(self) -> None:
        self.data = [b'\x1e{"final": {"left": [], "how": "term"}}\x1f', b""]
        self.written: list[bytes] = []

    def read(self) -> bytes:
        return self.data.pop(0) if self.data else b""

    def write(self, data: bytes) -> None:
        self.written.append(data)


class NoCommands:
    """A node that must not be sent a command of its own."""

    def stop(self, grace: float) -> dict:
        raise AssertionError("a stop command was sent to a node that had already reported")


def test_a_node_that_reported_and_ended_is_not_stopped_again() -> None:
    """At 1,000 nodes the launcher's few stop threads reach most nodes after their end: their
    report is the answer, with no second command (which took 78 s there)."""
    proc = SupervisedProcess(None, NoCommands(), Reported(), grace=5.0)  # type: ignore[arg-type]
    while proc.read_ready() is not None:
        pass
    assert proc.closed.is_set()
    assert proc.stop() == {"left": [], "how": "term"}
    assert proc.channel.written == []
