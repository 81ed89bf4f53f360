"""The flow every supervised backend shares: render, record, check all, start all, watch."""
from __future__ import annotations

import dataclasses
import os
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .backends import Backend
from .errors import InputError, Interrupted, NodeLost, PreflightError, RunFailed
from .spec import Inventory
from .plan import Job, LaunchPlan, Templates, derived_port, render
from .preflight import WARN, Finding, evaluate, failures
from .hang import summary as hang_summary
from .runs import RunDir, make_private_dir, write_private
from .watch import Console, Hang, Watcher, WatchResult

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


@dataclass(frozen=True)
class Options:
    """How `cluster up` runs a job, beyond what to run and where."""
    detach: bool = False
    preflight: bool = True        # cross-node checks and the interface written into each script
    restarts: int = 0             # whole-job restarts after a failure, one budget for the job
    restart_after: float = 0.0    # failures in the first S seconds are configuration: no restart
    min_nodes: int | None = None  # a lost node is left out of the next attempt while this many remain
    hang_timeout: float = 0.0     # no progress anywhere for this long: stacks, then stop


def up(inventory: Inventory, job: Job, templates: Templates, backend: Backend, run: RunDir,
       argv: list[str], console: Console, options: Options = Options(),
       environ: Mapping[str, str] = os.environ) -> int:
    """Check, start, watch; after a failure, with restarts left, the whole job again on a
    fresh rendezvous (CLUSTER_RESTART_COUNT on the nodes), leaving lost nodes out while
    options.min_nodes remain."""
    secrets = secret_values(inventory, environ)
    history: list[dict[str, Any]] = []
    while True:
        job = dataclasses.replace(job, attempt=len(history))
        inventory, plan = _check_leaving_out(inventory, job, templates, backend, run, argv,
                                             console, options, history)
        console.info(f"run {plan.run_id}: starting {len(plan.nodes)} node(s), master "
                     f"{plan.master_addr}:{plan.master_port}"
                     + (f" (attempt {job.attempt + 1} of {options.restarts + 1})" if job.attempt else ""))
        procs = backend.start(plan, detach=options.detach, secrets=secrets)
        if options.detach:
            run.update(pgids={n.host.name: p for n, p in zip(plan.nodes, procs)})
            console.info(f"detached; follow with `cluster logs -f {plan.run_id}`, "
                         f"stop with `cluster down {plan.run_id}`")
            return 0
        result = Watcher(procs, console, {n.label: run.log_path(n) for n in plan.nodes},
                         settle=plan.stop_grace + 30, hang_timeout=options.hang_timeout).run()
        _record(run, plan, procs, result, history, console)
        retry = _retry(result, plan, options, history)
        if retry is None:
            return _outcome(result, plan, console)
        console.info(retry)
        inventory = _without_lost(inventory, result, options)


def _check_leaving_out(inventory: Inventory, job: Job, templates: Templates, backend: Backend,
                       run: RunDir, argv: list[str], console: Console, options: Options,
                       history: list[dict[str, Any]]) -> tuple[Inventory, LaunchPlan]:
    """The check phase; at a relaunch, a node that fails it is left out while min_nodes remain."""
    while True:
        try:
            plan, facts = _check(inventory, job, templates, backend, run, argv, console,
                                 options.preflight)
            break
        except PreflightError as exc:
            bad = set(getattr(exc, "nodes", ()))
            keep = tuple(h for h in inventory.hosts if h.name not in bad)
            if not history or not bad or not options.min_nodes or len(keep) < options.min_nodes:
                raise
            console.info(f"leaving out {', '.join(sorted(bad))}, which failed the check; "
                         f"{len(keep)} node(s) remain (--min-nodes {options.min_nodes})")
            inventory = dataclasses.replace(inventory, hosts=keep)
    nodes = [dict(rank=n.rank, name=n.host.name, address=n.host.address, run_dir=n.run_dir,
                  dir=facts[n.host.name]["dir"], hostname=facts[n.host.name].get("hostname"))
             for n in plan.nodes]
    run.update(nodes=nodes, detached=options.detach, attempt=job.attempt, attempts=history)
    return inventory, plan


def _record(run: RunDir, plan: LaunchPlan, procs: list[Any], result: WatchResult,
            history: list[dict[str, Any]], console: Console) -> None:
    """run.json: this attempt's exits and how it ended; the hang evidence under hang/."""
    if result.hang is not None:
        _save_hang(run, plan, result.hang, console)
    history.append({"attempt": len(history), "nodes": [n.host.name for n in plan.nodes],
                    "ended": _ending(result), "joined": sorted(result.joined),
                    "seconds": round(time.monotonic() - result.started, 1)})
    pgids = {p.node.host.name: getattr(p, "pgid", None) for p in procs}
    run.update(pgids=pgids, exits={k: dataclasses.asdict(v) for k, v in result.exits.items()},
               interrupted=signal.Signals(result.signum).name if result.interrupted else None,
               attempts=history)


def _ending(result: WatchResult) -> str:
    if result.interrupted:
        return f"interrupted ({signal.Signals(result.signum).name})"
    if result.hang is not None:
        return f"hang: no progress for {result.hang.seconds:.0f} s"
    if result.first_failure:
        label, ex = result.first_failure
        return f"node [{label}] failed: {ex.describe()}"
    return "finished"


def _retry(result: WatchResult, plan: LaunchPlan, options: Options,
           history: list[dict[str, Any]]) -> str | None:
    """Why the job starts again, or None when it does not."""
    if result.ok or result.interrupted or len(history) > options.restarts:
        return None
    elapsed = time.monotonic() - result.started
    everyone = {n.label for n in plan.nodes}
    if result.joined != everyone or elapsed < options.restart_after:
        result.not_retried = (                                    # type: ignore[attr-defined]
            "it failed before every node had joined the rendezvous" if result.joined != everyone
            else f"it failed in its first {options.restart_after:g} s (--restart-after)")
        return None
    left = options.restarts - len(history) + 1
    return (f"{_ending(result)}; restarting the whole job on a fresh rendezvous "
            f"({left} restart(s) left)")


def _without_lost(inventory: Inventory, result: WatchResult, options: Options) -> Inventory:
    lost = {label.rsplit(" ", 1)[0] for label, ex in result.exits.items() if ex.lost}
    keep = tuple(h for h in inventory.hosts if h.name not in lost)
    if lost and options.min_nodes and len(keep) >= options.min_nodes:
        return dataclasses.replace(inventory, hosts=keep)
    return inventory


def _save_hang(run: RunDir, plan: LaunchPlan, hang: Hang, console: Console) -> None:
    folder = run.path / "hang"
    make_private_dir(folder)
    for label, records in hang.stacks.items():
        node = label.rsplit(" ", 1)[0]
        for rec in records:
            write_private(folder / f"{node}-rank{rec['rank']}.txt",
                          f"# {rec.get('how')} stack of rank {rec['rank']} (pid {rec.get('pid')}) "
                          f"on {node}\n{rec.get('text', '')}")
    lines = hang_summary(hang.stacks)
    write_private(folder / "summary.txt", "\n".join(lines) + "\n")
    console.info(f"where every rank was after {hang.seconds:.0f} s without progress "
                 f"(stacks in {folder}/):")
    for line in lines:
        console.info(f"  {line}")


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
    port_free = facts[plan.master.host.name].get("port_free", True)
    findings = evaluate(plan, facts, backend.reach(plan) if preflight and port_free else None)
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
        error = PreflightError(f"{len(bad)} check(s) failed on {', '.join(named)} "
                               f"({nodes} node(s) checked); nothing was started", details=lines)
        error.nodes = [n for n in named if n != "all"]
        raise error


def _outcome(result: Any, plan: LaunchPlan, console: Console) -> int:
    left = result.leftovers()
    if left:
        console.info(f"WARNING: processes of run {plan.run_id} still alive: {left}")
    if result.interrupted:
        name = signal.Signals(result.signum).name
        raise Interrupted(f"interrupted ({name}); every node of run {plan.run_id} was stopped"
                          + (f" except {left}" if left else ""), signum=result.signum)
    not_retried = getattr(result, "not_retried", None)
    why_not = (f"; not restarted: {not_retried}, which is configuration (a bad path, an "
               f"import error, a wrong interface) and would fail again") if not_retried else ""
    if result.hang is not None:
        raise RunFailed(f"run {plan.run_id} hung: no progress on any node for "
                        f"{result.hang.seconds:.0f} s; every node was stopped (stacks: "
                        f"runs/{plan.run_id}/hang/){why_not}")
    if result.first_failure:
        label, ex = result.first_failure
        stopped = len(result.stops)
        msg = (f"node [{label}] failed: {ex.describe()}; "
               f"{'stopped the other ' + str(stopped) + ' node(s)' if stopped else 'no other node was running'}"
               f" (logs: runs/{plan.run_id}/logs/)")
        if ex.lost:
            msg += (f"; if it is only cut off, [{label}] stops its own processes within "
                    f"ssh.keepalive of losing the launcher")
        raise (NodeLost if ex.lost else RunFailed)(msg + why_not)
    console.info(f"run {plan.run_id}: all {len(plan.nodes)} node(s) finished")
    return 0
