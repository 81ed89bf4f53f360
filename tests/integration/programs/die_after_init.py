"""Test program: one rank kills itself (SIGKILL) the moment init_process_group returns, in the
first attempt of a job (CLUSTER_RESTART_COUNT 0): faster than anything outside it can sample.
The others wait for it in a barrier. In a later attempt every rank passes the barrier and
prints one JSON line.

    --die-rank R  the global rank that dies (default: the last)
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys

import torch.distributed as dist


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--die-rank", type=int, default=-1)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ.get("CLUSTER_RESTART_COUNT", "0"))
    if restart == 0 and rank == (args.die_rank if args.die_rank >= 0 else world - 1):
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()
    sys.stdout.write(json.dumps({"rank": rank, "world_size": world, "restart": restart,
                                 "node": os.environ.get("CLUSTER_NODE")}) + "\n")
    sys.stdout.flush()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
