"""One keepalive for every SSH connection of a launcher: is each node still answering?

A few times per keepalive period (ssh.keepalive / KEEPALIVE_PROBES) every connection is asked
`keepalive@openssh.com` with a reply wanted, as OpenSSH's ServerAliveInterval does; a
connection that has not answered a whole period is closed, which ends each of its channels
(Channel.wait() -> None: the node is lost). One thread asks every connection and one watches
the deadlines, whatever the node count: before, each connection had a prober thread of its own
and a thread per question waiting for the answer (2.7 launcher threads per node with
paramiko's reader), which at 1,000 nodes is past a container's pids limit.

paramiko answers a global request only to a caller that blocks on it (Transport.global_request
with wait=True, one at a time per connection). AnsweringTransport asks without waiting and
hears the answer from the reader thread: that uses two of paramiko's internals
(`_send_user_message`, and `completion_event`, which the reader sets when a global request is
answered, or a key exchange ends: both prove the link alive). They are used here alone.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import paramiko
from paramiko.common import cMSG_GLOBAL_REQUEST

KEEPALIVE_PROBES = 4                  # probes per keepalive period
REQUEST = "keepalive@openssh.com"


class _Answered(threading.Event):
    """What paramiko's reader sets when the peer answers: the time of the answer."""

    def __init__(self) -> None:
        super().__init__()
        self.at = time.monotonic()

    def set(self) -> None:
        self.at = time.monotonic()

    def is_set(self) -> bool:      # paramiko only sets it; its own waits replace it first
        return True

    def wait(self, timeout: float | None = None) -> bool:
        return True


class AnsweringTransport(paramiko.Transport):
    """paramiko's transport, asked whether it is alive without a thread waiting for each answer.

    Its reader thread wakes once a second when nothing comes, not ten times (paramiko's
    default socket timeout, 0.1 s, is how often it looks whether it was closed): at 256 idle
    connections that is 2,300 wake-ups a second fewer, each one taking the interpreter's lock
    from the threads that do work. Nothing waits on it: close() marks the transport closed
    and shuts its socket, which ends the reader's wait at once."""

    _active_check_timeout = 1.0
    _answered: _Answered | None = None

    _asked: float | None = None        # when the oldest question still unanswered was sent

    def ask(self) -> None:
        """Send the question (a reply wanted); the answer updates answered_at()."""
        if self._answered is None:
            self._answered = _Answered()
        if self._asked is None or self._answered.at >= self._asked:
            self._asked = time.monotonic()
        if self.completion_event is not self._answered:
            self.completion_event = self._answered    # a rekey or global_request() may have
        m = paramiko.Message()                        # put its own there: ours again
        m.add_byte(cMSG_GLOBAL_REQUEST)
        m.add_string(REQUEST)
        m.add_boolean(True)
        self._send_user_message(m)  # type: ignore[attr-defined]  # the module doc says why

    def answered_at(self) -> float:
        return self._answered.at if self._answered is not None else time.monotonic()

    def waiting_since(self) -> float | None:
        """When the oldest question not answered yet was sent; None when none is."""
        if self._asked is None or self.answered_at() >= self._asked:
            return None
        return self._asked


class Keepalive:
    """The launcher's one keepalive over its SSH connections (one per backend, shared by its
    nodes). watch() adds a connection; it leaves when closed. warn is told which node, before
    a silent connection is closed."""

    def __init__(self, period: float, warn: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.period = float(period)
        self.interval = max(0.2, self.period / KEEPALIVE_PROBES)
        self.warn = warn
        self.clock = clock
        self._lock = threading.Lock()
        self._watched: dict[int, tuple[str, Any, float]] = {}   # id -> (label, transport, since)
        self._stopped = threading.Event()
        self._threads: list[threading.Thread] = []

    def watch(self, label: str, transport: Any) -> None:
        """Ask this connection from now on (an AnsweringTransport; another kind is only kept
        alive by paramiko's own keepalive, with no answer asked)."""
        if not isinstance(transport, AnsweringTransport):
            return
        with self._lock:
            self._watched[id(transport)] = (label, transport, self.clock())
            if not self._threads:
                self._start()

    def _start(self) -> None:
        for name, loop in (("ssh-keepalive-ask", self._ask_loop),
                           ("ssh-keepalive-deadlines", self._deadline_loop)):
            thread = threading.Thread(target=loop, daemon=True, name=name)
            thread.start()
            self._threads.append(thread)

    def _current(self) -> list[tuple[str, Any, float]]:
        with self._lock:
            for key, (_, t, _) in list(self._watched.items()):
                if not t.is_active():
                    del self._watched[key]
            return list(self._watched.values())

    def _ask_loop(self) -> None:
        """Asks every connection each interval. A send waits while a connection's send buffer
        is full; the deadline thread then closes that connection, which ends the wait."""
        while not self._stopped.wait(self.interval):
            for _, transport, _ in self._current():
                try:
                    transport.ask()
                except Exception:  # noqa: BLE001 - a broken link is the deadline's to name
                    pass

    def _deadline_loop(self) -> None:
        while not self._stopped.wait(self.interval / 2):
            for label, transport, _ in self.overdue():
                self.warn(f"[{label}] no answer over SSH for {self.period:g} s (ssh.keepalive); "
                          f"treating the node as lost")
                with self._lock:
                    self._watched.pop(id(transport), None)
                transport.close()

    def overdue(self) -> list[tuple[str, Any, float]]:
        """The connections with a question unanswered for a whole period. Counted from the
        question, not from the last answer: with a thousand connections under load the asking
        thread itself may be late, and a connection not yet asked again is not silent."""
        now = self.clock()
        return [(label, t, since) for label, t, since in self._current()
                if (asked := t.waiting_since()) is not None and now - asked > self.period]

    def close(self) -> None:
        self._stopped.set()
