#!/usr/bin/env python3
"""Throughput of the reference trainer against a plain training loop, both measured in the
same run, interleaved, on one GPU.

The plain loop is what the trainer must not be much slower than: the model, SGD (the
trainer's settings: momentum 0.9, Nesterov, weight decay 5e-4, lr 0.1), bf16 autocast,
zero_grad(set_to_none=True), one static input batch on the GPU, no DDP wrapper, the same
cuDNN/TF32 flags, cuda.synchronize around the measured steps. The trainer runs as a user
starts it (`python train/train.py --dataset synthetic ...`). Every case is a fresh process;
each repeat runs every case once, in the same order, and each ratio is taken within a repeat
against that repeat's baseline row, then the median over repeats is printed.

    python bench/trainer_speed.py                                  # plain loop vs trainer
    git worktree add /tmp/before COMMIT                            # an older trainer, to compare
    python bench/trainer_speed.py --groups resnet50,torchrun --before /tmp/before/train/train.py
    python bench/trainer_speed.py --groups resnet50,compile        # + torch.compile pair
    python bench/trainer_speed.py --groups cifar10 --cifar10 DIR   # CIFAR-10 vs synthetic 32x32
    python bench/trainer_speed.py --make-cifar10 DIR               # a random archive in CIFAR-10's layout
    python bench/trainer_speed.py --profile                        # GPU busy time, kernels, host syncs per step
    python bench/trainer_speed.py --ablate                         # plain loop + one trainer ingredient at a time

Groups (each row's ratio is against the baseline named):
  resnet50  plain loop (baseline); trainer; trainer before (--before PATH, an older train.py)
  torchrun  the trainers under `torchrun --nproc_per_node 1` (vs the plain loop)
  cluster   the trainer through `cluster up --local --nodes 1 --nproc-per-node 1` on this
            machine (vs the plain loop)
  steptime  the trainer with CLUSTER_HEARTBEAT_FILE set, as under cluster: heartbeat and the
            per-step compute/data times of train/steptime.py on (vs the trainer without: off)
  compile   plain loop with torch.compile (baseline); trainer --compile (TORCH_LOGS=recompiles
            counts recompilations); the ratio trainer --compile / trainer (eager) is printed too
  cifar10   trainer on synthetic 32x32 data, ResNet-18, batch 256 (baseline); the same on
            CIFAR-10 from --cifar10 DIR: the cost of the data pipeline. Last epoch of two.

--profile records 10 steps with torch.profiler and reports per step: GPU busy time, kernel
count, host syncs, .item() calls and the largest idle gaps with the op that launched the next
kernel. Where the host is the bottleneck, the profiler's own overhead makes the gaps its own;
busy time and counts still compare fairly.

Workload of resnet50/torchrun/compile: ResNet-50, synthetic ImageNet-shaped data on the GPU,
bf16 autocast, channels_last, batch 128, --warmup steps left out, then --steps measured.
Needs a CUDA GPU and torchvision (for the ResNets).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import runpy
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TRAIN = REPO / "train" / "train.py"
FINAL = re.compile(r"^(?:\[[^\]]*\] )?FINAL (\{.*\})$", re.M)   # [node rank] under cluster up
LR = 0.1  # the trainer's lr for batch 128: 0.2 * 128 / 256


@dataclass
class Case:
    name: str
    argv: list[str]
    baseline: str | None = None  # name of the case this one's ratio is against
    env: dict[str, str] = field(default_factory=dict)
    last_epoch: bool = False  # images/s of the last epoch (CIFAR) instead of FINAL's
    results: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.results) if self.results else float("nan")


# ---- the plain loop (runs in a worker process) ---------------------------------------------

def build_plain(a: argparse.Namespace):
    """Model, optimiser, one static batch and a one-step function, as a plain script has them."""
    import torch
    import torch.nn as nn
    import torchvision.models as tvm
    torch.backends.cudnn.benchmark = True  # the trainer's configure_torch() flags
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(0)
    model = tvm.resnet50(weights=None, num_classes=1000).cuda()
    model = model.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, nesterov=True, weight_decay=5e-4)
    x = torch.randn(a.batch, 3, 224, 224, device="cuda").contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (a.batch,), device="cuda")
    crit = nn.CrossEntropyLoss()
    fwd = torch.compile(model) if a.compile else model

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = crit(fwd(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return model, opt, step


def timed(step, warmup: int, steps: int, batch: int) -> float:
    """images/s over `steps` steps after `warmup` steps, synchronised at both ends."""
    import torch
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return steps * batch / (time.perf_counter() - t0)


def plain_worker(a: argparse.Namespace) -> None:
    _, _, step = build_plain(a)
    print("FINAL " + json.dumps({"images_per_s": timed(step, a.warmup, a.steps, a.batch)}), flush=True)


# ---- ablation: the plain loop plus one of the trainer's ingredients at a time ---------------

def ablate_worker(a: argparse.Namespace) -> None:
    """Each variant adds one thing the trainer does per step to the plain loop; the plain
    loop is measured first and last, so the drift of the machine shows."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    def with_metrics(step_fn):
        win = torch.zeros(3, dtype=torch.float64, device="cuda")
        model, opt, _ = step_fn
        import torch.nn as nn
        crit = nn.CrossEntropyLoss()
        x = torch.randn(a.batch, 3, 224, 224, device="cuda").contiguous(memory_format=torch.channels_last)
        y = torch.randint(0, 1000, (a.batch,), device="cuda")

        def step() -> None:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(x)
                loss = crit(out, y)
            loss.backward()
            with torch.no_grad():
                win[0] += loss.detach().double() * y.shape[0]
                win[1] += (out.argmax(1) == y).sum()
                win[2] += y.shape[0]
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step

    def with_sched(parts):
        model, opt, step = parts
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)

        def s2() -> None:
            step()
            sched.step()
        return s2

    def with_ddp(broadcast_buffers: bool):
        def make(parts):
            model, opt, _ = parts
            import torch.nn as nn
            if not dist.is_initialized():
                dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29533", rank=0,
                                        world_size=1, device_id=torch.device("cuda", 0))
            ddp = DDP(model, device_ids=[0], output_device=0, gradient_as_bucket_view=True,
                      bucket_cap_mb=100, static_graph=True, broadcast_buffers=broadcast_buffers)
            crit = nn.CrossEntropyLoss()
            x = torch.randn(a.batch, 3, 224, 224, device="cuda").contiguous(memory_format=torch.channels_last)
            y = torch.randint(0, 1000, (a.batch,), device="cuda")

            def step() -> None:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = crit(ddp(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            return step
        return make

    variants = [("plain loop", lambda p: p[2]),
                ("+ per-step metric window (8 small kernels)", with_metrics),
                ("+ LambdaLR step", with_sched),
                ("+ DDP wrapper, world size 1", with_ddp(True)),
                ("+ DDP wrapper, world size 1, broadcast_buffers=False", with_ddp(False)),
                ("plain loop again", lambda p: p[2])]
    for name, make in variants:
        ips = timed(make(build_plain(a)), a.warmup, a.steps, a.batch)
        print(f"  {name:<58} {ips:>8.1f} img/s", flush=True)
        torch.cuda.empty_cache()
    if dist.is_initialized():
        dist.destroy_process_group()


# ---- profiling: GPU idle time between kernels --------------------------------------------

def profile_worker(a: argparse.Namespace, target: list[str]) -> None:
    """Run `target` (a script and its arguments, or --plain-loop) under torch.profiler,
    recording steps [warmup, warmup + 10) counted by optimizer steps, then print where the
    GPU sat idle."""
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook
    trace = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof = torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA],
        schedule=torch.profiler.schedule(wait=a.warmup - 2, warmup=2, active=10, repeat=1),
        on_trace_ready=lambda p: p.export_chrome_trace(trace))
    register_optimizer_step_post_hook(lambda *_: prof.step())
    with prof:
        if target[0] == "--plain-loop":
            _, _, step = build_plain(a)
            for _ in range(a.warmup + 12):
                step()
            torch.cuda.synchronize()
        else:
            sys.argv = target
            try:
                runpy.run_path(target[0], run_name="__main__")
            except SystemExit as e:
                if e.code not in (0, None):
                    raise
    print("PROFILE " + json.dumps(gpu_idle(trace)), flush=True)
    if a.trace_dir:
        import gzip
        import shutil
        dest = Path(a.trace_dir) / f"trace-{os.getpid()}.json.gz"
        with open(trace, "rb") as f, gzip.open(dest, "wb") as g:
            shutil.copyfileobj(f, g)


def gpu_idle(trace_path: str) -> dict:
    """From a Chrome trace: GPU busy fraction over the recorded steps, the biggest idle gaps
    (with the CPU op that launched the kernel after each gap), and host syncs per step."""
    ev = json.load(open(trace_path))["traceEvents"]
    gpu = sorted((e["ts"], e["ts"] + e["dur"], e["name"], e.get("args", {}).get("correlation"))
                 for e in ev if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    steps = sorted((e["ts"], e["dur"]) for e in ev
                   if e.get("cat") == "user_annotation" and e["name"].startswith("ProfilerStep#"))
    runtime = {e.get("args", {}).get("correlation"): e for e in ev
               if e.get("ph") == "X" and e.get("cat") == "cuda_runtime"}
    ops = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in ev
                 if e.get("ph") == "X" and e.get("cat") == "cpu_op")
    busy, gaps, end = 0.0, [], gpu[0][0]
    for s, t, name, corr in gpu:
        if s > end:
            gaps.append((s - end, name, corr))
        busy += max(0.0, t - max(s, end))
        end = max(end, t)
    span = end - gpu[0][0]

    def launcher(corr) -> str:
        rt = runtime.get(corr)
        if rt is None:
            return "?"
        inner = [o for o in ops if o[0] <= rt["ts"] <= o[1]]
        return min(inner, key=lambda o: o[1] - o[0])[2] if inner else rt["name"]

    n = max(1, len(steps))
    syncs = sum(1 for e in ev if e.get("cat") == "cuda_runtime" and "Synchronize" in e["name"])
    items = sum(1 for e in ev if e.get("cat") == "cpu_op" and e["name"] == "aten::_local_scalar_dense")
    gaps.sort(reverse=True)
    return {"steps": len(steps), "gpu_span_ms_per_step": span / n / 1e3,
            "gpu_busy_ms_per_step": busy / n / 1e3, "gpu_busy_fraction": busy / span if span else None,
            "cpu_ms_per_step": statistics.mean(d for _, d in steps) / 1e3 if steps else None,
            "kernels_per_step": len(gpu) / n, "idle_gaps_over_50us_per_step": sum(g > 50 for g, _, _ in gaps) / n,
            "idle_ms_in_gaps_over_50us_per_step": sum(g for g, _, _ in gaps if g > 50) / n / 1e3,
            "host_syncs_per_step": syncs / n, "item_calls_per_step": items / n,
            "top_gaps": [{"us": round(g), "next_kernel": k[:60], "launched_in": launcher(c)}
                         for g, k, c in gaps[:8]]}


# ---- the cases ---------------------------------------------------------------------------------

def trainer_args(a: argparse.Namespace, train: Path, extra: list[str]) -> list[str]:
    return [str(train), "--dataset", "synthetic", "--model", "resnet50", "--batch-size", str(a.batch),
            "--precision", "bf16", "--channels-last", "--epochs", "1",
            "--steps-per-epoch", str(a.warmup + a.steps), "--bench-warmup", str(a.warmup),
            "--ckpt-every", "0", "--no-plot", "--no-resume", "--out", "{out}", *extra]


PLAIN, TRAINER, PLAIN_COMPILED, SYNTH32 = ("plain loop (baseline)", "trainer",
                                          "plain loop, torch.compile (baseline)",
                                          "trainer, synthetic 32x32 (baseline)")


def cases(a: argparse.Namespace) -> list[Case]:
    me = [sys.executable, str(Path(__file__).resolve())]
    common = ["--steps", str(a.steps), "--warmup", str(a.warmup), "--batch", str(a.batch)]
    py = [sys.executable]
    torchrun = py + ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"]
    trainers = [("", TRAIN)] + ([(" before", Path(a.before).resolve())] if a.before else [])
    out: list[Case] = []
    if {"resnet50", "torchrun", "cluster", "compile", "steptime"} & set(a.groups):
        out.append(Case(PLAIN, me + ["--plain-worker", *common]))
        out += [Case(TRAINER + tag, py + trainer_args(a, path, []), PLAIN) for tag, path in trainers]
    if "torchrun" in a.groups:
        out += [Case(f"{TRAINER}{tag} under torchrun, 1 process", torchrun + trainer_args(a, path, []),
                     PLAIN) for tag, path in trainers]
    if "cluster" in a.groups:
        out.append(Case(f"{TRAINER} through cluster up --local",
                        py + ["-m", "cluster", "up", "--local", "--nodes", "1", "--nproc-per-node", "1",
                              "--", *trainer_args(a, TRAIN, [])], PLAIN,
                        {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}))
    if "steptime" in a.groups:
        out.append(Case(f"{TRAINER}, step times on (heartbeat file set)", py + trainer_args(a, TRAIN, []),
                        TRAINER, {"CLUSTER_HEARTBEAT_FILE": "{out}/heartbeat"}))
    if "compile" in a.groups:
        out.append(Case(PLAIN_COMPILED, me + ["--plain-worker", "--compile", *common]))
        out.append(Case("trainer --compile", py + trainer_args(a, TRAIN, ["--compile"]), PLAIN_COMPILED,
                        {"TORCH_LOGS": "recompiles"}))
    if "cifar10" in a.groups:
        if not a.cifar10:
            raise SystemExit("--groups cifar10 needs --cifar10 DIR (see --make-cifar10)")
        small = ["--model", "resnet18", "--batch-size", "256", "--precision", "bf16", "--channels-last",
                 "--epochs", "2", "--ckpt-every", "0", "--no-plot", "--no-resume", "--out", "{out}"]
        out.append(Case(SYNTH32, py + [str(TRAIN), "--dataset", "synthetic", "--image-size", "32",
                                       "--num-classes", "10", "--steps-per-epoch", "195", *small],
                        last_epoch=True))
        out.append(Case("trainer, CIFAR-10", py + [str(TRAIN), "--dataset", "cifar10", "--data-dir",
                                                   a.cifar10, *small], SYNTH32, last_epoch=True))
    return out


def run_case(case: Case, work: Path, log) -> float:
    out = Path(tempfile.mkdtemp(dir=work))
    argv = [x.replace("{out}", str(out)) for x in case.argv]
    env = dict(os.environ, **{k: v.replace("{out}", str(out)) for k, v in case.env.items()},
               PYTHONUNBUFFERED="1")
    t0 = time.monotonic()
    proc = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True)
    log.write(f"\n===== {case.name}: {' '.join(argv)}\n{proc.stdout}\n{proc.stderr}\n")
    log.flush()
    found = FINAL.findall(proc.stdout)
    if proc.returncode != 0 or not found:
        raise SystemExit(f"{case.name} failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    recompiles = proc.stderr.count("Recompiling function")
    ips = last_epoch_ips(out) if case.last_epoch else json.loads(found[-1])["images_per_s"]
    note = f"   recompiles: {recompiles}" if "TORCH_LOGS" in case.env else ""
    print(f"  {case.name:<52} {ips:>9.1f} img/s   ({time.monotonic() - t0:.0f} s){note}", flush=True)
    return ips


def last_epoch_ips(out: Path) -> float:
    """The last epoch's images/s (the first pays for worker start-up and cuDNN's search)."""
    recs = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    return [r for r in recs if r.get("type") == "epoch"][-1]["images_per_s"]


def report(todo: list[Case]) -> None:
    by_name = {c.name: c for c in todo}
    print("\n| case | images/s (median) | ratio (median of repeats) | against | per repeat |")
    print("|---|---:|---:|---|---|")
    for c in todo:
        base = by_name.get(c.baseline) if c.baseline else None
        ratios = [r / b for r, b in zip(c.results, base.results)] if base else []
        med = f"{statistics.median(ratios):.3f}" if ratios else ""
        each = ", ".join(f"{r:.3f}" for r in ratios)
        print(f"| {c.name} | {c.median:,.0f} | {med} | {c.baseline or ''} | {each} |")
    eager, comp = by_name.get(TRAINER), by_name.get("trainer --compile")
    if eager and comp:
        ratios = [c / e for c, e in zip(comp.results, eager.results)]
        print(f"\ntrainer --compile / trainer eager, same run: median {statistics.median(ratios):.3f}"
              f" (per repeat: {', '.join(f'{r:.3f}' for r in ratios)})")


def run_profiles(a: argparse.Namespace, todo: list[Case], work: Path) -> None:
    me = [sys.executable, str(Path(__file__).resolve()), "--steps", str(a.steps), "--warmup",
          str(a.warmup), "--batch", str(a.batch)] + (["--trace-dir", a.trace_dir] if a.trace_dir else [])
    for case in todo:
        if case.last_epoch or "compile" in case.name or "torchrun" in case.name:
            continue
        target = ["--plain-loop"] if "--plain-worker" in case.argv else case.argv[1:]
        out = tempfile.mkdtemp(dir=work)
        argv = me + ["--profile-worker", "--"] + [x.replace("{out}", out) for x in target]
        proc = subprocess.run(argv, cwd=work, env=dict(os.environ, PYTHONUNBUFFERED="1"),
                              capture_output=True, text=True)
        found = re.findall(r"^PROFILE (\{.*\})$", proc.stdout, re.M)
        if not found:
            print(f"# profile of {case.name} failed:\n{(proc.stdout + proc.stderr)[-2000:]}")
            continue
        print(f"# profile: {case.name}\n{json.dumps(json.loads(found[-1]), indent=1)}", flush=True)


def make_cifar10(root: Path, n_train: int = 50000, n_test: int = 10000) -> None:
    """Random images and labels in the layout of cifar-10-python.tar.gz, extracted: for
    timing the loader where the real data is not at hand (the numbers learnt mean nothing)."""
    import pickle

    import numpy as np
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)
    rs = np.random.RandomState(0)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    sizes = [n_train // 5] * 5 + [n_test]
    for name, n in zip(names, sizes):
        d = {b"batch_label": name.encode(), b"labels": rs.randint(0, 10, n).tolist(),
             b"data": rs.randint(0, 256, (n, 3072), dtype=np.uint8),
             b"filenames": [f"{name}_{i}.png".encode() for i in range(n)]}
        (folder / name).write_bytes(pickle.dumps(d, protocol=2))
    print(f"wrote {n_train} + {n_test} random images to {folder}")


@contextlib.contextmanager
def gpu_logger(path: str | None):
    """nvidia-smi's clocks, power and temperature once a second while the cases run."""
    if not path:
        yield
        return
    with open(path, "w") as f:
        proc = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,"
                                 "temperature.gpu,utilization.gpu", "--format=csv", "-l", "1"], stdout=f)
        try:
            yield
        finally:
            proc.terminate()
            proc.wait()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=80)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--groups", default="resnet50", help="comma-separated: resnet50,torchrun,cluster,steptime,compile,cifar10")
    p.add_argument("--before", default=None, help="another train.py to measure beside this one")
    p.add_argument("--cifar10", default=None, metavar="DIR", help="CIFAR-10 for the cifar10 group")
    p.add_argument("--make-cifar10", default=None, metavar="DIR",
                   help="write random images in CIFAR-10's python layout to DIR/cifar-10-batches-py and exit")
    p.add_argument("--gpu-log", default=None, help="log nvidia-smi clocks, power, temperature here (1/s)")
    p.add_argument("--profile", action="store_true", help="profile the eager cases instead of timing them")
    p.add_argument("--ablate", action="store_true", help="plain loop plus one trainer ingredient at a time")
    p.add_argument("--trace-dir", default=None, help="--profile: keep the gzipped Chrome traces here")
    p.add_argument("--log", default=None, help="every process's full output")
    p.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)  # plain worker
    p.add_argument("--plain-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--profile-worker", action="store_true", help=argparse.SUPPRESS)
    a, rest = p.parse_known_args()
    if a.plain_worker:
        plain_worker(a)
        return 0
    if a.profile_worker:
        profile_worker(a, rest[1:] if rest[:1] == ["--"] else rest)
        return 0
    if a.ablate:
        ablate_worker(a)
        return 0
    if a.make_cifar10:
        make_cifar10(Path(a.make_cifar10))
        return 0
    a.groups = [g for g in a.groups.split(",") if g]
    if a.profile:
        a.steps = 12  # the profiler records 10 steps after the warm-up
    todo = cases(a)
    print(f"# resnet50, synthetic, bf16, channels_last, batch {a.batch}, {a.steps} steps after "
          f"{a.warmup} warm-up, {a.repeats} repeat(s)", flush=True)
    log_path = Path(a.log) if a.log else Path(tempfile.mkstemp(prefix="trainer-speed-", suffix=".log")[1])
    with tempfile.TemporaryDirectory() as work:
        if a.profile:
            run_profiles(a, todo, Path(work))
            return 0
        with open(log_path, "w") as log, gpu_logger(a.gpu_log):
            for r in range(a.repeats):
                print(f"# repeat {r + 1}", flush=True)
                for case in todo:
                    case.results.append(run_case(case, Path(work), log))
    report(todo)
    print(f"# full output: {log_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
