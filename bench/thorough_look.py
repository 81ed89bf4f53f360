#!/usr/bin/env python3
"""What a stop's thorough last look costs a node's supervisor, against the number of this
user's processes on the machine: it reads every process's state, and the environment of each
of this user's processes outside the run's family (cluster/remote/stopping.py, members with
thorough=True). On the test nodes of bench/launch.py every node shares one machine, so at
1,000 nodes each node's last look reads about 4,000 processes.

    python bench/thorough_look.py [--counts 300,1000,4000] [--repeats 5]

Prints the CPU of one thorough look (median of --repeats) with N other processes of this user
present (`sleep`s carrying another run's id), and, as the baseline measured in the same run,
the cheap look the live supervisor polls with (its own family, down the kernel's child lists).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "cluster" / "remote"))
import family  # noqa: E402
import stopping  # noqa: E402


def cpu_of(look, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.process_time()
        look()
        times.append(time.process_time() - t0)
    return statistics.median(times)


def outside_the_family(n: int) -> list[int]:
    """n `sleep`s of this user that are not this process's descendants (as another node's
    processes are): started by a process in a session of its own that has them adopted by
    init before this one looks (a double fork whose middle exits)."""
    tag = "%d.%d" % (600, os.getpid())                   # `sleep 600.PID`: ours to find and end
    r, w = os.pipe()
    if os.fork() == 0:                                   # the middle: leaves them, then exits
        os.setsid()
        if os.fork() == 0:
            env = {"CLUSTER_RUN_ID": "another", "PAD": "x" * 200, "PATH": os.environ["PATH"]}
            pids = [subprocess.Popen(["sleep", tag], env=env, start_new_session=True).pid
                    for _ in range(n)]
            os.write(w, (" ".join(map(str, pids)) + "\n").encode())
            os._exit(0)
        os._exit(0)
    os.wait()
    os.close(w)
    with os.fdopen(r) as f:
        pids = [int(x) for x in f.read().split()]
    time.sleep(0.5)
    return pids


def measure(n: int, repeats: int) -> None:
    others = outside_the_family(n)        # before this process adopts orphans
    family.become_subreaper()
    mine = subprocess.Popen(["sleep", "600"], start_new_session=True)    # the run's one process
    ident = stopping.Identity("this-run", "n1", None, False, os.getpid())
    thorough = cpu_of(lambda: ident.members(thorough=True), repeats)
    cheap = cpu_of(lambda: ident.members(thorough=False), repeats)
    print(f"{n:5d} other processes of this user: thorough look {1000 * thorough:6.1f} ms CPU, "
          f"the family's own look {1000 * cheap:5.2f} ms (ratio {thorough / max(cheap, 1e-6):.0f})",
          flush=True)
    for pid in others:
        os.kill(pid, 9)
    mine.kill()
    mine.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--counts", default="300,1000,4000")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    for n in (int(x) for x in args.counts.split(",")):
        if os.fork() == 0:                 # a process of its own each: none is a subreaper yet
            measure(n, args.repeats)
            os._exit(0)
        os.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
