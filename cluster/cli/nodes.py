"""`cluster nodes`: each node's record across runs, as the node ledger judges it
(cluster/recovery/ledger.py), and `cluster nodes release NODE` after a deep check."""
from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

import click

from .. import backends, resolve
from ..backends import NODE_CHECKS, supports
from ..backends.local import local_inventory
from ..console import Console
from ..errors import InputError, PreflightError
from ..recovery.ledger import STRIKE_KINDS, Ledger, NodeState
from ..recovery.pool import ledger_for
from ..request import Request
from ..spec import Gate, Inventory
from .main import CONTEXT, SafePath, main

if TYPE_CHECKING:
    from ..doctor import Report

SCHEMA = 1


def ledger_of(path: str | None, inventory: Inventory | None) -> Ledger:
    """The inventory's ledger, judged by its gate's quarantine settings."""
    return ledger_for(path, inventory.gate if inventory is not None else Gate())


@main.group(context_settings=CONTEXT, invoke_without_command=True)
@click.option("-i", "--inventory", "inventory_path", type=SafePath(dir_okay=False),
              help="The inventory whose nodes' ledger to read. None: this machine.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output, one JSON object.")
@click.pass_context
def nodes(ctx: click.Context, inventory_path: str | None, as_json: bool) -> None:
    """Each node of the inventory across runs: healthy or quarantined, why, since when, its
    strikes in the window and its last runs. `cluster nodes release NODE` lets one back in."""
    ctx.obj = inventory_path              # release's inventory, when given before it
    if ctx.invoked_subcommand is not None:
        return
    found = resolve.loaded(inventory_path, None)
    ledger = ledger_of(inventory_path, found)
    listed, fixed = names_of(found)
    known = ledger.all()
    states = {n: known.get(n) or NodeState(n) for n in [*listed, *sorted(set(known) - set(listed))]}
    # Without a list of hosts (this machine's simulated nodes come and go with --nodes; SLURM
    # may choose them) no node is "no longer in the inventory".
    gone = set(states) - set(listed) if fixed else set()
    if as_json:
        click.echo(json.dumps(as_object(ledger, states, gone), indent=2))
    else:
        show(ledger, states, gone, time.time())


@nodes.command(context_settings=CONTEXT)
@click.argument("node")
@click.option("-i", "--inventory", "inventory_path", type=SafePath(dir_okay=False),
              help="The inventory the node is in. None: this machine.")
@click.option("--force", is_flag=True, help="Release it without the deep check.")
@click.pass_context
def release(ctx: click.Context, node: str, inventory_path: str | None, force: bool) -> None:
    """Let a quarantined NODE back in: only when the deep check (cluster doctor --deep on that
    node) finds nothing failing (exit 3 otherwise, and it stays quarantined)."""
    inventory_path = inventory_path or ctx.obj
    ledger = ledger_of(inventory_path, resolve.loaded(inventory_path, None))
    state = ledger.node(node)
    console = Console()
    if not state.quarantined:
        console.info(f"{node} is not quarantined ({state.strikes} strike(s) in the last "
                     f"{hours(ledger.policy.window_s)}): nothing to release")
        return
    if force:
        ledger.release(node, "released with --force, without the deep check")
        console.info(f"{node} released without the deep check (--force); it had "
                     f"{state.strikes} strike(s): " + "; ".join(state.why))
        return
    report = deep_check(node, inventory_path)
    failed = [f for f in report.findings if f.status == "fail"]
    if failed:
        raise PreflightError(
            f"{node} stays quarantined: the deep check failed ("
            + ", ".join(dict.fromkeys(f.check for f in failed)) + ")",
            details="\n".join(f"FAIL {f.node}: {f.check}: {f.detail}"
                              + (f"\n     fix: {f.fix}" if f.fix else "") for f in failed))
    ledger.release(node, f"the deep check passed in {report.seconds:.1f} s")
    console.info(f"{node} released: the deep check passed in {report.seconds:.1f} s")


def deep_check(node: str, inventory_path: str | None) -> Report:
    """`cluster doctor --deep --hosts NODE`'s report; InputError, naming --force, for a node
    it cannot check (not in the inventory, or one SLURM allocates)."""
    from .doctor import examine
    force = f"`cluster nodes release {node} --force`"
    inventory = resolve.loaded(inventory_path, None)
    if not supports(backends.choose(None, False, inventory), NODE_CHECKS):
        raise InputError(f"the deep check runs over SSH or on this machine, not under SLURM: run "
                         f"`cluster doctor --deep --hosts {node}` inside an allocation, then "
                         f"{force}")
    listed, _ = names_of(inventory)
    if node not in listed:
        where = inventory_path or "the nodes of this machine"
        raise InputError(f"{node} is not in {where} (nodes: {', '.join(listed) or 'none listed'}), "
                         f"so it cannot be checked; {force} releases it unchecked")
    return examine(Request(inventory_path=inventory_path), deep=True, only=node)


def names_of(inventory: Inventory | None) -> tuple[list[str], bool]:
    """The inventory's host names, and whether they are all its nodes can be: this machine's
    node without a file (others come with --nodes), none when SLURM chooses them."""
    if inventory is None:
        return [h.name for h in local_inventory(1, gpus=[]).hosts], False
    if not inventory.hosts_given:
        return [], False
    return [h.name for h in inventory.hosts], True


def as_object(ledger: Ledger, states: Mapping[str, NodeState], gone: set[str]) -> dict:
    return {"schema": SCHEMA, "ledger": str(ledger.path),
            "policy": {"strikes": ledger.policy.strikes, "window_s": ledger.policy.window_s},
            "nodes": {n: {**s.to_json(), "in_inventory": n not in gone} for n, s in states.items()}}


def show(ledger: Ledger, states: Mapping[str, NodeState], gone: set[str], now: float) -> None:
    from rich.console import Console as RichConsole
    from rich.table import Table
    from ..observe.top import fit
    policy = ledger.policy
    table = Table(title=f"nodes: {sum(s.quarantined for s in states.values())} quarantined "
                        f"of {len(states)}")
    for col in ("node", "state", "since", f"strikes ({hours(policy.window_s)})", "why",
                "last runs"):
        table.add_column(col, no_wrap=col in ("node", "state"))
    for name, s in states.items():
        table.add_row(name + (" (not in the inventory)" if name in gone else ""), s.status,
                      when(s.since, now), str(s.strikes), "\n".join(reasons(s, now)),
                      "\n".join(f"{run} {kind}" for run, kind in s.last_runs))
    out = RichConsole(highlight=False)
    fit(out, table)
    out.print(table)
    out.print(f"A node is quarantined after {policy.strikes} strikes "
              f"({', '.join(sorted(STRIKE_KINDS))}) within {hours(policy.window_s)}; "
              f"the ledger: {ledger.path}", markup=False, soft_wrap=True)


def reasons(s: NodeState, now: float) -> list[str]:
    """Its strikes in the window, one a line; a released node's release when it has none."""
    if not s.why and s.released is not None:
        return [f"released {when(s.released, now)}: {s.released_why}"]
    return list(s.why)


def when(t: float | None, now: float) -> str:
    """'2024-12-06 14:02 (2 h ago)' in local time; '' for none."""
    if t is None:
        return ""
    return f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(t))} ({ago(now - t)} ago)"


def ago(seconds: float) -> str:
    """'45 s', '12 min', '5 h', '3 d': each unit from two of it on."""
    s = max(int(seconds), 0)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= 2 * size:
            return f"{s // size} {unit}"
    return f"{s} s"


def hours(seconds: float) -> str:
    return f"{seconds / 3600:g} h"
