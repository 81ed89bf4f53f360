"""`cluster clean`: old run folders on the nodes and old run records here, never a running run."""
from __future__ import annotations

import click

from .. import backends, resolve
from ..backends import EXEC, NodeStatus, supports, with_exec
from ..request import Request
from .main import CONTEXT, SafePath, host_options, main
from ..console import Console
from ..errors import PreflightError
from ..runs import RunDir, runs_root


@main.command(context_settings=CONTEXT)
@click.option("-i", "--inventory", "inventory_path", type=SafePath(dir_okay=False),
              help="Also clean these hosts' <workdir>/.cluster folders (YAML inventory or hostfile).")
@click.option("--nodes", type=int, help="Only the first N selected hosts.")
@click.option("--hosts", help="Also clean these hosts (names or hostlists).")
@click.option("--exclude", help="Leave out these hosts.")
@host_options
@click.option("--older-than", "older_than", default="7d", show_default=True, metavar="DURATION",
              help="Only what was last active longer ago than this: 7d, 12h, 30m, 0 for all.")
@click.option("--dry-run", is_flag=True, help="List what would be removed; remove nothing.")
@click.option("--host-key-policy", type=click.Choice(["strict", "accept-new", "off"]))
def clean(inventory_path: str | None, nodes: int | None, hosts: str | None, exclude: str | None,
          python: str | None, user: str | None, port: int | None, identity_file: str | None,
          older_than: str, dry_run: bool, host_key_policy: str | None) -> None:
    """Remove old run records in ./runs and, with -i or --hosts, old run folders on the nodes
    (<workdir>/.cluster/<run-id>); a running run is never touched. Lists what goes and stays."""
    from .. import clean as cl
    seconds = cl.parse_duration(older_than)
    console = Console()
    decisions: list[cl.Decision] = []
    failed: dict[str, str] = {}
    if inventory_path or hosts:
        request = Request(inventory_path=inventory_path, nodes=nodes, hosts=hosts,
                          exclude=exclude, python=python, user=user, port=port,
                          identity_file=identity_file, host_key_policy=host_key_policy)
        name, inventory = resolve.where(request)
        if not supports(name, EXEC):
            console.info("SLURM nodes keep no run folders of cluster's: their runs' files are "
                         "in the records here")
        else:
            backend = backends.create(name, inventory, request)
            try:
                decisions, failed = cl.clean_nodes(inventory.hosts, with_exec(backend), seconds,
                                                   dry_run)
            finally:
                backend.close()
    else:
        console.info("nodes not swept: give -i INVENTORY (or --hosts) to clean their "
                     "<workdir>/.cluster folders too")
    secrets = cl.clean_secrets(runs_root(), dry_run, _leftover_secrets, _forget_secrets)
    going = {d.path for d in secrets if d.action != "kept"}
    decisions += secrets
    decisions += cl.clean_records(runs_root(), seconds, dry_run,
                                  lambda run: _recorded_status(run, dry_run), secrets_going=going)
    for d in decisions:
        click.echo(d.line())
    _summary(decisions, dry_run, console)
    if failed:
        raise PreflightError(f"{len(failed)} node(s) could not be cleaned",
                             details="\n".join(f"  {n}: {why}" for n, why in failed.items()))


def _recorded_status(run: RunDir, dry_run: bool) -> list[NodeStatus]:
    backend = backends.recorded(run)
    if dry_run and hasattr(backend, "forget_ended_secrets"):
        backend.forget_ended_secrets = False        # a dry run changes nothing
    try:
        return backend.status(run)
    finally:
        backend.close()


def _leftover_secrets(run: RunDir) -> str | None:
    """None: no secrets of the run left on disk; "": they may go; else why they stay."""
    backend = backends.recorded(run)
    try:
        left = getattr(backend, "leftover_secrets", None)
        return left(run) if left is not None else None
    finally:
        backend.close()


def _forget_secrets(run: RunDir) -> str:
    backend = backends.recorded(run)
    try:
        return str(getattr(backend, "forget_run_secrets")(run))
    finally:
        backend.close()


def _summary(decisions: list, dry_run: bool, console: Console) -> None:
    gone = [d for d in decisions if d.action != "kept"]
    kept = len(decisions) - len(gone)
    size = sum(d.size or 0 for d in gone)
    from ..clean import human_bytes
    verb = "would remove" if dry_run else "removed"
    console.info(f"{verb} {len(gone)} run folder(s) ({human_bytes(size)}), kept {kept}"
                 + ("; nothing was removed (--dry-run)" if dry_run else ""))
