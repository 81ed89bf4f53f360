"""The flow every supervised backend shares: render, record, check all, start all, watch."""
from __future__ import annotations

import dataclasses
from typing import Any

from .backends import Backend
from .errors import Interrupted, NodeLost, PreflightError, RunFailed
from .spec import Inventory
from .plan import Job, LaunchPlan, Templates, derived_port, render
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


def up(inventory: Inventory, job: Job, templates: Templates, backend: Backend, run: RunDir,
       argv: list[str], console: Console, *, detach: bool = False) -> int:
    plan, facts = _check(inventory, job, templates, backend, run, argv, console)
    nodes = [dict(rank=n.rank, name=n.host.name, address=n.host.address, run_dir=n.run_dir,
                  dir=facts[n.host.name]["dir"], hostname=facts[n.host.name].get("hostname"))
             for n in plan.nodes]
    run.update(nodes=nodes, detached=detach)
    console.info(f"run {plan.run_id}: starting {len(plan.nodes)} node(s), "
                 f"master {plan.master_addr}:{plan.master_port}")
    procs = backend.start(plan, detach=detach)
    if detach:
        run.update(pgids={n.host.name: p for n, p in zip(plan.nodes, procs)})
        console.info(f"detached; follow with `cluster logs -f {plan.run_id}`, "
                     f"stop with `cluster down {plan.run_id}`")
        return 0
    log_paths = {n.label: run.log_path(n) for n in plan.nodes}
    result = Watcher(procs, console, log_paths).run()
    pgids = {p.node.host.name: getattr(p, "pgid", None) for p in procs}
    run.update(pgids=pgids, exits={k: dataclasses.asdict(v) for k, v in result.exits.items()})
    return _outcome(result, plan, console)


def _check(inventory: Inventory, job: Job, templates: Templates, backend: Backend, run: RunDir,
           argv: list[str], console: Console) -> tuple[LaunchPlan, dict[str, dict[str, Any]]]:
    """Phase one, retrying with the next derived port when the master's port is taken."""
    chosen = job.master_port or inventory.master.master_port
    for attempt in range(PORT_ATTEMPTS):
        if not chosen:
            job = dataclasses.replace(job, master_port=derived_port(job.run_id, attempt))
        plan = render(inventory, job, templates)
        run.record(plan, inventory, backend.name, argv)
        facts = backend.check(plan)
        master = facts[plan.nodes[0].host.name]
        if master.get("port_free", True):
            return plan, facts
        if chosen:
            raise PreflightError(f"port {plan.master_port} is in use on the master "
                                 f"{plan.nodes[0].host.name} ({plan.master_addr}); "
                                 f"choose another master_port")
        console.info(f"port {plan.master_port} is in use on {plan.nodes[0].host.name}; trying another")
    raise PreflightError(f"no free master port on {plan.master_addr} after {PORT_ATTEMPTS} tries")


def _outcome(result: Any, plan: LaunchPlan, console: Console) -> int:
    left = result.leftovers()
    if left:
        console.info(f"WARNING: processes of run {plan.run_id} still alive: {left}")
    if result.interrupted:
        raise Interrupted(f"interrupted; every node of run {plan.run_id} was stopped"
                          + (f" except {left}" if left else ""))
    if result.first_failure:
        label, ex = result.first_failure
        stopped = len(result.stops)
        msg = (f"node [{label}] failed: {ex.describe()}; "
               f"{'stopped the other ' + str(stopped) + ' node(s)' if stopped else 'no other node was running'}"
               f" (logs: runs/{plan.run_id}/logs/)")
        raise (NodeLost if ex.lost else RunFailed)(msg)
    console.info(f"run {plan.run_id}: all {len(plan.nodes)} node(s) finished")
    return 0
