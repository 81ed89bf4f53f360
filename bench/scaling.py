#!/usr/bin/env python3
"""GPU scaling of the reference trainer, launched through `cluster up` (localhost backend).

Every figure is measured in the same run, so ratios hold on a noisy machine:
  - images/s on 1 GPU, and on each larger GPU count of one host -> scaling efficiency
    (N-GPU throughput / (N x 1-GPU throughput));
  - simulated nodes of G GPUs each (`cluster up --local --nodes N`) forced onto sockets
    (NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1), plain and with a gradient compression hook;
  - `cluster up` against bare torchrun with the same arguments (launch overhead: >= 0.99).

    python bench/scaling.py                       # 1 GPU, all GPUs, 2 socket nodes, bare vs cluster
    python bench/scaling.py --gpus 1,2,4,8 --nodes 2x4 --steps 300
    python bench/scaling.py --quick               # fewer steps, for a smoke test

Workload (the issue's): ResNet-50, synthetic ImageNet-shaped data made on the GPU, bf16
autocast, channels_last, batch 128 per GPU. Needs CUDA GPUs and torchvision.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TRAIN = REPO / "train" / "train.py"
FINAL = re.compile(r"FINAL (\{.*\})")
SOCKETS = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}


@dataclass
class Case:
    name: str
    gpus: int
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    results: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.results) if self.results else float("nan")


def train_args(a: argparse.Namespace, extra: list[str]) -> list[str]:
    return [str(TRAIN), "--dataset", "synthetic", "--model", a.model, "--batch-size", str(a.batch),
            "--precision", "bf16", "--channels-last", "--epochs", "1", "--steps-per-epoch",
            str(a.steps), "--bench-warmup", str(a.warmup), "--log-every", str(a.steps),
            "--ckpt-every", "0", "--no-plot", "--no-resume", *extra]


def cluster_cmd(nodes: int, nproc: int, env: dict[str, str], args: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "cluster", "up", "--local", "--nodes", str(nodes),
           "--nproc-per-node", str(nproc)]
    for k, v in env.items():
        cmd += ["--env", f"{k}={v}"]
    return cmd + ["--", *args]


def visible(n: int) -> dict[str, str]:
    return {"CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in range(n))}


def cases(a: argparse.Namespace, total_gpus: int) -> list[Case]:
    out: list[Case] = []
    for g in a.gpus:
        if g > total_gpus:
            print(f"# skipping {g} GPUs: this machine has {total_gpus}", flush=True)
            continue
        out.append(Case(f"{g} GPU(s), one host", g,
                        cluster_cmd(1, g, {}, train_args(a, [])), visible(g)))
    if total_gpus >= 2 and 2 in a.gpus and a.compare_plain:
        out.append(Case("2 GPUs, plain DDP (25 MB buckets, no static graph)", 2,
                        cluster_cmd(1, 2, {}, train_args(a, ["--bucket-cap-mb", "25", "--no-static-graph"])),
                        visible(2)))
    for shape in a.nodes:
        n, g = (int(x) for x in shape.split("x"))
        if n * g > total_gpus:
            print(f"# skipping {shape}: needs {n * g} GPUs", flush=True)
            continue
        for hook in a.hooks:
            env = dict(SOCKETS, **a.socket_env)
            out.append(Case(f"{n} nodes x {g} GPU(s) over sockets, compression {hook}", n * g,
                            cluster_cmd(n, g, env, train_args(a, ["--grad-compression", hook])),
                            visible(n * g)))
    if a.bare and total_gpus >= 2:
        g = min(2, total_gpus)
        args = train_args(a, [])
        bare = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc_per_node={g}", *args]
        out.append(Case(f"bare torchrun, {g} GPUs", g, bare, visible(g)))
        out.append(Case(f"cluster up, {g} GPUs (paired with bare)", g,
                        cluster_cmd(1, g, {}, args), visible(g)))
    return out


def run_case(case: Case, workdir: Path, log) -> float:
    env = dict(os.environ, **case.env, PYTHONUNBUFFERED="1", NO_COLOR="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    t0 = time.monotonic()
    proc = subprocess.run(case.argv, cwd=workdir, env=env, capture_output=True, text=True)
    log.write(f"\n===== {case.name}: {' '.join(case.argv)}\n{proc.stdout}\n{proc.stderr}\n")
    found = FINAL.findall(proc.stdout)
    if proc.returncode != 0 or not found:
        tail = (proc.stdout + proc.stderr)[-3000:]
        raise SystemExit(f"{case.name} failed (exit {proc.returncode}):\n{tail}")
    ips = json.loads(found[-1])["images_per_s"]
    print(f"  {case.name:<58} {ips:>10.1f} img/s   ({time.monotonic() - t0:.0f} s)", flush=True)
    return ips


def gpu_count() -> int:
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", default="1,2", help="GPU counts on one host, e.g. 1,2,4,8")
    p.add_argument("--nodes", default="2x1", help="simulated node shapes over sockets, e.g. 2x1,2x4 ('' for none)")
    p.add_argument("--hooks", default="none,bf16", help="compression for the socket cases")
    p.add_argument("--socket-env", default="NCCL_SOCKET_NTHREADS=4,NCCL_NSOCKS_PERTHREAD=4",
                   help="NCCL socket settings for the socket cases ('' for NCCL's defaults)")
    p.add_argument("--model", default="resnet50")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--no-bare", dest="bare", action="store_false", help="skip cluster-vs-torchrun")
    p.add_argument("--no-plain", dest="compare_plain", action="store_false", help="skip the plain-DDP 2-GPU case")
    p.add_argument("--quick", action="store_true", help="40 steps, 10 warm-up")
    p.add_argument("--no-settle", dest="settle", action="store_false",
                   help="skip the uncounted first run that warms the machine up")
    p.add_argument("--log", default=None, help="write every run's full output here")
    a = p.parse_args()
    a.gpus = [int(x) for x in a.gpus.split(",") if x]
    a.nodes = [x for x in a.nodes.split(",") if x]
    a.hooks = [x for x in a.hooks.split(",") if x]
    a.socket_env = dict(kv.split("=", 1) for kv in a.socket_env.split(",") if kv)
    if a.quick:
        a.steps, a.warmup = 40, 10
    total = gpu_count()
    if total < 1:
        raise SystemExit("no CUDA GPU found (nvidia-smi -L)")
    print(f"# {total} GPU(s); {a.model}, synthetic, bf16, channels_last, batch {a.batch}/GPU, "
          f"{a.steps} steps ({a.warmup} warm-up), {a.repeats} repeat(s)", flush=True)
    todo = cases(a, total)
    log_path = Path(a.log) if a.log else Path(tempfile.mkstemp(prefix="scaling-", suffix=".log")[1])
    with tempfile.TemporaryDirectory() as work, open(log_path, "w") as log:
        if a.settle and todo:
            # The first process on a fresh machine pays for GPU clocks and caches warming up.
            print("# settling run (not counted)", flush=True)
            run_case(todo[0], Path(work), log)
        for r in range(a.repeats):
            print(f"# repeat {r + 1}", flush=True)
            for case in todo:
                case.results.append(run_case(case, Path(work), log))
    report(todo)
    print(f"# full output: {log_path}")
    return 0


def report(todo: list[Case]) -> None:
    """Efficiency per repeat, against that repeat's own 1-GPU figure (pairs cancel the
    machine's drift between repeats), then the median over repeats."""
    one = next((c for c in todo if c.gpus == 1 and "one host" in c.name), None)
    print("\n| case | GPUs | images/s (median) | scaling efficiency (median of repeats) | per repeat |")
    print("|---|---|---|---|---|")
    for c in todo:
        effs = ([100 * r / (c.gpus * base) for r, base in zip(c.results, one.results)]
                if one and c.gpus > 1 else [])
        eff = f"{statistics.median(effs):.1f}%" if effs else ""
        each = ", ".join(f"{e:.1f}%" for e in effs)
        print(f"| {c.name} | {c.gpus} | {c.median:,.0f} | {eff} | {each} |")
    bare = next((c for c in todo if c.name.startswith("bare torchrun")), None)
    ours = next((c for c in todo if "paired with bare" in c.name), None)
    if bare and ours:
        ratios = [o / b for o, b in zip(ours.results, bare.results)]
        print(f"\ncluster up / bare torchrun, steady-state images/s: median {statistics.median(ratios):.3f} "
              f"(per repeat: {', '.join(f'{r:.3f}' for r in ratios)})")


if __name__ == "__main__":
    sys.exit(main())
