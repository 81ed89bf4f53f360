"""`cluster up`: render, check every node, start every node, stream, stop all on failure.
The options are cluster.api's Request; the work is cluster.api's."""
from __future__ import annotations

from typing import Any

import click

from . import STARTED
from .main import CONTEXT, NotifyUrl, SafePath, argv, host_options, main
from .. import api, resolve
from ..observe import hang_timeout
from ..backends import NAMES
from ..console import Console
from ..errors import InputError


class UpCommand(click.Command):
    """`cluster up`, whose options end at the script: every word after it is the script's.
    A cluster option among those words was most likely meant for cluster (`cluster up -i inv.yaml
    train.py --dry-run`): --dry-run is refused (the job would start for real), others warned
    about. Not when an explicit `--` came before the script, or before those words."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        given = list(args)                       # the parser consumes the list it is given
        rest = super().parse_args(ctx, args)
        command = tuple(ctx.params.get("command") or ())
        after_dashes = len(given) > len(command) and given[-len(command) - 1] == "--"
        if command and not after_dashes and not ctx.resilient_parsing:
            check_script_args(command[0], command[1:], self.own_options())
        return rest

    def own_options(self) -> set[str]:
        return {o for p in self.params if isinstance(p, click.Option) for o in p.opts + p.secondary_opts} \
            | set(CONTEXT["help_option_names"])


def check_script_args(script: str, args: tuple[str, ...], own: set[str]) -> None:
    words = args[:args.index("--")] if "--" in args else args
    mine = [w for w in words if w.split("=", 1)[0] in own]
    if any(w.split("=", 1)[0] == "--dry-run" for w in mine):
        raise InputError(f"--dry-run after the script goes to the script ({script}), and the job "
                         f"would start for real; put cluster's options before the script, or use "
                         f"-- if the script takes --dry-run itself (cluster up [OPTIONS] -- "
                         f"{script} --dry-run)")
    if mine:
        click.echo(f"cluster: warning: {' '.join(mine)} after the script go to the script "
                   f"({script}), not to cluster; put cluster's options before the script (or "
                   f"use -- before the script to say they are its own)", err=True)


class HangTimeout(click.ParamType):
    """--hang-timeout: 'auto', or seconds >= 0."""
    name = "seconds|auto"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if value == hang_timeout.AUTO or isinstance(value, float):
            return value
        try:
            seconds = float(value)
        except ValueError:
            seconds = -1.0
        if not hang_timeout.valid(seconds):
            self.fail(f"{value!r} is not 'auto' or a number of seconds >= 0", param, ctx)
        return seconds


@main.command(cls=UpCommand, context_settings={**CONTEXT, "allow_interspersed_args": False})
@click.option("-i", "--inventory", "inventory_path", type=SafePath(dir_okay=False),
              help="Hosts: YAML inventory, MPI/DeepSpeed hostfile. None: this machine.")
@click.option("--nodes", type=int, help="Use the first N selected hosts (or N simulated local nodes).")
@click.option("--hosts", help="Only these hosts: names or hostlists, e.g. gpu[01-04],cpu1.")
@click.option("--exclude", help="Leave out these hosts (names or hostlists).")
@host_options
@click.option("--backend", type=click.Choice(list(NAMES)),
              help="Where to run. Default: the inventory's 'backend', else ssh; local with no inventory.")
@click.option("--local", "force_local", is_flag=True, help="Run on this machine (same as --backend local).")
@click.option("--dry-run", is_flag=True, help="Render and record the plan, print every script; contact nothing.")
@click.option("--detach", is_flag=True, help="Start and return; use status/logs/down later.")
@click.option("--no-preflight", is_flag=True,
              help="Skip the cross-node checks (same torch, every node reaching the master port) "
                   "and let each node choose its interface at start.")
@click.option("--gate", type=click.Choice(["off", "basic", "deep"]),
              help="The health gate before every start and restart: basic (default) fails a node "
                   "whose GPUs are missing, lost, held by another process, or show ECC or XID "
                   "errors, or whose disk or memory is short; off skips it (the inventory's gate).")
@click.option("--no-tuning", is_flag=True,
              help="Ignore the NCCL socket settings `cluster doctor --tune-nccl` measured for these nodes.")
@click.option("--templates", "templates_dir", type=SafePath(file_okay=False),
              help="A directory whose templates override the built-in ones by name.")
@click.option("--nproc-per-node", type=int, help="Processes per node (overrides the inventory).")
@click.option("--master-port", type=click.IntRange(1, 65535), help="Rendezvous port on the first node.")
@click.option("--env", "env_pairs", multiple=True, metavar="KEY=VALUE|NAME",
              help="Extra environment (repeatable); a NAME alone passes its value from this shell.")
@click.option("--env-file", "env_files", multiple=True, type=SafePath(dir_okay=False, exists=True),
              metavar="FILE", help="Extra environment from a dotenv file (KEY=VALUE lines; repeatable).")
@click.option("--secret-env", "secret_names", multiple=True, metavar="NAME",
              help="Pass NAME from this shell to every node, its value never in a script, record or "
                   "command line; under SLURM in a private file the job removes (repeatable).")
@click.option("--max-restarts", type=click.IntRange(0), metavar="N",
              help="After a failure, start the whole job again up to N times (default: the "
                   "inventory's restarts, else 0). Not after a failure before the rendezvous was complete. "
                   "Under SLURM the job requeues itself without the node that failed first; a "
                   "rank's exit code 93 stops it.")
@click.option("--restart-after", type=click.FloatRange(min=0), metavar="SECONDS",
              help="A failure in the first SECONDS of running is configuration: never restarted.")
@click.option("--min-nodes", type=click.IntRange(1), metavar="M",
              help="Leave a lost node out of the next attempt while M nodes remain.")
@click.option("--replace-slow", is_flag=True,
              help="A node named slow is set aside at the next restart, and a spare takes its "
                   "place (as a lost node's is taken).")
@click.option("--grow", is_flag=True,
              help="A job running below its size (--min-nodes) whose lost node answers again "
                   "restarts at full size at its next checkpoint, instead of at the next failure.")
@click.option("--hang-timeout", type=HangTimeout(), metavar="SECONDS|auto",
              help="No progress on any node for SECONDS: collect every rank's stack, then stop "
                   "(or restart); auto: learned from the job's heartbeats (the inventory's "
                   "hang_auto). Default: the inventory's hang_timeout, else off.")
@click.option("--metrics-port", metavar="[HOST:]PORT",
              help="Serve the run's live metrics (Prometheus text) at http://HOST:PORT/metrics "
                   "while it is watched; HOST is 127.0.0.1 unless given (0.0.0.0: every "
                   "interface), PORT 0 any free one (the inventory's metrics).")
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
@click.option("--sync-delete", is_flag=True,
              help="With --sync: remove from each node the files an earlier sync put there "
                   "that DIR no longer has (never excluded paths, never what the job wrote).")
@click.option("--host-key-policy", type=click.Choice(["strict", "accept-new", "off"]),
              help="SSH host keys: strict (default) needs known_hosts to match.")
@click.option("--notify", multiple=True, type=NotifyUrl(), metavar="URL",
              help="POST each alert of the run (a failure, a hang, a slow node, a restart, a "
                   "node set aside, the finish) as JSON to URL; a Slack webhook gets a message "
                   "(repeatable; with the inventory's notify; docs/alerts.md).")
@click.option("--partition", help="SLURM partition.")
@click.option("--time", "time_limit", help="SLURM time limit, e.g. 01:00:00.")
@click.option("--account", help="SLURM account.")
@click.option("--max-requeues", type=click.IntRange(0), help="SLURM: requeue at most this often.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def up(env_pairs: tuple[str, ...], env_files: tuple[str, ...], **opts: Any) -> None:
    """Start SCRIPT [ARGS...] with torchrun on every node (default: train/train.py; `-- --epochs 3`
    passes options to it)."""
    request = api.Request(env=resolve.parse_env(env_pairs, env_files), **opts)
    api.prepare(request, launched=STARTED).run(Console(), argv())
