"""`cluster doctor --deep` on the nodes: a real collective across all of them, under torchrun.

NCCL on GPUs, gloo on CPUs. As it measures, rank 0 prints '@@progress ' and a JSON object,
{"done", "total", "say"}: once at the start (done 0), then after the sum, after each message
size and after each round of pairs (total: 1 + sizes + rounds), "say" a short line for the sum,
each size and the end of the pairs ("" for the other rounds). At the end it prints one line,
'@@doctor ' and a JSON object:
    sum_ok        an all_reduce of rank+1 gave world*(world+1)/2 on every rank
    allreduce     [{bytes, seconds, busbw_gbps}] for each message size (bus bandwidth, as
                  nccl-tests counts it: algorithm bandwidth x 2(n-1)/n)
    pairs         [{a, b, bytes, gbps}]: ping-pong between the first process of each two nodes,
                  every pair of nodes, in rounds where no node is in two pairs at once

    nccl          the NCCL_* variables rank 0 ran with (what a tuning sweep set reached it)

Settings from the environment (the launcher sets them):
    CLUSTER_DOCTOR_SIZES  message sizes in bytes, comma-separated
    CLUSTER_DOCTOR_ITERS  timed iterations per size (after two warm-ups)
    CLUSTER_DOCTOR_PAIRS  0: skip the pairs (a tuning sweep needs only the all_reduce)
"""
import json
import os
import sys
import time

import torch
import torch.distributed as dist

DEFAULT_SIZES = "65536,1048576,16777216"


def main():
    on_gpu = torch.cuda.is_available()
    dist.init_process_group("nccl" if on_gpu else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    sizes = [int(s) for s in os.environ.get("CLUSTER_DOCTOR_SIZES", DEFAULT_SIZES).split(",")]
    iters = int(os.environ.get("CLUSTER_DOCTOR_ITERS", "5"))
    want_pairs = os.environ.get("CLUSTER_DOCTOR_PAIRS", "1") != "0"
    nodes = leaders() if want_pairs else []
    schedule = pair_rounds(len(nodes))
    steps = Steps(rank == 0, total_steps(len(sizes), len(schedule)))
    sum_ok = check_sum(device, world)
    steps.tell(f"sum {'right' if sum_ok else 'WRONG'} over {world} process{'es' if world > 1 else ''}")
    result = {"backend": dist.get_backend(), "world_size": world, "sum_ok": sum_ok, "allreduce": []}
    for size in sizes:
        measured = allreduce_bw(size, iters, device, world)
        result["allreduce"].append(measured)
        steps.tell(f"all_reduce {size_text(size)}: {measured['busbw_gbps']:.2f} GB/s bus bandwidth")
    result["pairs"] = pairs(sizes[-1], iters, device, local, nodes, schedule, steps)
    result["nccl"] = {k: v for k, v in sorted(os.environ.items()) if k.startswith("NCCL_")}
    if rank == 0:
        sys.stdout.write("@@doctor " + json.dumps(result) + "\n")
        sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()
    return 0 if result["sum_ok"] else 1


class Steps:
    """Rank 0's progress lines (the others stay silent): the launcher counts them live and
    prints each "say", so a long measurement on many nodes is seen moving."""

    def __init__(self, speak, total):
        self.speak, self.total, self.done = speak, total, 0
        self.write("")

    def tell(self, say=""):
        self.done += 1
        self.write(say)

    def write(self, say):
        if self.speak:
            line = {"done": self.done, "total": self.total, "say": say}
            sys.stdout.write("@@progress " + json.dumps(line) + "\n")
            sys.stdout.flush()       # a pipe buffers: the launcher would hear it all at the end


def total_steps(sizes, rounds_of_pairs):
    """The sum, each message size, each round of pairs."""
    return 1 + sizes + rounds_of_pairs


def size_text(n):
    """65536 -> '64 KiB', 16777216 -> '16 MiB'."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            value = n / scale
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{n} B"


def pairs_text(found):
    """The line that ends the pairs: how many, and the slowest."""
    if not found:
        return "pairs: none measured"
    worst = min(found, key=lambda p: p["gbps"])
    return (f"pairs: {len(found)} measured, slowest {worst['a']}<->{worst['b']} "
            f"{worst['gbps']:.2f} GB/s")


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_sum(device, world):
    t = torch.tensor([float(dist.get_rank() + 1)], device=device)
    dist.all_reduce(t)
    ok = torch.tensor([1.0 if t.item() == world * (world + 1) / 2 else 0.0], device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return ok.item() == 1.0


def allreduce_bw(size, iters, device, world):
    x = torch.ones(max(1, size // 4), dtype=torch.float32, device=device)
    for _ in range(2):
        dist.all_reduce(x)
    sync(device)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(x)
    sync(device)
    seconds = (time.perf_counter() - t0) / iters
    seconds = max_over_ranks(seconds, device)
    algbw = size / seconds / 1e9
    return {"bytes": size, "seconds": seconds,
            "busbw_gbps": algbw * (2 * (world - 1) / world if world > 1 else 1.0)}


def max_over_ranks(value, device):
    t = torch.tensor([value], dtype=torch.float64 if device.type == "cpu" else torch.float32,
                     device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def leaders():
    """The global rank of each node's first process, and each node's name, in node order."""
    me = (dist.get_rank(), int(os.environ.get("LOCAL_RANK", "0")), os.environ.get("CLUSTER_NODE", ""))
    everyone = [None] * dist.get_world_size()  # type: list
    dist.all_gather_object(everyone, me)
    return [(r, name) for r, local, name in everyone if local == 0]


def pair_rounds(n):
    """The rounds that have a pair in them (one node: none)."""
    return [r for r in rounds(n) if r]


def rounds(n):
    """Round-robin pairings of n players: every pair once, nobody twice in a round."""
    players = list(range(n)) + ([None] if n % 2 else [])
    m = len(players)
    out = []
    for _ in range(m - 1):
        out.append([(players[i], players[m - 1 - i]) for i in range(m // 2)
                    if players[i] is not None and players[m - 1 - i] is not None])
        players = [players[0], players[-1]] + players[1:-1]
    return out


def pairs(size, iters, device, local, nodes, schedule, steps):
    """Ping-pong between the first process of each two nodes, round by round (`schedule`),
    every process in every round's barrier; each round ends a step."""
    if not schedule:
        return []
    index = {r: i for i, (r, _) in enumerate(nodes)}
    mine = index.get(dist.get_rank()) if local == 0 else None
    found = []
    x = torch.ones(max(1, size // 4), dtype=torch.float32, device=device)
    for number, pairing in enumerate(schedule, 1):
        for a, b in pairing:
            if mine not in (a, b):
                continue
            peer = nodes[b][0] if mine == a else nodes[a][0]
            t0 = time.perf_counter()
            for _ in range(iters):
                if mine == a:
                    dist.send(x, peer)
                    dist.recv(x, peer)
                else:
                    dist.recv(x, peer)
                    dist.send(x, peer)
            sync(device)
            seconds = (time.perf_counter() - t0) / iters
            if mine == a:
                found.append({"a": nodes[a][1], "b": nodes[b][1], "bytes": size,
                              "gbps": 2 * size / seconds / 1e9})
        dist.barrier()
        if number < len(schedule):
            steps.tell()
    gathered = [None] * dist.get_world_size()  # type: list
    dist.all_gather_object(gathered, found)
    everyone = [p for part in gathered for p in part]
    steps.tell(pairs_text(everyone))       # the last round: said once all pairs are in
    return everyone


if __name__ == "__main__":
    sys.exit(main())
