"""The flow every supervised backend shares: render, record, check all, start all, watch."""
from __future__ import annotations

import dataclasses
import os
import signal
from collections.abc import Mapping
from typing import Any

from .backends import Backend
from .errors import InputError, Interrupted, NodeLost, PreflightError, RunFailed
from .spec import Inventory
from .plan import Job, LaunchPlan, Templates, derived_port, render
from .preflight import WARN, Finding, evaluate, failures
from .runs import RunDir
from .watch import Console, Watcher

PORT_ATTEMPTS = 5


def dry_run(inventory: Inventory, job: Job, templates: Templates, run: RunDir,
            backend_name: str, argv: list[str], console: Console) -> LaunchPlan:
    plan = render(inventory, job, templates)
    run.record(plan, inventory, backend_name, argv, {"dry_run": True})
    console.raw(str(plan))
    console.info(f"dry run {plan.run_id}: {len(plan.nodes)} node script(s) in {run.path}; nothing was contacted")
    return plan


def secret_values(inventory: Inventory,
                  environ: Mapping[str, str] = os.environ) -> dict[str, dict[str, str]]:
    """Per host, the values of its secret_env names, from the launching shell. They are held
    in memory only and handed to each node's supervisor over its connection at start."""
    missing = sorted({name for h in inventory.hosts for name in h.secret_env if name not in environ})
    if missing:
        raise InputError(f"secret environment variable(s) {', '.join(missing)} not set in this "
                         f"shell (secret_env / --secret-env take their values from it); "
                         f"export them first. Nothing was contacted")
    return {h.name: {name: environ[name] for name in h.secret_env} for h in inventory.hosts}


def up(inventory: Inventory, job: Job, templates: Templates, backend: Backend, run: RunDir,
       argv: list[str], console: Console, *, detach: bool = False, preflight: bool = True,
       environ: Mapping[str, str] = os.environ) -> int:
    secrets = secret_values(inventory, environ)
    plan, facts = _check(inventory, job, templates, backend, run, argv, console, preflight)
    nodes = [dict(rank=n.rank, name=n.host.name, address=n.host.address, run_dir=n.run_dir,
                  dir=facts[n.host.name]["dir"], hostname=facts[n.host.name].get("hostname"))
             for n in plan.nodes]
    run.update(nodes=nodes, detached=detach)
    console.info(f"run {plan.run_id}: starting {len(plan.nodes)} node(s), "
                 f"master {plan.master_addr}:{plan.master_port}")
    procs = backend.start(plan, detach=detach, secrets=secrets)
    if detach:
        run.update(pgids={n.host.name: p for n, p in zip(plan.nodes, procs)})
        console.info(f"detached; follow with `cluster logs -f {plan.run_id}`, "
                     f"stop with `cluster down {plan.run_id}`")
        return 0
    log_paths = {n.label: run.log_path(n) for n in plan.nodes}
    result = Watcher(procs, console, log_paths, settle=plan.stop_grace + 30).run()
    pgids = {p.node.host.name: getattr(p, "pgid", None) for p in procs}
    run.update(pgids=pgids, exits={k: dataclasses.asdict(v) for k, v in result.exits.items()},
               interrupted=signal.Signals(result.signum).name if result.interrupted else None)
    return _outcome(result, plan, console)


def _check(inventory: Inventory, job: Job, templates: Templates, backend: Backend, run: RunDir,
           argv: list[str], console: Console,
           preflight: bool = True) -> tuple[LaunchPlan, dict[str, dict[str, Any]]]:
    """Phase one: every node probed at once (connect, python, torch, its run directory, the
    interface that reaches the master, the master port, trying the next derived port when
    it is taken); then, unless --no-preflight, the same torch everywhere and a TCP connection
    from every node to the master port. Any failure starts nothing. Then the scripts are
    rendered with each node's interface written in, recorded and pushed."""
    chosen = job.master_port or inventory.master.master_port
    for attempt in range(PORT_ATTEMPTS):
        if not chosen:
            job = dataclasses.replace(job, master_port=derived_port(job.run_id, attempt))
        plan = render(inventory, job, templates)
        run.record(plan, inventory, backend.name, argv)
        facts = backend.check(plan)
        if facts[plan.master.host.name].get("port_free", True) or chosen:
            break
        console.info(f"port {plan.master_port} is in use on {plan.master.host.name}; trying another")
    else:
        raise PreflightError(f"no free master port on {plan.master_addr} after {PORT_ATTEMPTS} tries")
    findings = evaluate(plan, facts, backend.reach(plan) if preflight else None)
    if not preflight:   # what used to be the whole check: torch present, the port free
        findings = [f for f in findings if f.check in ("torch", "master port")]
    _judge(findings, len(plan.nodes), console)
    ifnames = {name: f["network"]["ifname"] for name, f in facts.items()
               if preflight and (f.get("network") or {}).get("ifname")}
    plan = render(inventory, job, templates, ifnames)
    run.record(plan, inventory, backend.name, argv)
    backend.push(plan)
    return plan, facts


def _judge(findings: list[Finding], nodes: int, console: Console) -> None:
    for f in findings:
        if f.status == WARN:
            console.info(f"warning: [{f.node}] {f.check}: {f.detail}" + (f" ({f.fix})" if f.fix else ""))
    bad = failures(findings)
    if bad:
        lines = "\n".join(f"  {f.node}: {f.check}: {f.detail}" + (f"\n    fix: {f.fix}" if f.fix else "")
                          for f in bad)
        named = sorted({f.node for f in bad})
        raise PreflightError(f"{len(bad)} check(s) failed on {', '.join(named)} "
                             f"({nodes} node(s) checked); nothing was started", details=lines)


def _outcome(result: Any, plan: LaunchPlan, console: Console) -> int:
    left = result.leftovers()
    if left:
        console.info(f"WARNING: processes of run {plan.run_id} still alive: {left}")
    if result.interrupted:
        name = signal.Signals(result.signum).name
        raise Interrupted(f"interrupted ({name}); every node of run {plan.run_id} was stopped"
                          + (f" except {left}" if left else ""), signum=result.signum)
    if result.first_failure:
        label, ex = result.first_failure
        stopped = len(result.stops)
        msg = (f"node [{label}] failed: {ex.describe()}; "
               f"{'stopped the other ' + str(stopped) + ' node(s)' if stopped else 'no other node was running'}"
               f" (logs: runs/{plan.run_id}/logs/)")
        if ex.lost:
            msg += (f"; if it is only cut off, [{label}] stops its own processes within "
                    f"ssh.keepalive of losing the launcher")
        raise (NodeLost if ex.lost else RunFailed)(msg)
    console.info(f"run {plan.run_id}: all {len(plan.nodes)} node(s) finished")
    return 0
