"""`cluster up`: render, check every node, start every node, stream, stop all on failure."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import click

from . import common
from .main import CONTEXT, SafePath, argv, main
from .. import launch
from ..backends.slurm import cli_settings
from ..console import Console
from ..errors import InputError
from ..plan import Job, Templates
from ..runs import RunDir, new_run_id
from ..spec import Inventory, check_text


@main.command(context_settings={**CONTEXT, "allow_interspersed_args": False})
@click.option("-i", "--inventory", "inventory_path", type=SafePath(dir_okay=False),
              help="Hosts: YAML inventory, MPI/DeepSpeed hostfile. None: this machine.")
@click.option("--nodes", type=int, help="Use the first N selected hosts (or N simulated local nodes).")
@click.option("--hosts", help="Only these hosts: names or hostlists, e.g. gpu[01-04],cpu1.")
@click.option("--exclude", help="Leave out these hosts (names or hostlists).")
@click.option("--backend", type=click.Choice(["local", "ssh", "slurm"]),
              help="Where to run. Default: the inventory's 'backend', else ssh; local with no inventory.")
@click.option("--local", "force_local", is_flag=True, help="Run on this machine (same as --backend local).")
@click.option("--dry-run", is_flag=True, help="Render and record the plan, print every script; contact nothing.")
@click.option("--detach", is_flag=True, help="Start and return; use status/logs/down later.")
@click.option("--no-preflight", is_flag=True,
              help="Skip the cross-node checks (same torch, every node reaching the master port) "
                   "and let each node choose its interface at start.")
@click.option("--templates", "templates_dir", type=SafePath(file_okay=False),
              help="A directory whose templates override the built-in ones by name.")
@click.option("--nproc-per-node", type=int, help="Processes per node (overrides the inventory).")
@click.option("--master-port", type=click.IntRange(1, 65535), help="Rendezvous port on the first node.")
@click.option("--env", "env_pairs", multiple=True, metavar="KEY=VALUE", help="Extra environment (repeatable).")
@click.option("--secret-env", "secret_names", multiple=True, metavar="NAME",
              help="Pass NAME from this shell to every node without writing its value anywhere (repeatable).")
@click.option("--max-restarts", type=click.IntRange(0), metavar="N",
              help="After a failure, start the whole job again up to N times (default: the "
                   "inventory's restarts, else 0). Not after a failure before every node joined.")
@click.option("--restart-after", type=click.FloatRange(min=0), metavar="SECONDS",
              help="A failure in the first SECONDS of running is configuration: never restarted.")
@click.option("--min-nodes", type=click.IntRange(1), metavar="M",
              help="Leave a lost node out of the next attempt while M nodes remain.")
@click.option("--hang-timeout", type=click.FloatRange(min=0), metavar="SECONDS",
              help="No progress on any node for SECONDS: collect every rank's stack, then stop "
                   "(or restart). Default: the inventory's hang_timeout, else off.")
@click.option("--stop-grace", type=click.FloatRange(min=0, min_open=True), metavar="SECONDS",
              help="SIGTERM to SIGKILL when stopping a node (default 30; the inventory's stop_grace).")
@click.option("--keepalive", type=click.FloatRange(min=0, min_open=True), metavar="SECONDS",
              help="SSH: silence after which a node counts as lost, and a node stops itself "
                   "without the launcher (default 60; the inventory's ssh.keepalive).")
@click.option("--sync", "sync_dir", type=SafePath(file_okay=False, exists=True),
              help="SSH: copy this directory into every node's workdir first (unchanged files skipped).")
@click.option("--sync-exclude", multiple=True, metavar="PATTERN",
              help="Leave out of --sync what matches (gitignore syntax, repeatable); "
                   "DIR/.clusterignore, else DIR/.gitignore, is honoured too.")
@click.option("--host-key-policy", type=click.Choice(["strict", "accept-new", "off"]),
              help="SSH host keys: strict (default) needs known_hosts to match.")
@click.option("--partition", help="SLURM partition.")
@click.option("--time", "time_limit", help="SLURM time limit, e.g. 01:00:00.")
@click.option("--account", help="SLURM account.")
@click.option("--max-requeues", type=click.IntRange(0), help="SLURM: requeue at most this often.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def up(**opts: Any) -> None:
    """Start SCRIPT [ARGS...] with torchrun on every node (default: train/train.py)."""
    o = UpOptions(**opts)
    extra_env = common.parse_env(o.env_pairs)
    secrets = common.parse_secret_names(o.secret_names, extra_env)
    for what, value in (("--partition", o.partition), ("--time", o.time_limit),
                        ("--account", o.account), ("SCRIPT", o.command[0] if o.command else None)):
        if value is not None:
            check_text(value, what)
    templates = Templates(o.templates_dir)
    name = common.backend_name(o.backend, o.force_local)
    inventory = common.inventory(o.inventory_path, o.hosts, o.exclude, o.nodes, name,
                                 o.nproc_per_node, extra_env)
    inventory = common.settings(inventory, secrets, o.stop_grace, o.keepalive, o.host_key_policy)
    name = name or inventory.backend
    if name == "slurm":
        inventory = _slurm(inventory, o)
    launch.secret_values(inventory)          # a missing secret stops here: nothing is created
    if (o.sync_dir or o.sync_exclude) and name != "ssh":
        raise InputError("--sync is for the ssh backend (local and SLURM nodes see this filesystem)")
    run_id = new_run_id()
    script, args, code_dir = common.command(o.command, name, run_id)
    job = Job(run_id=run_id, script=script, args=args, master_port=o.master_port)
    # --sync DIR lands in each node's workdir; the built-in trainer in <workdir>/cluster-train.
    sync = [(d, sub) for d, sub in ((o.sync_dir, "."), (code_dir, "cluster-train")) if d]
    backend = common.backend(name, inventory, sync=sync, sync_exclude=o.sync_exclude)
    console = Console()
    try:
        backend.plan(inventory, job, templates)  # bad input fails here, before anything is written
        run = RunDir.create(run_id)
        if name == "local":
            job = dataclasses.replace(job, node_root=str((run.path / "nodes").resolve()))
        if o.dry_run:
            launch.dry_run(inventory, job, templates, run, backend, argv(), console)
            return
        launch.up(inventory, job, templates, backend, run, argv(), console, launch.Options(
            detach=o.detach, preflight=not o.no_preflight,
            restarts=inventory.restarts if o.max_restarts is None else o.max_restarts,
            restart_after=o.restart_after or 0.0, min_nodes=o.min_nodes,
            hang_timeout=inventory.hang_timeout if o.hang_timeout is None else o.hang_timeout))
    finally:
        backend.close()


def _slurm(inventory: Inventory, o: "UpOptions") -> Inventory:
    """The command line's SLURM options over the inventory's; what SLURM itself does instead
    (requeues, its own node choice) refused where cluster's version would not apply."""
    if o.max_restarts or o.min_nodes or o.hang_timeout or inventory.restarts or inventory.hang_timeout:
        raise InputError("--max-restarts, --min-nodes and --hang-timeout are for local and SSH "
                         "runs; under SLURM a job requeues itself (--max-requeues)")
    count = None if inventory.slurm.nodelist else o.nodes      # a nodelist fixed the count
    settings = cli_settings(inventory.slurm, nodes=count, partition=o.partition,
                            time=o.time_limit, account=o.account, max_requeues=o.max_requeues)
    return dataclasses.replace(inventory, slurm=settings)


@dataclass(frozen=True)
class UpOptions:
    """`cluster up`'s options, as click parsed them."""
    inventory_path: str | None
    nodes: int | None
    hosts: str | None
    exclude: str | None
    backend: str | None
    force_local: bool
    dry_run: bool
    detach: bool
    no_preflight: bool
    templates_dir: str | None
    nproc_per_node: int | None
    master_port: int | None
    env_pairs: tuple[str, ...]
    secret_names: tuple[str, ...]
    max_restarts: int | None
    restart_after: float | None
    min_nodes: int | None
    hang_timeout: float | None
    stop_grace: float | None
    keepalive: float | None
    sync_dir: str | None
    sync_exclude: tuple[str, ...]
    host_key_policy: str | None
    partition: str | None
    time_limit: str | None
    account: str | None
    max_requeues: int | None
    command: tuple[str, ...]
