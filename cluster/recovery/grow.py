"""Re-admission: a node the job lost comes back once it answers again.

A node set aside because its connection was lost (cluster.recovery.pool's "lost") is looked
at while the job runs, every `every` seconds (gate.readmit_every), on a fresh login of its
own. Once it answers it is back: at the next restart it joins a job running below its size
(or waits as a spare), and the check's health gate decides, as for any node. With --grow the
launcher does not wait for a failure: it stops the healthy attempt at the job's next
checkpoint (the first one reported after the node answered) and starts it again at full
size; the trainer resumes from that checkpoint.

A node set aside for its own error (a GPU's, the hang's odd one out, a slow node) stays out
for the rest of the run, however well it answers a login: a login says nothing of the fault
it was set aside for. The node ledger remembers it for the next runs.
"""
from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Optional

from ..errors import ClusterError
from ..spec import Host, Inventory
from .ledger import Ledger

# answers(host) -> whether it takes a login now (the backend's `answers` capability).
Answers = Callable[[Host], bool]


class Readmission:
    """The lost nodes of one run, and the look at them while an attempt runs."""

    def __init__(self, answers: Optional[Answers], every: float, grow: bool,
                 say: Callable[[str], None]) -> None:
        self.answers, self.every, self.grow, self.say = answers, every, grow, say
        self.lock = threading.Lock()
        self.away: list[Host] = []         # set aside as lost, not answering yet
        self.back: list[Host] = []         # answered since: they join at the next start
        self.below = False                 # the job runs below its size (set per attempt)
        self.due: str | None = None        # why the attempt stops for a planned restart
        self.quit = threading.Event()
        self.thread: threading.Thread | None = None

    def lost(self, hosts: Sequence[Host]) -> None:
        """Nodes set aside as lost: looked at from now on (a backend that cannot log in
        anywhere new has no `answers`: they stay out)."""
        if self.answers is None or not hosts:
            return
        with self.lock:
            self.away += [h for h in hosts if h.name not in self.names()]
        if self.thread is None:
            self.thread = threading.Thread(target=self._look, name="readmission", daemon=True)
            self.thread.start()

    def names(self) -> set[str]:
        return {h.name for h in self.away + self.back}

    def take_back(self) -> list[Host]:
        """The nodes that answered since the last start, handed over once."""
        with self.lock:
            back, self.back, self.due = self.back, [], None
        return back

    def attempt(self, below: bool) -> None:
        """A new attempt starts; below: it runs with fewer nodes than the job's size."""
        with self.lock:
            self.below, self.due = below, None

    def on_checkpoint(self, step: int) -> None:
        """The job reported a newer checkpoint (the watcher's, at once): with --grow and a node
        back while the job runs below its size, the attempt stops for a restart at full size."""
        with self.lock:
            if self.grow and self.below and self.back and self.due is None:
                names = ", ".join(h.name for h in self.back)
                self.due = (f"{names} answer{'s' if len(self.back) == 1 else ''} again: "
                            f"restarting at full size from the checkpoint of step {step} "
                            f"(--grow)")

    def planned(self) -> str | None:
        """Why the running attempt should stop for a restart now, else None."""
        return self.due

    def close(self) -> None:
        self.quit.set()

    def _look(self) -> None:
        while not self.quit.wait(self.every):
            with self.lock:
                away = list(self.away)
            for host in away:
                if self.quit.is_set():
                    return
                if self._answers(host):
                    with self.lock:
                        self.away = [h for h in self.away if h.name != host.name]
                        self.back.append(host)
                    self.say(f"{host.name} answers again: it rejoins at the next start"
                             + (" (--grow: at the job's next checkpoint)" if self.grow else ""))

    def _answers(self, host: Host) -> bool:
        try:
            return bool(self.answers and self.answers(host))
        except Exception:  # whatever a login raises, the node is not back
            return False


def rejoined(inventory: Inventory, back: list[Host], spares: list[Host], target: int,
             ledger: Ledger | None, say: Callable[[str], None]) -> Inventory:
    """Lost nodes that answer again: each joins the job while it runs below its size (last in
    node_rank order), else waits as a spare (appended to `spares`); a node the ledger holds in
    quarantine stays out. The next check's gate judges them as any node."""
    if not back:
        return inventory
    try:
        held = set(ledger.quarantined([h.name for h in back]) if ledger else ())
    except (OSError, ClusterError) as exc:     # unread, the ledger cannot vouch for them
        say(f"warning: the node ledger could not be read: {exc}")
        held = {h.name for h in back}
    hosts = list(inventory.hosts)
    for host in back:
        if host.name in held:
            say(f"{host.name} answers again but is quarantined: it stays out")
        elif len(hosts) < target:
            hosts.append(host)
            say(f"{host.name} rejoins the job: {len(hosts)} of {target} node(s)")
        else:
            spares.append(host)
            say(f"{host.name} answers again: it waits as a spare")
    return dataclasses.replace(inventory, hosts=tuple(hosts))
