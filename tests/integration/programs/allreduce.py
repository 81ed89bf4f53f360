"""Test program: every rank all-reduces rank+1 with gloo and prints one JSON line.

    --sleep S     after the all-reduce and a barrier, sleep S seconds (to be killed meanwhile)
    --fail-rank R exit 3 right after the all-reduce on that global rank
    --fail-first  ... only in the first attempt of a restarted job (CLUSTER_RESTART_COUNT 0)
    --sleep-first sleep only in the first attempt
    --raise-rank R right after the all-reduce that rank raises RuntimeError; the others wait
                  3 s, then fail in the next barrier (their peer is gone)
    --raise-node N ... the same on node N (CLUSTER_NODE), in every attempt
    --raise-text T the text of that RuntimeError (default: "rank R gave up")
    --hang-rank R after the all-reduce, rank R sleeps --hang S seconds while the others wait
                  in the next all-reduce (a hang: nobody prints, nobody progresses)
    --env-hash N  add the sha256 of environment variable N to the line (proves a secret
                  arrived without printing it)
    --show-env A,B add those environment variables' values to the line (never a secret)
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
    p.add_argument("--fail-first", action="store_true")
    p.add_argument("--sleep-first", action="store_true")
    p.add_argument("--raise-rank", type=int, default=-1)
    p.add_argument("--raise-node", default="")
    p.add_argument("--raise-text", default="")
    p.add_argument("--hang-rank", type=int, default=-1)
    p.add_argument("--hang", type=float, default=600.0)
    p.add_argument("--show-env", default="")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    say({"rank": rank, "world_size": world, "sum": t.item(), "host": socket.gethostname(),
         "pid": os.getpid(), "node": os.environ.get("CLUSTER_NODE"),
         "env_hash": env_hash(args.env_hash),
         "in_container": os.path.exists("/run/.containerenv") or os.path.exists("/.dockerenv"),
         "restart": int(os.environ.get("CLUSTER_RESTART_COUNT", "0")), "python": sys.executable,
         "env": {k: os.environ.get(k) for k in args.show_env.split(",") if k}})
    first = os.environ.get("CLUSTER_RESTART_COUNT", "0") == "0"
    if rank == args.fail_rank and (first or not args.fail_first):
        return 3
    if args.raise_rank >= 0 or args.raise_node:
        if rank == args.raise_rank or os.environ.get("CLUSTER_NODE") == args.raise_node:
            raise RuntimeError(args.raise_text or f"rank {rank} gave up")
        time.sleep(3)                      # the others end later, in the barrier below
    if args.hang_rank >= 0:
        if rank == args.hang_rank:
            time.sleep(args.hang)          # outside any collective
        dist.all_reduce(t)                 # the others wait here for it
    dist.barrier()
    if args.sleep and (first or not args.sleep_first):
        say({"rank": rank, "sleeping": args.sleep})
        time.sleep(args.sleep)
        dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
