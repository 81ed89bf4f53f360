"""Which hosts run the job, and what a run's end holds against each node. Pure, by table.

The pick: a quarantined node (the ledger's) is not picked while others are available. With
--nodes N the first N healthy hosts run; with --min-nodes M every healthy host runs once at
least M are healthy; otherwise every host is needed and a quarantined one runs, said so.

The blame: a lost node, the node whose rank failed first with an error that is the hardware's,
a node named slow, and a node the health gate failed on its hardware, each a strike in the
ledger; every node of a run that finished, a clean run.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import ClusterError
from ..spec import Gate, Host, Inventory
from .classes import node_pattern
from .findings import Finding
from .hardware import hardware_failures
from .ledger import Event, Ledger, NodeState, Policy

# A worker's own error that says the GPU or its links failed, not the program: the failure
# classes' node rows (CUDA's, NCCL's and the driver's words for it).
HARDWARE_ERRORS = node_pattern()


@dataclass(frozen=True)
class Pick:
    hosts: tuple[Host, ...]
    notes: tuple[str, ...] = ()          # said in the launch's first lines


def pick(hosts: Sequence[Host], quarantined: Mapping[str, NodeState], *,
         nodes: int | None = None, min_nodes: int | None = None) -> Pick:
    """The hosts to run on, in their order, and why a quarantined one is left out or kept."""
    bad = [h for h in hosts if h.name in quarantined]
    if not bad:
        return Pick(tuple(hosts[:nodes] if nodes else hosts))
    healthy = [h for h in hosts if h.name not in quarantined]
    why = "; ".join(f"{h.name} ({describe(quarantined[h.name])})" for h in bad)
    want = nodes or len(hosts)
    if len(healthy) >= want or (nodes is None and min_nodes and len(healthy) >= min_nodes):
        chosen = tuple(healthy[:want])
        left = [h.name for h in bad]
        return Pick(chosen, (f"leaving out quarantined {', '.join(left)}: {why}; "
                             f"{len(chosen)} node(s) run (`cluster nodes release NODE` "
                             f"after a repair)",))
    needed = want - len(healthy)
    kept = {h.name for h in bad[:needed]}
    chosen = tuple(h for h in hosts if h.name not in quarantined or h.name in kept)[:want]
    return Pick(chosen, (f"WARNING: running on quarantined {', '.join(sorted(kept))}, because "
                         f"{want} node(s) are needed and only {len(healthy)} are healthy: {why} "
                         f"(--nodes N or --min-nodes M lets cluster leave it out)",))


@dataclass(frozen=True)
class Replaced:
    hosts: tuple[Host, ...]              # the next attempt's, survivors in their places
    spares: tuple[Host, ...]             # those still waiting
    lines: tuple[str, ...] = ()          # each node set aside, and what became of its place

    def applied(self, inventory: Inventory, spares: list[Host],
                say: Callable[[str], None]) -> Inventory:
        """The inventory with these hosts; `spares` left with those still waiting; each line
        said."""
        spares[:] = self.spares
        for line in self.lines:
            say(line)
        return dataclasses.replace(inventory, hosts=self.hosts)


def replace(hosts: Sequence[Host], culprits: Mapping[str, str], spares: Sequence[Host], *,
            min_nodes: int | None = None) -> Replaced:
    """The next attempt's hosts after a failure held against `culprits` (name -> why): each
    one set aside and a spare put in its place (the survivors keep their node_rank); with no
    spare left, left out while --min-nodes remain (the job shrinks), else kept (the whole job
    restarts as it was)."""
    left, out, lines = list(spares), list(hosts), []
    for name, why in culprits.items():
        if name not in [h.name for h in out]:
            continue
        i = [h.name for h in out].index(name)
        if left:
            spare = left.pop(0)
            out[i] = spare
            lines.append(f"{name} set aside ({why}); {spare.name} takes its place")
        elif min_nodes and len(out) - 1 >= min_nodes:
            del out[i]
            lines.append(f"{name} set aside ({why}); no spare left: going on with {len(out)} "
                         f"node(s) (--min-nodes {min_nodes})")
        else:
            lines.append(f"{name} failed ({why}) but no spare is left"
                         + (f" and {len(out) - 1} node(s) are fewer than --min-nodes {min_nodes}"
                            if min_nodes else "")
                         + ": the same nodes start again")
    return Replaced(tuple(out), tuple(left), tuple(lines))


def culprits(events: Iterable[Event], replace_slow: bool = False) -> dict[str, str]:
    """The nodes an attempt's events hold its failure against (a slow node only when asked)."""
    out: dict[str, str] = {}
    for e in events:
        if e.kind in ("lost", "failed_first", "hang", "gate") or (e.kind == "slow" and replace_slow):
            out.setdefault(e.node, f"{e.kind}: {e.detail}")
    return out


def describe(state: NodeState) -> str:
    """'2 failure(s) in 24 h, the last: lost in run R' for a launch's line."""
    last = state.why[-1] if state.why else ""
    return f"{state.strikes} failure(s) in the window{', the last: ' + last if last else ''}"


def quarantined_lines(ledger: Ledger, names: Iterable[str]) -> list[tuple[str, str]]:
    """For status and doctor: (node, line) for each of `names` the ledger holds in quarantine,
    and why. A ledger that cannot be read is said ("all"), never their failure."""
    try:
        bad = ledger.quarantined(names)
    except (OSError, ClusterError) as exc:
        return [("all", f"the node ledger could not be read ({ledger.path}): {exc}")]
    return [(name, f"{name} is quarantined: {describe(state)} (`cluster nodes release {name}` "
                   f"after a repair)") for name, state in bad.items()]


def ledger_for(source: str | None, gate: Gate,
               environ: Mapping[str, str] = os.environ) -> Ledger:
    """The ledger of an inventory file (None: a run without one), judged by its gate."""
    return Ledger.for_inventory(source, Policy(gate.quarantine_after, gate.quarantine_window),
                                environ)


def attempt_events(run_id: str, exits: Mapping[str, Any], first_failure: tuple[str, Any] | None,
                   causes: Mapping[str, str], slow: Iterable[Mapping[str, Any]],
                   ok: bool, hang_odd: tuple[str, str] | None = None) -> list[Event]:
    """What one attempt's end holds against each node (labels 'node2 1' name node2);
    hang_odd: the hang's odd one out, (node, where its ranks were)."""
    events = []
    if hang_odd is not None:
        events.append(Event(hang_odd[0], "hang", run_id, f"the hang's odd one out: {hang_odd[1]}"))
    for label, ex in exits.items():
        if getattr(ex, "lost", False):
            events.append(Event(node_of(label), "lost", run_id, ex.describe()))
    if first_failure is not None:
        label, ex = first_failure
        cause = causes.get(label) or ""
        if not getattr(ex, "lost", False) and HARDWARE_ERRORS.search(cause):
            events.append(Event(node_of(label), "failed_first", run_id,
                                f"its rank failed first: {cause}", evidence=ex.describe()))
    for s in slow:
        if s.get("node"):
            events.append(Event(node_of(str(s["node"])), "slow", run_id,
                                f"named slow: {s.get('ratio')}x {s.get('reference')} step "
                                f"({s.get('part')})"))
    if ok:
        events += [Event(node_of(label), "clean", run_id) for label in exits]
    return events


def gate_events(run_id: str, findings: Sequence[Finding]) -> list[Event]:
    """A node the gate failed on its hardware (not on another job's process or a full disk)."""
    return [Event(node, "gate", run_id, "; ".join(f"{f.check}: {f.detail}" for f in failed))
            for node, failed in hardware_failures(findings).items()]


def remember(ledger: Ledger | None, events: list[Event], say: Callable[[str], None]) -> None:
    """Into the node ledger; a ledger that cannot be written (a full disk) is said, and the
    run goes on: it is the run's record of its nodes, never the run's outcome."""
    if ledger is None or not events:
        return
    try:
        ledger.record(events)
    except (OSError, ClusterError) as exc:
        say(f"warning: the node ledger was not updated ({ledger.path}): {exc}")


def node_of(label: str) -> str:
    """'node2 1' -> 'node2' (a node's label is its name and its group rank)."""
    return label.rsplit(" ", 1)[0] if " " in label else label
