"""Test program: every rank all-reduces rank+1 with gloo and prints one JSON line.

    --sleep S     after the all-reduce and a barrier, sleep S seconds (to be killed meanwhile)
    --fail-rank R exit 3 right after the all-reduce on that global rank
    --env-hash N  add the sha256 of environment variable N to the line (proves a secret
                  arrived without printing it)
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist


def say(record: dict) -> None:
    # One write per line: ranks of a node share its output pipe, and print() writes the
    # text and the newline separately, which lets two ranks' lines interleave.
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def env_hash(name: str | None) -> str | None:
    if not name or name not in os.environ:
        return None
    return hashlib.sha256(os.environ[name].encode()).hexdigest()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--fail-rank", type=int, default=-1)
    p.add_argument("--env-hash")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    say({"rank": rank, "world_size": world, "sum": t.item(), "host": socket.gethostname(),
         "pid": os.getpid(), "node": os.environ.get("CLUSTER_NODE"),
         "env_hash": env_hash(args.env_hash)})
    if rank == args.fail_rank:
        return 3
    dist.barrier()
    if args.sleep:
        say({"rank": rank, "sleeping": args.sleep})
        time.sleep(args.sleep)
        dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
