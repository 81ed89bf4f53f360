#!/usr/bin/env python3
"""Reference PyTorch DDP training program for ``cluster``.

Runs as a plain script (one process, no process group) or under torchrun (one
process per GPU / CPU slot; NCCL on CUDA, gloo on CPU)::

    python train/train.py                                   # 1 process, digits
    torchrun --nproc_per_node 2 train/train.py              # 2 processes, digits (default)
    torchrun --nproc_per_node 8 train/train.py --dataset synthetic --model resnet50 \\
        --batch-size 256 --epochs 3 --steps-per-epoch 100 --channels-last   # GPU benchmark
    torchrun --nproc_per_node 4 train/train.py --dataset cifar10 --data-dir /data/cifar \\
        --model resnet18 --epochs 30 --batch-size 128
    python -m cluster.train.train --help                     # installed as a package

Default: scikit-learn's 8x8 handwritten digits (1797 images, 10 classes, offline) with
a fixed stratified 80/20 held-out split (1438 / 359), small CNN, 10 epochs of 22 steps;
two CPU processes reach ~98% held-out accuracy (about 20 s wall on 2 idle cores, most
of it process start-up).

How a run goes; each step is one function below, in this order:
  setup       resolve_defaults, configure_torch; the process group (main)
  data        data.build_data: the dataset as micro-batches already on the device
  model       build_model: model, optimizer, LR schedule, grad scaler
  resume      restore: the newest checkpoint in --checkpoint-dir (or --resume PATH)
  DDP         wrap_model: DistributedDataParallel when world size > 1 (at 1 there is nothing
              to synchronise and the wrapper only costs time), comm hook, torch.compile
  one epoch   train_one_epoch: train_step per optimizer step, after_step at each boundary
  evaluate    evaluate: held-out loss and accuracy summed over ranks
  checkpoint  save_checkpoint (every --ckpt-every steps, epoch ends), save_on_stop (SIGTERM)
  finish      finish: the FINAL line and the plot

Flags (see --help for every default)
  data      --dataset digits|cifar10|synthetic   --data-dir DIR (cifar10: cifar-10-batches-py/
            or cifar-10-python.tar.gz there, downloaded only when missing, no torchvision
            needed)   --steps-per-epoch N, --image-size, --num-classes (synthetic: tensors made
            on the device once, no loader)   --workers N (default 0 for in-memory digits, else
            min(4, cpus per process))   --no-shuffle (fixed sample order, for tests)
  model     --model cnn|resnet18|resnet50 (torchvision imported lazily)  --width (cnn)
            --bn (batch norm in the cnn)  --sync-bn
  optimiser --epochs --batch-size (PER PROCESS; global = batch * world * accum, printed)
            --base-lr at --base-batch (lr = base_lr * global_batch / base_batch)
            --optimizer sgd|adamw --momentum --weight-decay --clip-grad
            --warmup-epochs / --warmup-steps (linear warm-up, then cosine to --min-lr-ratio)
            --accum N (gradient accumulation; DDP no_sync() on all but the last micro-step)
  precision --precision auto|bf16|fp16|fp32 (auto: bf16 on CUDA with bf16, fp16 +
            GradScaler on older CUDA, fp32 on CPU)
  DDP/speed --bucket-cap-mb (default 100 on CUDA, 25 on CPU) --static-graph/--no-static-graph
            (default: on when --accum 1; static_graph + no_sync() is broken upstream,
            pytorch/pytorch#143580) --channels-last --compile
            --grad-compression none|bf16|fp16|powersgd (--powersgd-rank)
            gradient_as_bucket_view is always on.
  run       --out DIR (metrics.jsonl, metrics.png)  --checkpoint-dir DIR (ckpt_step*.pt;
            default: --out)  --seed  --max-steps N  --resume [PATH] (default: newest
            checkpoint in --checkpoint-dir if any)  --no-resume  --ckpt-every N steps (and
            every epoch end)  --keep-ckpts K  --log-every N  --bench-warmup N (steps excluded
            from each epoch's images/s)  --no-plot  --device auto|cpu|cuda  --stop-timeout S

The LR schedule's length is --epochs x steps-per-epoch, independent of --max-steps, so
a run stopped with --max-steps and resumed follows the same schedule as one that ran
through. The last stdout line is ``FINAL {json}`` (rank 0) with epochs, steps,
train_loss, train_acc, val_acc, images_per_s (global, after warm-up), world_size, ...

Stopping and restarting (what a launcher relies on)
  SIGTERM   asks for a stop. At its next step boundary rank 0 writes a checkpoint of the
            last completed step (atomically, into --checkpoint-dir) and every rank exits with
            143. No host sync or collective is added per step for this: ranks that hear the
            signal at different boundaries, or a collective that fails because a peer has
            already left, still end in that save (see lifecycle.py). A rank blocked away from
            any boundary (a collective stuck on a departed peer) is stopped by a watchdog
            thread --stop-timeout seconds after the signal; on rank 0 it saves first. Keep
            --stop-timeout plus one checkpoint write under the launcher's grace period.
  restart   --resume auto (the default) continues from the newest checkpoint in
            --checkpoint-dir, on every attempt of a restarted job and across launches; point
            --checkpoint-dir at a place that outlives one run's --out. Resuming is for
            unfinished runs: when the newest checkpoint is at or past this run's last step
            (the run it came from finished), its checkpoints are moved to
            <checkpoint-dir>/finished-<time>/ and training starts anew (said on stdout).
Environment
  CLUSTER_RESTART_COUNT   the launcher's attempt number (0 first); shown as restart_count=N
                          in the start line and "restart_count" in FINAL when set
  CLUSTER_HEARTBEAT_FILE  every rank touches this file (creating it if missing) at start and
                          then at most once per second while steps complete (and while
                          evaluation batches do), for a hang watchdog; rank 0 writes
                          "section checkpoint" into it while it writes a checkpoint
Every folder and file the trainer makes is private (0700 / 0600, umask 077): --out,
--checkpoint-dir and what is in them.
Exit codes: 0 done (also when --max-steps ended it); 143 stopped by SIGTERM; 1 an error;
2 bad options, or a device that is not there (--device cuda without a GPU; more processes
on a node than it has GPUs: one process per GPU, or --device cpu).

Test hooks (environment): CLUSTER_TRAIN_TEST_STEP_SLEEP=SECONDS sleeps after every
optimizer step; CLUSTER_TRAIN_TEST_SAVE_SLEEP=STEP:SECONDS sleeps between writing and
renaming the checkpoint of STEP; CLUSTER_TRAIN_TEST_HANG_AFTER_STEP=N blocks the main thread
after step N, as a collective stuck on a departed peer would.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import NoReturn

if __package__ in (None, ""):
    # Plain script or torchrun: make the sibling modules importable.
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import checkpoint as ckpt_mod
    import data as data_mod
    import dist_utils as du
    import lifecycle
    import metrics as metrics_mod
    import models as models_mod
    import schedule as schedule_mod
    import steptime
else:
    from . import checkpoint as ckpt_mod
    from . import data as data_mod
    from . import dist_utils as du
    from . import lifecycle
    from . import metrics as metrics_mod
    from . import models as models_mod
    from . import schedule as schedule_mod
    from . import steptime

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

STEP_SLEEP_ENV = "CLUSTER_TRAIN_TEST_STEP_SLEEP"
HANG_ENV = "CLUSTER_TRAIN_TEST_HANG_AFTER_STEP"
FAIL_ENV = "CLUSTER_TRAIN_TEST_FAIL_AT_STEP"    # rank 0 raises at this step, in attempt 1 only
# After a collective fails, how long to wait for the SIGTERM that usually caused it (a peer
# that heard it first has left) before treating the failure as an error.
FAILED_COLLECTIVE_WAIT_S = 2.0


# ---- options ------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Reference PyTorch DDP training program",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("data")
    g.add_argument("--dataset", choices=["digits", "cifar10", "synthetic"], default="digits")
    g.add_argument("--data-dir", default="./data",
                   help="CIFAR-10: holds cifar-10-batches-py/ or cifar-10-python.tar.gz")
    g.add_argument("--steps-per-epoch", type=int, default=50, help="synthetic only")
    g.add_argument("--image-size", type=int, default=224, help="synthetic only")
    g.add_argument("--num-classes", type=int, default=1000, help="synthetic only")
    g.add_argument("--workers", type=int, default=None,
                   help="DataLoader workers per process (default: 0 for digits, else min(4, cpus/proc))")
    g.add_argument("--no-shuffle", action="store_true", help="fixed sample order")
    g = p.add_argument_group("model")
    g.add_argument("--model", choices=["cnn", "resnet18", "resnet50"], default="cnn")
    g.add_argument("--width", type=int, default=32, help="cnn base width")
    g.add_argument("--bn", action="store_true", help="batch norm in the cnn")
    g.add_argument("--sync-bn", action="store_true", help="convert BatchNorm to SyncBatchNorm")
    g = p.add_argument_group("optimisation")
    g.add_argument("--epochs", type=int, default=10)
    g.add_argument("--batch-size", type=int, default=32, help="per process")
    g.add_argument("--base-lr", type=float, default=0.2)
    g.add_argument("--base-batch", type=int, default=256, help="global batch that --base-lr is for")
    g.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd")
    g.add_argument("--momentum", type=float, default=0.9)
    g.add_argument("--weight-decay", type=float, default=5e-4)
    g.add_argument("--warmup-epochs", type=float, default=1.0)
    g.add_argument("--warmup-steps", type=int, default=None, help="overrides --warmup-epochs")
    g.add_argument("--min-lr-ratio", type=float, default=0.0)
    g.add_argument("--accum", type=int, default=1, help="gradient accumulation micro-steps")
    g.add_argument("--clip-grad", type=float, default=0.0, help="max grad norm (0: off)")
    g.add_argument("--label-smoothing", type=float, default=0.0)
    g = p.add_argument_group("precision and speed")
    g.add_argument("--precision", choices=["auto", "bf16", "fp16", "fp32"], default="auto")
    g.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    g.add_argument("--channels-last", action="store_true")
    g.add_argument("--compile", action="store_true", help="torch.compile the (DDP) model")
    g.add_argument("--bucket-cap-mb", type=float, default=None,
                   help="DDP bucket size (default: 100 on CUDA, 25 on CPU)")
    g.add_argument("--static-graph", dest="static_graph", action="store_true", default=None,
                   help="DDP static_graph (default: on when --accum 1)")
    g.add_argument("--no-static-graph", dest="static_graph", action="store_false")
    g.add_argument("--grad-compression", choices=["none", "bf16", "fp16", "powersgd"], default="none")
    g.add_argument("--powersgd-rank", type=int, default=1)
    g.add_argument("--bench-warmup", type=int, default=5,
                   help="steps at the start of each epoch left out of images/s")
    g = p.add_argument_group("run")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--max-steps", type=int, default=None, help="stop after this many optimizer steps")
    g.add_argument("--out", default="./out", help="metrics.jsonl, metrics.png")
    g.add_argument("--checkpoint-dir", default=None,
                   help="checkpoints, and where --resume auto looks (default: --out)")
    g.add_argument("--resume", nargs="?", const="auto", default="auto",
                   help="'auto' (default): newest checkpoint in --checkpoint-dir if any; or a path")
    g.add_argument("--no-resume", dest="resume", action="store_const", const=None)
    g.add_argument("--ckpt-every", type=int, default=100, help="steps (0: epoch ends only)")
    g.add_argument("--keep-ckpts", type=int, default=3)
    g.add_argument("--log-every", type=int, default=10)
    g.add_argument("--no-plot", action="store_true")
    g.add_argument("--stop-timeout", type=float, default=10.0,
                   help="seconds after SIGTERM before a rank that has not reached a step boundary"
                        " is stopped from a watchdog thread (rank 0 saves first)")
    args = p.parse_args(argv)
    if args.accum < 1 or args.batch_size < 1:
        p.error("--accum and --batch-size must be >= 1")
    if args.stop_timeout < 0:
        p.error("--stop-timeout must be >= 0")
    return args


# ---- what the run is made of ---------------------------------------------------------------

@dataclass
class Plan:
    """What the run decided before its first step."""
    precision: str
    amp_dtype: torch.dtype | None
    global_batch: int
    steps_per_epoch: int
    total_steps: int
    warmup: int
    lr: float
    ddp: bool  # wrapped in DistributedDataParallel: world size > 1
    static_graph: bool
    bucket_cap_mb: float


@dataclass
class Parts:
    """The model and what trains it."""
    model: nn.Module  # the module itself: state_dict, evaluation
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LambdaLR
    scaler: torch.amp.GradScaler
    crit: nn.Module
    ddp: DDP | None = None
    net: nn.Module | None = None  # what a training step calls: model, DDP(model), compiled


@dataclass
class Progress:
    """Where the run is. `point()` is what a checkpoint needs to continue from here."""
    epoch: int = 0
    pos: int = 0  # optimizer steps done in this epoch
    step: int = 0  # optimizer steps done in the run
    totals: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])  # loss*n, correct, n (global)
    last_summary: dict = field(default_factory=dict)
    saved_step: int = -1  # step of the newest checkpoint written or loaded
    val_loss: float | None = None
    val_acc: float | None = None
    bench_images: float = 0.0
    bench_time: float = 0.0
    stopped_early: bool = False

    def point(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos, "step": self.step,
                "totals": list(self.totals), "last_summary": self.last_summary}


@dataclass
class TestHooks:
    step_sleep: float = 0.0
    hang_after_step: int | None = None
    fail_at_step: int | None = None

    @classmethod
    def from_env(cls) -> "TestHooks":
        hang, fail = os.environ.get(HANG_ENV), os.environ.get(FAIL_ENV)
        first = os.environ.get("CLUSTER_RESTART_COUNT", "0") in ("", "0")
        return cls(float(os.environ.get(STEP_SLEEP_ENV, "0") or 0), int(hang) if hang else None,
                   int(fail) if fail and first else None)


@dataclass
class Run:
    args: argparse.Namespace
    info: du.DistInfo
    plan: Plan
    data: data_mod.Data
    parts: Parts
    log: metrics_mod.MetricsLog
    stop: lifecycle.GracefulStop
    ledger: lifecycle.StepLedger
    metrics: metrics_mod.StepMetrics
    heartbeat: lifecycle.Heartbeat
    hooks: TestHooks
    t_start: float
    step_times: steptime.StepTimes   # each step's own compute and data time, for the launcher
    pace: lifecycle.StepPace = field(default_factory=lifecycle.StepPace)  # the stop's patience

    def amp(self):
        if self.plan.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.info.device.type, dtype=self.plan.amp_dtype)


# ---- setup ------------------------------------------------------------------------------------

def main(argv=None) -> int:
    # What the run writes is private, as the rest of cluster's run folder (0700 folders, 0600
    # files), whatever umask the job came with: metrics, plot, checkpoints, step times.
    os.umask(0o077)
    args = parse_args(argv)
    stop = lifecycle.GracefulStop(args.stop_timeout)
    stop.install()
    try:
        info = du.init_distributed(args.device)
    except du.DeviceError as e:   # what to do, once per node, without a traceback
        if e.tell:
            print(f"train.py: error: {e}", file=sys.stderr, flush=True)
        return 2
    try:
        code = train(args, info, stop)
        # Every rank leaves together: a rank tearing gloo down while rank 0 still writes its
        # plot has been seen to abort ("terminate called without an active exception"), and
        # so has one still tearing down while a peer had exited (dist_utils.leave_together).
        du.barrier(info)
        du.leave_together(info)
        return code
    finally:
        du.cleanup_distributed()


def train(args, info: du.DistInfo, stop: lifecycle.GracefulStop) -> int:
    """The whole run, step by step."""
    t_start = time.time()
    heartbeat = lifecycle.Heartbeat.from_env()  # first beat now: set-up can take a while
    resolve_defaults(args)
    configure_torch(info.device)
    if info.is_main:
        os.makedirs(args.out, exist_ok=True)
        os.makedirs(args.checkpoint_dir, exist_ok=True)
    du.barrier(info)
    data = data_mod.build_data(args, info, lambda: du.barrier(info))
    plan = make_plan(args, info, data)
    parts = build_model(args, info, plan, data)
    progress, resumed_from = restore(args, info, plan, parts)
    wrap_model(args, info, plan, parts)
    step_times = steptime.StepTimes(heartbeat.path, info.rank, info.device)
    step_times.watch(parts.model)
    run = Run(args, info, plan, data, parts,
              log=metrics_mod.MetricsLog(args.out, info.is_main, progress.step if resumed_from else None),
              stop=stop, ledger=lifecycle.StepLedger(info.device, progress.point()),
              metrics=metrics_mod.StepMetrics(info.device), heartbeat=heartbeat,
              hooks=TestHooks.from_env(), t_start=t_start, step_times=step_times)
    announce(run, progress, resumed_from)
    train_epochs(run, progress)
    return finish(run, progress, resumed_from)


def resolve_defaults(args) -> None:
    if args.checkpoint_dir is None:
        args.checkpoint_dir = args.out
    if args.workers is None:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        cpus = max(1, (os.cpu_count() or 1) // max(1, local_world))
        args.workers = 0 if args.dataset in ("digits", "synthetic") else min(4, cpus)


def configure_torch(device: torch.device) -> None:
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # fixed shapes: pick the fastest kernels once
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def resolve_precision(p: str, device: torch.device) -> str:
    if p != "auto":
        if device.type == "cpu" and p == "fp16":
            print("warning: fp16 autocast on CPU is slow; prefer bf16 or fp32", file=sys.stderr)
        return p
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return "fp32"


def make_plan(args, info: du.DistInfo, data: data_mod.Data) -> Plan:
    precision = resolve_precision(args.precision, info.device)
    spe = data.steps_per_epoch
    global_batch = args.batch_size * info.world_size * args.accum
    static_graph = args.static_graph
    if static_graph is None:
        static_graph = args.accum == 1
    elif static_graph and args.accum > 1:
        if info.is_main:
            print("warning: --static-graph with --accum > 1 (no_sync) is broken upstream"
                  " (pytorch/pytorch#143580); turning static_graph off", file=sys.stderr)
        static_graph = False
    ddp = info.peers
    if not ddp and args.grad_compression != "none" and info.is_main:
        print("warning: one process: no gradients are communicated, --grad-compression has no effect",
              file=sys.stderr)
    return Plan(
        precision=precision,
        amp_dtype={"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision),
        global_batch=global_batch, steps_per_epoch=spe, total_steps=spe * args.epochs,
        warmup=args.warmup_steps if args.warmup_steps is not None else int(round(args.warmup_epochs * spe)),
        lr=args.base_lr * global_batch / args.base_batch, ddp=ddp, static_graph=static_graph,
        bucket_cap_mb=args.bucket_cap_mb if args.bucket_cap_mb is not None
        else (100.0 if info.device.type == "cuda" else 25.0))


# ---- model ------------------------------------------------------------------------------------

def build_model(args, info: du.DistInfo, plan: Plan, data: data_mod.Data) -> Parts:
    torch.manual_seed(args.seed)  # identical initial weights on every rank
    model = models_mod.build_model(args.model, data.in_channels, data.num_classes,
                                   batch_norm=args.bn, width=args.width)
    if args.sync_bn and plan.ddp:
        if info.device.type == "cuda":
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        elif info.is_main:
            print("warning: --sync-bn needs CUDA; keeping per-process BatchNorm", file=sys.stderr)
    model.to(info.device)
    if args.channels_last:
        model.to(memory_format=torch.channels_last)
    if args.optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=plan.lr, momentum=args.momentum,
                              weight_decay=args.weight_decay, nesterov=args.momentum > 0)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=plan.lr, weight_decay=args.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, schedule_mod.LRLambda(plan.warmup, plan.total_steps, args.min_lr_ratio))
    scaler = torch.amp.GradScaler(info.device.type, enabled=plan.precision == "fp16")
    if scaler.is_enabled():
        # The scaler skips optimizer steps whose gradients overflowed; the schedule
        # still advances by one per step on purpose, so PyTorch's ordering warning is noise.
        import warnings
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step()`")
    return Parts(model, opt, sched, scaler, nn.CrossEntropyLoss(label_smoothing=args.label_smoothing))


def wrap_model(args, info: du.DistInfo, plan: Plan, parts: Parts) -> None:
    """DDP (world size > 1): gradients averaged over ranks during backward, in buckets."""
    net: nn.Module = parts.model
    if plan.ddp:
        kw = dict(gradient_as_bucket_view=True, bucket_cap_mb=plan.bucket_cap_mb,
                  static_graph=plan.static_graph)
        if info.device.type == "cuda":
            kw.update(device_ids=[info.local_rank], output_device=info.local_rank)
        parts.ddp = net = DDP(parts.model, **kw)
        register_comm_hook(parts.ddp, args, plan, info)
    parts.net = torch.compile(net) if args.compile else net


def register_comm_hook(model: DDP, args, plan: Plan, info: du.DistInfo) -> None:
    kind = args.grad_compression
    if kind == "none":
        return
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as dh
    if kind == "fp16":
        model.register_comm_hook(None, dh.fp16_compress_hook)
    elif kind == "bf16":
        if info.backend != "nccl":
            raise SystemExit("--grad-compression bf16 needs NCCL (CUDA); on gloo use fp16 or powersgd")
        model.register_comm_hook(None, dh.bf16_compress_hook)
    elif kind == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps
        state = ps.PowerSGDState(process_group=None,
                                 matrix_approximation_rank=args.powersgd_rank,
                                 start_powerSGD_iter=max(2, plan.total_steps // 10))
        model.register_comm_hook(state, ps.powerSGD_hook)


# ---- resume -----------------------------------------------------------------------------------

def resolve_resume(args, info: du.DistInfo, plan: Plan) -> tuple[str | None, dict | None]:
    """Rank 0 picks the checkpoint; every rank loads it (or gets it broadcast)."""
    path = None
    if info.is_main and args.resume is not None:
        removed = ckpt_mod.remove_stale_temps(args.checkpoint_dir)
        if removed:
            print(f"removed stale temp files from an interrupted save: {removed}", file=sys.stderr)
        if args.resume == "auto":
            found = ckpt_mod.load_latest(args.checkpoint_dir)
            if found and found[1]["step"] >= plan.total_steps:
                start_anew(args, found[0], found[1]["step"], plan)
                found = None
            path = found[0] if found else None
        else:
            path = args.resume if os.path.exists(args.resume) else "!missing:" + args.resume
    path = du.broadcast_object(path, info)
    if path is None:
        return None, None
    if path.startswith("!missing:"):
        raise SystemExit(f"--resume {path[9:]}: no such file")
    sees = du.all_gather_object(os.path.exists(path), info)
    if all(sees):
        state = ckpt_mod.load_checkpoint(path)
    else:  # checkpoint dir not shared between nodes: ship rank 0's copy
        state = du.broadcast_object(ckpt_mod.load_checkpoint(path) if info.is_main else None, info)
    return path, state


def start_anew(args, path: str, step: int, plan: Plan) -> None:
    """The newest checkpoint ends a finished run (nothing of this run's steps is left to
    train from it): resuming is for unfinished runs. Its checkpoints are set aside, where
    --resume can still name them, and this run trains from the start."""
    kept = ckpt_mod.set_aside(args.checkpoint_dir, time.strftime("finished-%Y%m%d-%H%M%S") + f"-step{step}")
    again = os.path.join(kept, os.path.basename(path))
    print(f"not resuming: {path} is the end of a finished run (step {step}; this run has "
          f"{plan.total_steps} steps); training anew. Its checkpoints are kept in {kept}/; "
          f"`--resume {again}` with more --epochs would continue it", flush=True)


def seed_rank_streams(seed: int) -> None:
    """Per-rank random streams (augmentation, dropout); weights were seeded identically before."""
    import random

    import numpy as np
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def restore(args, info: du.DistInfo, plan: Plan, parts: Parts) -> tuple[Progress, str | None]:
    path, state = resolve_resume(args, info, plan)
    progress = Progress()
    if state is None:
        seed_rank_streams(args.seed + info.rank)
        return progress, None
    parts.model.load_state_dict(state["model"])
    parts.opt.load_state_dict(state["optimizer"])
    parts.sched.load_state_dict(state["scheduler"])
    parts.scaler.load_state_dict(state["scaler"])
    progress.epoch, progress.pos, progress.step = state["epoch"], state["step_in_epoch"], state["step"]
    progress.totals = list(state.get("epoch_totals", progress.totals))
    progress.last_summary = state.get("last_summary", {})
    progress.saved_step = progress.step
    rng = state["rng"]
    mine = rng[info.rank % len(rng)]
    if mine is not None:
        ckpt_mod.set_rng_state(mine)
    else:  # a checkpoint written on a stop holds rank 0's streams only
        seed_rank_streams(args.seed + info.rank + 1_000_003 * progress.step)
    if (state.get("world_size") != info.world_size or state.get("global_batch") != plan.global_batch) \
            and info.is_main:
        print(f"warning: checkpoint was written with world_size={state.get('world_size')}"
              f" global_batch={state.get('global_batch')}; now {info.world_size} /"
              f" {plan.global_batch}: the data order after resume differs", file=sys.stderr)
    return progress, path


def announce(run: Run, progress: Progress, resumed_from: str | None) -> None:
    args, info, plan = run.args, run.info, run.plan
    restarts = lifecycle.restart_count()
    run.log.write({"type": "run", "step": progress.step, "world_size": info.world_size,
                   "per_rank_batch": args.batch_size, "accum": args.accum,
                   "global_batch": plan.global_batch, "lr": plan.lr, "precision": plan.precision,
                   "dataset": args.dataset, "model": args.model, "backend": info.backend,
                   "device": str(info.device), "static_graph": plan.static_graph if plan.ddp else None,
                   "bucket_cap_mb": plan.bucket_cap_mb, "grad_compression": args.grad_compression,
                   "steps_per_epoch": plan.steps_per_epoch, "epochs": args.epochs,
                   "resumed_from": resumed_from, "restart_count": restarts,
                   "checkpoint_dir": os.path.abspath(args.checkpoint_dir)})
    run.log.print(f"world_size={info.world_size} backend={info.backend} device={info.device}"
                  f" precision={plan.precision} per-rank batch={args.batch_size} x accum {args.accum}"
                  f" -> global batch={plan.global_batch} lr={plan.lr:g} (base {args.base_lr:g} @"
                  f" {args.base_batch}) warmup={plan.warmup} steps/epoch={plan.steps_per_epoch}"
                  f" total steps={plan.total_steps}"
                  + (f" restart_count={restarts}" if restarts is not None else ""))
    if resumed_from:
        run.log.print(f"resumed from {resumed_from}: epoch {progress.epoch} step {progress.step}"
                      f" ({progress.pos} steps into the epoch)")


# ---- epochs and steps -------------------------------------------------------------------------

def train_epochs(run: Run, progress: Progress) -> None:
    """Epochs until --epochs or --max-steps; a stop request ends the process from inside."""
    rescue = (lambda: save_on_stop(run, progress, wait_s=1.0)) if run.info.is_main else None
    run.stop.begin_training(rescue, run.pace.patience)
    try:
        while progress.epoch < run.args.epochs:
            if max_steps_reached(run, progress):
                progress.stopped_early = True
                break
            clock = train_one_epoch(run, progress)
            with run.pace.long():
                full = end_epoch(run, progress, clock)
            if not full:
                break
    except Exception:
        # A collective fails when a peer that heard SIGTERM first has left; our own signal is
        # usually a moment behind. Either way the last completed step is intact: save it.
        if run.stop.requested.wait(FAILED_COLLECTIVE_WAIT_S):
            e = sys.exc_info()[1]
            print(f"stop: rank {run.info.rank}: a collective failed during the stop"
                  f" ({type(e).__name__}: {str(e)[:160]}); the last completed step is"
                  f" {run.ledger.newest()['step']}", file=sys.stderr, flush=True)
            stop_now(run, progress)
        run.step_times.mark()       # the step this attempt failed at, for the launcher
        raise
    finally:
        run.stop.end_training()


def max_steps_reached(run: Run, progress: Progress) -> bool:
    return run.args.max_steps is not None and progress.step >= run.args.max_steps


def train_one_epoch(run: Run, progress: Progress) -> metrics_mod.EpochClock:
    """Optimizer steps from progress.pos to the end of the epoch, or to --max-steps."""
    spe = run.plan.steps_per_epoch
    batches = run.data.train.epoch(progress.epoch, progress.pos)
    clock = metrics_mod.EpochClock(run.info.device, run.args.bench_warmup, progress.pos)
    while progress.pos < spe and not max_steps_reached(run, progress):
        train_step(run, progress, batches)
        clock.step_done(progress.pos, spe)
        after_step(run, progress)
    clock.stop(progress.pos)
    return clock


def train_step(run: Run, progress: Progress, batches) -> None:
    """One optimizer step: --accum micro-steps, gradients all-reduced on the last one only
    (DDP's no_sync() on the others), then the parameter update, recorded in the ledger."""
    p, accum = run.parts, run.args.accum
    run.step_times.begin()
    for m in range(accum):
        x, y = run.step_times.next(batches)
        skip_sync = p.ddp is not None and m < accum - 1
        with p.ddp.no_sync() if skip_sync else contextlib.nullcontext():
            with run.amp():
                out = p.net(x)
                loss = p.crit(out, y)
            p.scaler.scale(loss / accum if accum > 1 else loss).backward()
        run.metrics.add(loss, out, y)
    if run.args.clip_grad > 0:
        p.scaler.unscale_(p.opt)
        torch.nn.utils.clip_grad_norm_(p.model.parameters(), run.args.clip_grad)
    with run.ledger.update(progress.point):
        p.scaler.step(p.opt)  # a plain opt.step() when the scaler is disabled (bf16, fp32)
        p.scaler.update()
        p.opt.zero_grad(set_to_none=True)
        p.sched.step()
        progress.pos += 1
        progress.step += 1
    run.step_times.end(progress.step)


def after_step(run: Run, progress: Progress) -> None:
    """A step boundary. Collectives first (metrics, periodic checkpoint), so that every rank
    does them at the same step; then what is local: heartbeat, stop request."""
    args = run.args
    run.metrics.log_steps += 1
    if run.hooks.step_sleep:
        time.sleep(run.hooks.step_sleep)
    if args.log_every and progress.step % args.log_every == 0:
        log_window(run, progress)
    if args.ckpt_every and progress.step % args.ckpt_every == 0 and progress.pos < run.plan.steps_per_epoch:
        run.metrics.flush(run.info, progress.totals)
        with run.pace.long():
            save_checkpoint(run, progress)
    run.heartbeat.beat()
    run.pace.boundary()
    if run.hooks.hang_after_step == progress.step:
        threading.Event().wait()
    if run.hooks.fail_at_step == progress.step and run.info.is_main:
        raise RuntimeError(f"test failure at step {progress.step} ({FAIL_ENV})")
    if run.stop.requested.is_set():
        stop_now(run, progress)


def log_window(run: Run, progress: Progress) -> None:
    run.metrics.flush(run.info, progress.totals)
    loss, acc, ips, step_s = run.metrics.take_log_window()
    lr = run.parts.opt.param_groups[0]["lr"]
    run.log.write({"type": "step", "step": progress.step,
                   "epoch": progress.epoch + progress.pos / run.plan.steps_per_epoch,
                   "loss": loss, "acc": acc, "lr": lr, "images_per_s": ips, "step_time_s": step_s})
    run.log.print(f"epoch {progress.epoch} step {progress.step} loss {loss:.4f} acc {acc:.4f}"
                  f" lr {lr:.4g} {ips:.0f} img/s {step_s * 1e3:.1f} ms/step")


def end_epoch(run: Run, progress: Progress, clock: metrics_mod.EpochClock) -> bool:
    """Metrics, held-out evaluation, summary and checkpoint at the end of an epoch, or where
    --max-steps cut it. True when the epoch ran to its end."""
    ips = clock.steps * run.plan.global_batch / clock.seconds if clock.steps > 0 else None
    progress.bench_images += clock.steps * run.plan.global_batch
    progress.bench_time += clock.seconds if clock.steps > 0 else 0.0
    run.metrics.flush(run.info, progress.totals)
    if run.data.val is not None:
        progress.val_loss, progress.val_acc = evaluate(run)
    spe, full = run.plan.steps_per_epoch, progress.pos >= run.plan.steps_per_epoch
    n = max(progress.totals[2], 1.0)
    summary = {"epoch": progress.epoch + (1 if full else progress.pos / spe), "step": progress.step,
               "train_loss": progress.totals[0] / n, "train_acc": progress.totals[1] / n,
               "val_loss": progress.val_loss, "val_acc": progress.val_acc,
               "type": "epoch" if full else "partial_epoch", "images_per_s": ips}
    if full:
        summary["epoch_time_s"] = clock.elapsed
    progress.last_summary = summary
    run.log.write(dict(summary))
    if full:
        va = (f" val_acc {progress.val_acc:.4f} val_loss {progress.val_loss:.4f}"
              if progress.val_acc is not None else "")
        run.log.print(f"== epoch {progress.epoch + 1}/{run.args.epochs} step {progress.step} train_loss"
                      f" {summary['train_loss']:.4f} train_acc {summary['train_acc']:.4f}{va}"
                      f"{f' {ips:.0f} img/s' if ips else ''} ({clock.elapsed:.2f}s)")
        progress.totals = [0.0, 0.0, 0.0]
        progress.epoch, progress.pos = progress.epoch + 1, 0
    else:
        progress.stopped_early = True
    save_checkpoint(run, progress)
    return full


def evaluate(run: Run) -> tuple[float, float]:
    """Held-out loss and accuracy: each rank a strided shard, sums all-reduced (exact)."""
    model, info = run.parts.model, run.info
    model.eval()
    buf = torch.zeros(3, dtype=torch.float64, device=info.device)
    crit = nn.CrossEntropyLoss(reduction="sum")
    with torch.no_grad():
        for x, y in run.data.val.epoch():
            with run.amp():
                out = model(x)
            buf[0] += crit(out.float(), y).double()
            buf[1] += (out.argmax(1) == y).sum()
            buf[2] += y.numel()
            run.heartbeat.beat()
    du.all_reduce_sum(buf, info)
    model.train()
    loss, correct, n = buf.tolist()
    return loss / max(n, 1), correct / max(n, 1)


# ---- checkpoints ------------------------------------------------------------------------------

def training_state(run: Run) -> dict:
    p = run.parts
    return {"model": p.model.state_dict(), "optimizer": p.opt.state_dict(),
            "scheduler": p.sched.state_dict(), "scaler": p.scaler.state_dict()}


def write_checkpoint(run: Run, point: dict, state: dict, rng: list) -> str:
    """Rank 0: one atomic file in --checkpoint-dir; the oldest beyond --keep-ckpts go."""
    st = {**state, "epoch": point["epoch"], "step_in_epoch": point["pos"], "step": point["step"],
          "rng": rng, "epoch_totals": point["totals"], "last_summary": point["last_summary"],
          "world_size": run.info.world_size, "global_batch": run.plan.global_batch,
          "args": vars(run.args)}
    return ckpt_mod.save_checkpoint(st, run.args.checkpoint_dir, run.args.keep_ckpts)


def save_checkpoint(run: Run, progress: Progress) -> None:
    """Every rank's RNG state goes to rank 0 (one collective), which writes the file. The
    time it took, the gather's included, is reported with it (goodput's checkpoint saves)."""
    began = time.monotonic()
    rng = du.all_gather_object(ckpt_mod.rng_state(), run.info)
    if run.info.is_main:
        with run.heartbeat.section("checkpoint"):
            write_checkpoint(run, progress.point(), training_state(run), rng)
        run.step_times.saved(progress.step, time.monotonic() - began)
    progress.saved_step = progress.step


def save_on_stop(run: Run, progress: Progress, wait_s: float) -> None:
    """Rank 0, on a stop: the newest step whose update has finished, without collectives
    (peers may have left). Only rank 0's random streams are known here."""
    if run.info.device.type == "cuda":
        torch.cuda.set_device(run.info.device)  # the watchdog thread starts on device 0
    got = run.ledger.capture(lambda: lifecycle.to_cpu(training_state(run)), wait_s)
    if got is None:
        print("stop: no completed step can be saved consistently; the newest checkpoint stays"
              " the last one written", file=sys.stderr, flush=True)
        return
    point, state = got
    if point["step"] <= progress.saved_step:
        run.log.print(f"stop requested (SIGTERM) at step {point['step']}: already checkpointed")
        return
    rng = [ckpt_mod.rng_state()] + [None] * (run.info.world_size - 1)
    began = time.monotonic()
    path = write_checkpoint(run, point, state, rng)
    progress.saved_step = point["step"]
    run.step_times.saved(point["step"], time.monotonic() - began)
    run.log.write({"type": "stop", "step": point["step"], "checkpoint": path})
    run.log.print(f"stop requested (SIGTERM): saved step {point['step']} to {path}")


def stop_now(run: Run, progress: Progress) -> NoReturn:
    """Save (rank 0) and leave with 143. Other ranks first let their queued GPU work finish
    (bounded), so that rank 0's matching collectives complete."""
    if not run.stop.claim():
        threading.Event().wait()  # the watchdog thread is saving; it ends the process
    try:
        if run.info.is_main:
            save_on_stop(run, progress, run.args.stop_timeout)
        else:
            run.ledger.wait_finished(run.args.stop_timeout)
    finally:
        lifecycle.exit_now(lifecycle.STOP_EXIT_CODE)


# ---- finish -------------------------------------------------------------------------------------

def finish(run: Run, progress: Progress, resumed_from: str | None) -> int:
    s = progress.last_summary
    final = {"epochs": s.get("epoch", 0), "steps": progress.step,
             "train_loss": s.get("train_loss"), "train_acc": s.get("train_acc"),
             "val_loss": s.get("val_loss"), "val_acc": s.get("val_acc"),
             "images_per_s": progress.bench_images / progress.bench_time if progress.bench_time > 0 else None,
             "world_size": run.info.world_size, "global_batch": run.plan.global_batch,
             "precision": run.plan.precision, "dataset": run.args.dataset, "model": run.args.model,
             "stopped_early": progress.stopped_early, "resumed_from": resumed_from,
             "wall_s": time.time() - run.t_start}
    restarts = lifecycle.restart_count()
    if restarts is not None:
        final["restart_count"] = restarts
    if run.info.is_main:
        run.log.write({"type": "final", **final})
        if not run.args.no_plot:
            try:
                metrics_mod.plot_metrics(run.log.path, os.path.join(run.args.out, "metrics.png"))
            except Exception as e:  # a plot must never fail the run
                print(f"warning: plot failed: {e}", file=sys.stderr)
        print("FINAL " + json.dumps(final), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
