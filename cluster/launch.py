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
       argv: list[str], console: Console, *, detach: bool = False,
       environ: Mapping[str, str] = os.environ) -> int:
    secrets = secret_values(inventory, environ)
    plan, facts = _check(inventory, job, templates, backend, run, argv, console)
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
           argv: list[str], console: Console) -> tuple[LaunchPlan, dict[str, dict[str, Any]]]:
    """Phase one, retrying with the next derived port when the master's port is taken."""
    chosen = job.master_port or inventory.master.master_port
    for attempt in range(PORT_ATTEMPTS):
        if not chosen:
            job = dataclasses.replace(job, master_port=derived_port(job.run_id, attempt))
        plan = render(inventory, job, templates)
        run.record(plan, inventory, backend.name, argv)
        facts = backend.check(plan)
        master = plan.master
        if facts[master.host.name].get("port_free", True):
            return plan, facts
        if chosen:
            raise PreflightError(f"port {plan.master_port} is in use on the master "
                                 f"{master.host.name} ({plan.master_addr}): another program "
                                 f"listens on it; choose another master_port")
        console.info(f"port {plan.master_port} is in use on {master.host.name}; trying another")
    raise PreflightError(f"no free master port on {plan.master_addr} after {PORT_ATTEMPTS} tries")


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
