"""The torchrun options cluster decides itself, so that `torchrun_args` may not set them.

They belong to the plan (cluster.plan writes torchrun's command line); they sit here, below the
inventory, so that the inventory can refuse them at load with the file's line.
"""
from __future__ import annotations

# Nodes, ranks and the rendezvous: both spellings (--nproc_per_node, --nproc-per-node).
TORCHRUN_OWNED = frozenset(o for name in ("nnodes", "nproc_per_node", "node_rank", "rdzv_backend",
                                          "rdzv_endpoint", "rdzv_id", "master_addr", "master_port",
                                          "local_addr", "standalone")
                           for o in (f"--{name}", f"--{name.replace('_', '-')}"))


def owned_torchrun_option(arg: str) -> str | None:
    """The option of one torchrun argument ('--nnodes=2': '--nnodes') if cluster sets it itself."""
    option = arg.split("=", 1)[0]
    return option if option in TORCHRUN_OWNED else None
