"""The torchrun options cluster decides itself, so that `torchrun_args` may not set them.

They belong to the plan (cluster.plan writes torchrun's command line); they sit here, below the
inventory, so that the inventory can refuse them at load with the file's line.
"""
from __future__ import annotations

from typing import Sequence

# Nodes, ranks and the rendezvous: both spellings (--nproc_per_node, --nproc-per-node).
TORCHRUN_OWNED = frozenset(o for name in ("nnodes", "nproc_per_node", "node_rank", "rdzv_backend",
                                          "rdzv_endpoint", "rdzv_id", "master_addr", "master_port",
                                          "local_addr", "standalone")
                           for o in (f"--{name}", f"--{name.replace('_', '-')}"))


def owned_torchrun_option(arg: str) -> str | None:
    """The option of one torchrun argument ('--nnodes=2': '--nnodes') if cluster sets it itself."""
    option = arg.split("=", 1)[0]
    return option if option in TORCHRUN_OWNED else None


def last_value(args: Sequence[str], *names: str) -> str | None:
    """The value of the last of `names` in a command line (`--x V` or `--x=V`), as argparse
    takes it; None where none is given (or the last has no value)."""
    value = None
    for i, arg in enumerate(args):
        name, eq, rest = arg.partition("=")
        if name in names:
            value = rest if eq else (args[i + 1] if i + 1 < len(args) else None)
    return value


def restarts_its_workers(torchrun_args: Sequence[str]) -> bool:
    """torchrun_args ask torchrun to restart its workers itself (--max-restarts N > 0): a
    worker's death is then torchrun's to handle, not a failure the node reports at once."""
    value = last_value(torchrun_args, "--max-restarts", "--max_restarts")
    try:
        return value is not None and int(value) > 0
    except ValueError:
        return False
