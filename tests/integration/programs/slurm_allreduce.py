"""Under torchrun: gloo all_reduce of rank+1; rank 0 checks the sum. Every rank prints one JSON
line (rank, world, sum, hostname, SLURM_NODEID). `--fail-rank R` makes rank R exit 3 after it (`--fail-code C`: C;
`--fail-first`: only in the first attempt, SLURM_RESTART_COUNT unset or 0);
`--env-hash N` adds the sha256 of environment variable N; `--sleep S` waits S seconds after it (for `cluster down` tests); `--sleep-first S` only in the
first attempt of a SLURM job (SLURM_RESTART_COUNT unset or 0), for requeue tests."""
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


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--fail-rank", type=int, default=None)
    p.add_argument("--fail-code", type=int, default=3)
    p.add_argument("--fail-first", action="store_true")
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--sleep-first", type=float, default=0.0)
    p.add_argument("--env-hash")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    print(json.dumps({"rank": rank, "world": world, "sum": int(t.item()),
                      "hostname": socket.gethostname(),
                      "slurm_nodeid": os.environ.get("SLURM_NODEID"),
                      "cluster_node_rank": os.environ.get("CLUSTER_NODE_RANK"),
                      "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
                      "nccl_ifname": os.environ.get("NCCL_SOCKET_IFNAME"),
                      "restart": int(os.environ.get("SLURM_RESTART_COUNT") or 0),
                      "python": sys.executable, "from_setup": os.environ.get("FROM_SETUP"),
                      "env_hash": hashlib.sha256(os.environ[args.env_hash].encode()).hexdigest()
                      if args.env_hash and args.env_hash in os.environ else None}), flush=True)
    if args.sleep:
        time.sleep(args.sleep)
    if args.sleep_first and int(os.environ.get("SLURM_RESTART_COUNT") or 0) == 0:
        time.sleep(args.sleep_first)
    first = int(os.environ.get("SLURM_RESTART_COUNT") or 0) == 0
    if args.fail_rank is not None and rank == args.fail_rank and (first or not args.fail_first):
        print(f"rank {rank}: failing on purpose", file=sys.stderr, flush=True)
        # At once, with this code: leaving through the interpreter's exit with the process
        # group alive sometimes aborts in torch's C++ teardown (std::terminate on a joinable
        # thread: SIGABRT, not the code), as the stop-code test saw in one CI run of three.
        os._exit(args.fail_code)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
