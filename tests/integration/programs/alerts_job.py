"""Test program for alerts: ranks meet (gloo), then

    --mode ok         every rank finishes
    --mode fail       rank 1 raises, in every attempt, an error that quotes $ALERT_CANARY
                      (a secret: it must reach no alert); the others wait to be stopped
    --mode fail-once  the same in the first attempt only (CLUSTER_RESTART_COUNT 0)
    --mode hang       every rank beats ($CLUSTER_HEARTBEAT_FILE, from its start: importing
                      torch is slow on a small machine) until 2 s after they met; then the
                      last rank sleeps in stuck_here() while the others wait for it in a
                      barrier: a hang whose odd one out is the last rank's node
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time

BEATING = threading.Event()


def beat() -> None:
    path = os.environ.get("CLUSTER_HEARTBEAT_FILE")
    while path and not BEATING.is_set():
        with open(path, "a"):
            os.utime(path)
        time.sleep(0.5)


threading.Thread(target=beat, daemon=True).start()

import torch.distributed as dist  # noqa: E402  (after the beats began)


def stuck_here() -> None:
    time.sleep(3600)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=("ok", "fail", "fail-once", "hang"), default="ok")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.barrier()
    if args.mode == "hang":
        time.sleep(2)
        BEATING.set()
        if rank == world - 1:
            stuck_here()
        dist.barrier()
    first = os.environ.get("CLUSTER_RESTART_COUNT", "0") == "0"
    if args.mode == "fail" or (args.mode == "fail-once" and first):
        if rank == 1:
            raise RuntimeError(f"the store refused token {os.environ['ALERT_CANARY']}")
        time.sleep(120)              # stopped by the launcher once rank 1 has failed
    print(f"rank {rank} done", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
