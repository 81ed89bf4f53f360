"""The launcher's one keepalive over every SSH connection (cluster/backends/ssh/keepalive.py):
asked without a thread per question, answered through paramiko's reader, and a silent
connection closed after one period. The end to end case (a node's link cut under a real run)
is tests/integration/test_faults.py."""
from __future__ import annotations

import socket
import threading
import time

import paramiko

from cluster.backends.ssh.keepalive import AnsweringTransport, Keepalive


class FakeConnection:
    def __init__(self, clock=time.monotonic) -> None:
        self.answer = 0.0
        self.active = True
        self.asked = 0
        self.clock = clock
        self.question: float | None = None

    def is_active(self) -> bool:
        return self.active

    def answered_at(self) -> float:
        return self.answer

    def ask(self) -> None:
        self.asked += 1
        if self.question is None or self.answer >= self.question:
            self.question = self.clock()

    def waiting_since(self) -> float | None:
        return self.question if self.question is not None and self.answer < self.question else None

    def close(self) -> None:
        self.active = False


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def watched(keepalive: Keepalive, label: str, conn: FakeConnection) -> None:
    """As watch() does for a real AnsweringTransport, without starting its threads."""
    keepalive._watched[id(conn)] = (label, conn, keepalive.clock())


def test_a_connection_is_overdue_only_a_whole_period_after_an_unanswered_question() -> None:
    clock = Clock()
    ka = Keepalive(10.0, lambda _: None, clock=clock)
    quiet, talking, unasked = FakeConnection(clock), FakeConnection(clock), FakeConnection(clock)
    for label, conn in (("a", quiet), ("b", talking), ("c", unasked)):
        watched(ka, label, conn)
    quiet.ask()
    talking.ask()
    clock.now += 9.9
    talking.answer = clock.now
    assert ka.overdue() == []                      # a question has a whole period
    clock.now += 0.2
    assert [label for label, _, _ in ka.overdue()] == ["a"]
    clock.now += 100                               # never asked (the asking thread is late):
    assert "c" not in [label for label, _, _ in ka.overdue()]      # not silent
    quiet.active = False                           # a closed one leaves, and is never named
    assert ka.overdue() == [] and len(ka._watched) == 2     # b answered its question


class FakeAnswering(AnsweringTransport, FakeConnection):
    """Of the type watch() keeps, without a socket."""

    def __init__(self) -> None:
        FakeConnection.__init__(self)

    is_active = FakeConnection.is_active
    answered_at = FakeConnection.answered_at
    ask = FakeConnection.ask
    close = FakeConnection.close


def test_two_threads_ask_every_connection_whatever_their_number() -> None:
    ka = Keepalive(0.4, lambda _: None)
    conns = [FakeAnswering() for _ in range(200)]
    for i, conn in enumerate(conns):
        conn.answer = time.monotonic() + 60
        ka.watch(f"n{i}", conn)
    deadline = time.monotonic() + 5
    while not all(c.asked for c in conns) and time.monotonic() < deadline:
        time.sleep(0.02)
    ka.close()
    assert all(c.asked for c in conns)
    assert len(ka._threads) == 2 and {t.name for t in ka._threads} == {
        "ssh-keepalive-ask", "ssh-keepalive-deadlines"}


def test_the_deadline_closes_a_silent_connection_and_says_which_node() -> None:
    said: list[str] = []
    ka = Keepalive(0.4, said.append)
    silent, alive = FakeConnection(), FakeConnection()
    silent.answer = alive.answer = time.monotonic()
    with ka._lock:
        for label, conn in (("silent", silent), ("alive", alive)):
            ka._watched[id(conn)] = (label, conn, time.monotonic())
        ka._start()
    deadline = time.monotonic() + 5
    while silent.active and time.monotonic() < deadline:
        alive.answer = time.monotonic()
        time.sleep(0.02)
    ka.close()
    assert not silent.active and alive.active
    assert said == ["[silent] no answer over SSH for 0.4 s (ssh.keepalive); treating the node as lost"]
    assert silent.asked >= 1 and alive.asked >= 1


class _Server(paramiko.ServerInterface):
    def get_allowed_auths(self, username: str) -> str:
        return "none"

    def check_auth_none(self, username: str) -> int:
        return paramiko.AUTH_SUCCESSFUL


def test_a_real_peer_answers_the_question_through_the_reader_thread() -> None:
    """A paramiko server on a socket pair answers keepalive@openssh.com (with a failure, as
    OpenSSH does: the answer is what counts); answered_at() moves, and no thread waited."""
    ours, theirs = socket.socketpair()
    server = paramiko.Transport(theirs)
    server.add_server_key(paramiko.RSAKey.generate(2048))
    server.start_server(event=threading.Event(), server=_Server())
    client = AnsweringTransport(ours)
    try:
        client.start_client(timeout=10)
        client.auth_none("me")
        # no thread was started for the question (one of paramiko's may end meanwhile: a
        # count would see that as a thread fewer)
        threads = set(threading.enumerate())
        assert answered(client)
        assert not set(threading.enumerate()) - threads
        # paramiko's own blocking request still works beside it, and ours after it
        assert client.global_request("other@example.com", wait=True) is None
        assert answered(client)
    finally:
        client.close()
        server.close()


def answered(client: AnsweringTransport) -> bool:
    """Asked once: did the answer come (within 5 s)?"""
    before = client.answered_at()
    time.sleep(0.05)
    client.ask()
    deadline = time.monotonic() + 5
    while client.answered_at() == before and time.monotonic() < deadline:
        time.sleep(0.01)
    return client.answered_at() > before
