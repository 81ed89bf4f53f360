"""`cluster doctor`: every node, and the network between them, checked before a run."""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import click

from .. import resolve
from ..backends import NODE_CHECKS, supports
from .main import CONTEXT, SafePath, host_options, main
from ..errors import InputError
from ..plan import Templates
from ..recovery.findings import WARN, Finding
from ..recovery.pool import ledger_for, quarantined_lines
from ..request import Request

if TYPE_CHECKING:
    from ..doctor import Report


@main.command(context_settings=CONTEXT)
@click.option("-i", "--inventory", "inventory_path", type=SafePath(dir_okay=False),
              help="Hosts: YAML inventory, MPI/DeepSpeed hostfile. None: this machine.")
@click.option("--nodes", type=int, help="Only the first N selected hosts.")
@click.option("--hosts", help="Only these hosts: names or hostlists.")
@click.option("--exclude", help="Leave out these hosts.")
@host_options
@click.option("--local", "force_local", is_flag=True, help="Check this machine (simulated nodes).")
@click.option("--master-port", type=click.IntRange(1, 65535), help="The port to check (default: derived).")
@click.option("--host-key-policy", type=click.Choice(["strict", "accept-new", "off"]))
@click.option("--deep", is_flag=True, help="Also run a collective across all nodes: sum, bandwidth, slow links.")
@click.option("--tune-nccl", is_flag=True,
              help="Measure NCCL's socket settings across the nodes and keep the best for `cluster up`.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (schema in docs/commands.md).")
def doctor(inventory_path: str | None, nodes: int | None, hosts: str | None, exclude: str | None,
           python: str | None, user: str | None, port: int | None, identity_file: str | None,
           force_local: bool, master_port: int | None, host_key_policy: str | None, deep: bool,
           tune_nccl: bool, as_json: bool) -> None:
    """Check every node, and the network between them, before a run: exit 0 only when nothing fails."""
    import time
    started = time.monotonic()          # the report's seconds: all the user waits for
    import json as json_mod
    from .. import doctor as doc
    request = Request(inventory_path=inventory_path, nodes=nodes, hosts=hosts, exclude=exclude,
                      python=python, user=user, port=port, identity_file=identity_file,
                      force_local=force_local, host_key_policy=host_key_policy)
    report = examine(request, deep=deep, tune_nccl=tune_nccl, master_port=master_port,
                     quiet=as_json, started=started)
    if as_json:
        click.echo(json_mod.dumps(report.to_json(), indent=2))
    else:
        click.echo(doc.render_text(report))
    if not report.ok:
        sys.exit(3)


def examine(request: Request, *, deep: bool, tune_nccl: bool = False,
            master_port: int | None = None, only: str | None = None, quiet: bool = False,
            started: float | None = None) -> Report:
    """The doctor's report (cluster.doctor.Report) on the request's nodes, narrowed to `only`
    (names or a hostlist) when given; its phases said on stderr, and the tuning rows unless
    quiet. `cluster nodes release` asks it about one node."""
    import dataclasses
    from .. import deep as deep_mod
    from .. import doctor as doc
    from .. import tuning
    name, inventory = resolve.where(request)
    if only is not None:
        inventory = inventory.select(hosts=only)
    if not supports(name, NODE_CHECKS):
        raise InputError("cluster doctor checks SSH or local nodes; under SLURM, run it inside "
                         "an allocation with the allocated hosts (--hosts)")
    if master_port:
        inventory = dataclasses.replace(inventory, hosts=tuple(
            h.replace(master_port=master_port) for h in inventory.hosts))
    templates = Templates()
    backend = resolve.backend(name, inventory, sync=[])
    measure = deep_mod.collective(inventory, backend, templates)
    backend.progress = progress = doc.PhaseLines(sys.stderr)

    def shown(row: tuning.Row) -> None:
        if not quiet:
            click.echo(f"cluster: {tuning.label(row.env)}: " + ", ".join(
                f"{gb:.3f} GB/s at {size / 2**20:.0f} MiB"
                for size, gb in sorted(row.busbw.items())), err=True)
    def tune() -> dict[str, Any]:
        # Each setting is a short launch with a line of its own (shown): its steps would say
        # the same bandwidths again, once per setting.
        return deep_mod.tune_nccl(
            inventory, lambda env: measure({**env, "CLUSTER_DOCTOR_PAIRS": "0"}, tuning.SIZES,
                                           10, show_steps=False),
            tuning.Cache(tuning.cache_path()), shown=shown)
    try:
        report = doc.diagnose(inventory, backend, templates, deep=deep,
                              run_deep=lambda run_id: measure({}, run_id=run_id),
                              run_tune=tune if tune_nccl else None, started=started)
        ledger = ledger_for(request.inventory_path, inventory.gate)
        report.findings += [Finding(node, "ledger", WARN, line)
                            for node, line in quarantined_lines(ledger, report.nodes)]
        return report
    finally:
        progress.close()
        backend.close()
