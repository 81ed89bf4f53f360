"""Test program for the end of a job: every rank all-reduces with gloo, leaves the group and
stamps its exit; one rank may leave later, or fail, after the others have exited 0.

    --late-rank R   that rank leaves the group with the others, then sleeps --late S seconds,
                    prints "rank R: late line" and exits --late-code C (default 0)
    --stamps DIR    each rank writes DIR/<rank> holding the wall time of its exit
    --freeze-agent  a rank exiting 0 first stops (SIGSTOP) its torchrun agent, so the agent can
                    neither collect it nor exit on its own: only the launcher's finish ends it.
                    Without this, a busy machine may let torchrun collect its workers and exit
                    before the supervisor read their codes, and a test of the finish would
                    depend on who was faster.

Every rank's exit is os._exit after its last line, so the stamp is the exit's moment.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import torch
import torch.distributed as dist


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--late-rank", type=int, default=-1)
    p.add_argument("--late", type=float, default=3.0)
    p.add_argument("--late-code", type=int, default=0)
    p.add_argument("--stamps", default="")
    p.add_argument("--freeze-agent", action="store_true")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    t = torch.tensor([1.0])
    dist.all_reduce(t)
    dist.barrier()
    dist.destroy_process_group()
    code = 0
    if rank == args.late_rank:
        time.sleep(args.late)
        print(f"rank {rank}: late line", flush=True)
        code = args.late_code
    else:
        print(f"rank {rank}: leaving", flush=True)
    if args.stamps:
        with open(os.path.join(args.stamps, str(rank)), "w") as f:
            f.write(repr(time.time()))
    sys.stdout.flush()
    if args.freeze_agent and code == 0:
        os.kill(os.getppid(), signal.SIGSTOP)
    os._exit(code)


if __name__ == "__main__":
    main()
