"""Many streams, few threads (for cluster.observe.watch): one thread reads every stream that can be
selected as it becomes readable, and a few daemon threads take what follows each stream's end.
Plain objects in: a pump has .proc (with read_ready(), as backends.Selectable) and feed(),
broke(), end()."""
from __future__ import annotations

import queue
import selectors
import threading
from collections.abc import Callable
from typing import Any


def read_all(pumps: list[tuple[int, Any]], ended: Callable[[Any], None]) -> None:
    """Every selectable node's output on this one thread, as it becomes readable; a node
    whose stream ends (or breaks) leaves the selector and is handed to ended()."""
    sel = selectors.DefaultSelector()
    for fd, pump in pumps:
        sel.register(fd, selectors.EVENT_READ, pump)
    while sel.get_map():
        for key, _ in sel.select():
            pump = key.data
            try:
                pieces = pump.proc.read_ready()
                for piece in pieces or ():
                    pump.feed(piece)
            except Exception as exc:  # a broken stream is reported through wait()
                pump.broke(exc)
                pieces = None
            if pieces is None:
                sel.unregister(key.fd)
                pump.end()
                ended(pump.proc)
    sel.close()


class Waiters:
    """A few daemon threads that take each ended node's exit status, however many nodes end
    at once (a thread per node would be N threads at the end of every run). Daemons: a wait
    that never returns must not hold up the launcher's exit."""

    THREADS = 8

    def __init__(self) -> None:
        self.jobs: queue.Queue[Callable[[], None]] = queue.Queue()
        self.started = 0
        self.lock = threading.Lock()

    def submit(self, job: Callable[[], None]) -> None:
        self.jobs.put(job)
        with self.lock:
            if self.started < self.THREADS:
                self.started += 1
                threading.Thread(target=self._work, daemon=True, name="node-exits").start()

    def _work(self) -> None:
        while True:
            job = self.jobs.get()
            try:
                job()
            except Exception:  # noqa: BLE001 - one node's report failing keeps the others'
                pass
