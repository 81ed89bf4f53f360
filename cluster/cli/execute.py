"""`cluster exec -- CMD [ARGS...]`: one command on every node at once, output prefixed by node."""
from __future__ import annotations

import click

from .. import backends, resolve
from ..backends import EXEC, supports, with_exec
from ..request import Request
from .main import CONTEXT, SafePath, host_options, main
from ..console import Console
from ..errors import InputError


@main.command("exec", context_settings={**CONTEXT, "allow_interspersed_args": False})
@click.option("-i", "--inventory", "inventory_path", type=SafePath(dir_okay=False),
              help="Hosts: YAML inventory, MPI/DeepSpeed hostfile. None: this machine.")
@click.option("--nodes", type=int, help="Only the first N selected hosts (or N simulated local nodes).")
@click.option("--hosts", help="Only these hosts: names or hostlists.")
@click.option("--exclude", help="Leave out these hosts.")
@host_options
@click.option("--local", "force_local", is_flag=True, help="Run on this machine.")
@click.option("--host-key-policy", type=click.Choice(["strict", "accept-new", "off"]))
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def exec_(inventory_path: str | None, nodes: int | None, hosts: str | None, exclude: str | None,
          python: str | None, user: str | None, port: int | None, identity_file: str | None,
          force_local: bool, host_key_policy: str | None, command: tuple[str, ...]) -> None:
    """Run CMD [ARGS...] on every node at once, each output line prefixed [node].

    Each argument reaches the node as one argument, never through a shell: for shell code
    use `cluster exec -- bash -c '...'`. Exit 0 when every node exited 0; 4 when one did
    not, 3 when one could not be reached. Ctrl-C stops the command on every node.
    """
    from .. import execute
    request = Request(inventory_path=inventory_path, nodes=nodes, hosts=hosts, exclude=exclude,
                      python=python, user=user, port=port, identity_file=identity_file,
                      force_local=force_local, host_key_policy=host_key_policy)
    name, inventory = resolve.where(request)
    if not supports(name, EXEC):
        raise InputError("cluster exec runs over SSH or on this machine; under SLURM, run "
                         "`srun --nodes N --ntasks-per-node 1 CMD` inside an allocation, or "
                         "`cluster exec --hosts <the allocated hosts> -- CMD` over SSH")
    backend = backends.create(name, inventory, request)
    try:
        execute.run(inventory.hosts, with_exec(backend), command, Console())
    finally:
        backend.close()
