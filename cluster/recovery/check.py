"""Phase one of a launch, before anything starts: for backends that check their nodes
(NODE_CHECKS: local, SSH), check every node, resolve the network, render each node's script
with its interface written in and record it; for a scheduler (SLURM), render and record.

A check that fails starts nothing anywhere: every failure is listed with its node, what was
seen and the fix (cluster.recovery.gate) - unless a spare can take the failing node's place
(cluster.recovery.pool), or, at a relaunch of a restarted job, it can be left out while
--min-nodes remain.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Protocol

from ..backends import Backend, NodeChecks, Record, node_checks
from ..console import Console
from ..errors import PreflightError
from ..plan import Job, LaunchPlan, Plan, Templates, derived_port
from .gate import WARN, Finding, evaluate, failures
from .hardware import GATE_CHECKS
from .ledger import Ledger
from .pool import gate_events, remember, replace
from ..runs import RunDir
from ..spec import Host, Inventory


class Options(Protocol):
    """What the check reads of how the run goes (launch.Options)."""

    @property
    def preflight(self) -> bool: ...

    @property
    def min_nodes(self) -> int | None: ...

    @property
    def detach(self) -> bool: ...

    @property
    def ledger(self) -> Ledger | None: ...

PORT_ATTEMPTS = 5


def checked_plan(inventory: Inventory, job: Job, templates: Templates, backend: Backend[Any],
                 run: RunDir, argv: list[str], console: Console, options: Options,
                 history: list[Record], spares: list[Host] | None = None) -> tuple[Inventory, Plan]:
    """The plan that will start, recorded, its nodes checked where the backend checks them;
    the inventory, less any node left out. A node that fails the check is replaced by a spare
    (taken from `spares`) before anything starts, and checked again with the others."""
    checks = node_checks(backend)
    if checks is None:
        plan: Plan = backend.plan(inventory, job, templates)
        run.record(plan, inventory, backend.name, argv)
        return inventory, plan
    while True:
        try:
            launch_plan, facts = check_nodes(inventory, job, templates, backend, checks, run,
                                             argv, console, options.preflight, options.ledger)
            break
        except PreflightError as exc:
            bad = set(exc.nodes)
            if not bad or len(bad) >= len(inventory.hosts):    # none named, or all: configuration
                raise
            # A spare takes each failing node's place; at a relaunch, without one, it is left
            # out while --min-nodes remain. A failing node that would stay: nothing starts.
            left = spares if spares is not None else []
            out = replace(inventory.hosts, dict.fromkeys(sorted(bad), "failed the check"), left,
                          min_nodes=options.min_nodes if history else None)
            if any(h.name in bad for h in out.hosts):
                raise
            inventory = out.applied(inventory, left, console.info)
    nodes = [dict(rank=n.rank, name=n.host.name, address=n.host.address, run_dir=n.run_dir,
                  dir=facts[n.host.name]["dir"], hostname=facts[n.host.name].get("hostname"))
             for n in launch_plan.nodes]
    run.update(nodes=nodes, detached=options.detach, attempt=job.attempt, attempts=history)
    return inventory, launch_plan


def check_nodes(inventory: Inventory, job: Job, templates: Templates,
                backend: Backend[LaunchPlan], checks: NodeChecks, run: RunDir, argv: list[str],
                console: Console, preflight: bool = True,
                ledger: Ledger | None = None) -> tuple[LaunchPlan, dict[str, Record]]:
    """Phase one: every node probed at once (connect, python, torch, its run directory, the
    interface that reaches the master, the master port, trying the next derived port when
    it is taken); then, unless --no-preflight, the same torch everywhere and a TCP connection
    from every node to the master port. Any failure starts nothing. Then the scripts are
    rendered with each node's interface written in and recorded (each node's files travel
    with its start)."""
    chosen = job.master_port or inventory.master.master_port
    for attempt in range(PORT_ATTEMPTS):
        if not chosen:    # a port of its own for every restart too: the last one's may linger
            job = dataclasses.replace(
                job, master_port=derived_port(job.run_id, job.attempt * PORT_ATTEMPTS + attempt))
        plan = backend.plan(inventory, job, templates)
        run.record(plan, inventory, backend.name, argv)
        t0 = time.monotonic()
        facts = checks.check(plan, reach=preflight)
        timings = {"check": time.monotonic() - t0}
        if facts[plan.master.host.name].get("port_free", True) or chosen:
            break
        checks.release()
        console.info(f"port {plan.master_port} is in use on {plan.master.host.name}; trying another")
    else:
        raise PreflightError(f"no free master port on {plan.master_addr} after {PORT_ATTEMPTS} tries")
    reach = {name: f["reach"] for name, f in facts.items() if "reach" in f} if preflight else None
    findings = evaluate(plan, facts, reach)
    if not preflight:   # what used to be the whole check: torch (or its image) present, the port free
        findings = [f for f in findings if f.check in ("torch", "container", "master port", "script")
                    or f.check in GATE_CHECKS]          # the health gate is not preflight's
    try:
        judge(findings, len(plan.nodes), console)
    except PreflightError:
        remember(ledger, gate_events(plan.run_id, findings), console.info)   # the hardware's
        checks.discard()                 # every staged node lets go, its folder too: nothing starts
        raise
    ifnames = {name: f["network"]["ifname"] for name, f in facts.items()
               if preflight and (f.get("network") or {}).get("ifname")}
    plan = backend.plan(inventory, job, templates, ifnames)
    run.record(plan, inventory, backend.name, argv)
    run.update(timings={k: round(v, 3) for k, v in timings.items()})
    return plan, facts


def judge(findings: list[Finding], nodes: int, console: Console) -> None:
    for f in findings:
        if f.status == WARN:
            console.info(f"warning: [{f.node}] {f.check}: {f.detail}" + (f" ({f.fix})" if f.fix else ""))
    bad = failures(findings)
    if bad:
        lines = "\n".join(f"  {f.node}: {f.check}: {f.detail}" + (f"\n    fix: {f.fix}" if f.fix else "")
                          for f in bad)
        named = sorted({f.node for f in bad})
        error = PreflightError(f"{len(bad)} check(s) failed on {', '.join(named)} "
                               f"({nodes} node(s) checked); nothing was started", details=lines)
        error.nodes = [n for n in named if n != "all"]
        raise error
