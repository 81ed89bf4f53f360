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

Flags (see --help for every default)
  data      --dataset digits|cifar10|synthetic   --data-dir DIR (cifar10: used if present,
            downloaded only when missing, clear error otherwise)   --steps-per-epoch N,
            --image-size, --num-classes (synthetic: tensors made on the device, no loader)
            --workers N (default 0 for in-memory digits, else min(4, cpus per process))
            --no-shuffle (fixed sample order, for tests)
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
  run       --out DIR (metrics.jsonl, metrics.png, ckpt_step*.pt)  --seed  --max-steps N
            --resume [PATH] (default: newest checkpoint in --out if any)  --no-resume
            --ckpt-every N steps (and every epoch end)  --keep-ckpts K  --log-every N
            --bench-warmup N (steps excluded from each epoch's images/s)  --no-plot
            --device auto|cpu|cuda

The LR schedule's length is --epochs x steps-per-epoch, independent of --max-steps, so
a run stopped with --max-steps and resumed follows the same schedule as one that ran
through. The last stdout line is ``FINAL {json}`` (rank 0) with epochs, steps,
train_loss, train_acc, val_acc, images_per_s (global, after warm-up), world_size, ...

Test hooks (environment): CLUSTER_TRAIN_TEST_STEP_SLEEP=SECONDS sleeps after every
optimizer step; CLUSTER_TRAIN_TEST_SAVE_SLEEP=STEP:SECONDS sleeps between writing and
renaming the checkpoint of STEP.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

if __package__ in (None, ""):
    # Plain script or torchrun: make the sibling modules importable.
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import checkpoint as ckpt_mod
    import data as data_mod
    import dist_utils as du
    import metrics as metrics_mod
    import models as models_mod
    import schedule as schedule_mod
else:
    from . import checkpoint as ckpt_mod
    from . import data as data_mod
    from . import dist_utils as du
    from . import metrics as metrics_mod
    from . import models as models_mod
    from . import schedule as schedule_mod

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

STEP_SLEEP_ENV = "CLUSTER_TRAIN_TEST_STEP_SLEEP"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Reference PyTorch DDP training program",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("data")
    g.add_argument("--dataset", choices=["digits", "cifar10", "synthetic"], default="digits")
    g.add_argument("--data-dir", default="./data", help="CIFAR-10 root")
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
    g.add_argument("--compile", action="store_true", help="torch.compile the DDP model")
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
    g.add_argument("--out", default="./out")
    g.add_argument("--resume", nargs="?", const="auto", default="auto",
                   help="'auto' (default): newest checkpoint in --out if any; or a path")
    g.add_argument("--no-resume", dest="resume", action="store_const", const=None)
    g.add_argument("--ckpt-every", type=int, default=100, help="steps (0: epoch ends only)")
    g.add_argument("--keep-ckpts", type=int, default=3)
    g.add_argument("--log-every", type=int, default=10)
    g.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    if args.accum < 1 or args.batch_size < 1:
        p.error("--accum and --batch-size must be >= 1")
    return args


def resolve_precision(p: str, device: torch.device) -> str:
    if p != "auto":
        if device.type == "cpu" and p == "fp16":
            print("warning: fp16 autocast on CPU is slow; prefer bf16 or fp32", file=sys.stderr)
        return p
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return "fp32"


def register_comm_hook(model: DDP, kind: str, args, total_steps: int, info) -> None:
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
                                 start_powerSGD_iter=max(2, total_steps // 10))
        model.register_comm_hook(state, ps.powerSGD_hook)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def evaluate(model: nn.Module, loader, info, amp_ctx, channels_last: bool) -> tuple[float, float]:
    model.eval()
    buf = torch.zeros(3, dtype=torch.float64, device=info.device)
    crit = nn.CrossEntropyLoss(reduction="sum")
    with torch.no_grad():
        for x, y in loader:
            x = x.to(info.device, non_blocking=True)
            y = y.to(info.device, non_blocking=True)
            if channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            with amp_ctx():
                out = model(x)
            buf[0] += crit(out.float(), y).double()
            buf[1] += (out.argmax(1) == y).sum()
            buf[2] += y.numel()
    du.all_reduce_sum(buf, info)
    model.train()
    loss, correct, n = buf.tolist()
    return loss / max(n, 1), correct / max(n, 1)


def resolve_resume(args, info) -> tuple[str | None, dict | None]:
    """Rank 0 picks the checkpoint; every rank loads it (or gets it broadcast)."""
    path = None
    if info.is_main and args.resume is not None:
        removed = ckpt_mod.remove_stale_temps(args.out)
        if removed:
            print(f"removed stale temp files from an interrupted save: {removed}", file=sys.stderr)
        if args.resume == "auto":
            found = ckpt_mod.load_latest(args.out)
            path = found[0] if found else None
        else:
            if not os.path.exists(args.resume):
                path = "!missing:" + args.resume
            else:
                path = args.resume
    path = du.broadcast_object(path, info)
    if path is None:
        return None, None
    if path.startswith("!missing:"):
        raise SystemExit(f"--resume {path[9:]}: no such file")
    sees = du.all_gather_object(os.path.exists(path), info)
    if all(sees):
        state = ckpt_mod.load_checkpoint(path)
    else:  # out dir not shared between nodes: ship rank 0's copy
        state = du.broadcast_object(ckpt_mod.load_checkpoint(path) if info.is_main else None, info)
    return path, state


def main(argv=None) -> int:
    args = parse_args(argv)
    du.install_signal_handlers()
    info = du.init_distributed(args.device)
    try:
        code = train(args, info)
        # Every rank leaves together: a rank tearing gloo down while rank 0 still writes its
        # plot has been seen to abort ("terminate called without an active exception").
        du.barrier(info)
        return code
    finally:
        du.cleanup_distributed()


def train(args, info) -> int:
    t_start = time.time()
    device = info.device
    world = info.world_size
    is_cuda = device.type == "cuda"
    os.makedirs(args.out, exist_ok=True) if info.is_main else None
    du.barrier(info)
    log = None  # set after resume is resolved

    if is_cuda:
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if args.workers is None:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        cpus = max(1, (os.cpu_count() or 1) // max(1, local_world))
        args.workers = 0 if args.dataset in ("digits", "synthetic") else min(4, cpus)

    precision = resolve_precision(args.precision, device)
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)

    def amp_ctx():
        if amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=amp_dtype)

    # ---- data ---------------------------------------------------------------------
    spec = data_mod.build_data(args, info.is_main, lambda: du.barrier(info))
    synthetic = spec.train is None
    if synthetic:
        spe = args.steps_per_epoch
        loader = sampler = val_loader = None
        synth = data_mod.SyntheticBatches(args.batch_size, spec.image_size, spec.num_classes,
                                          device, args.seed + info.rank, args.channels_last)
    else:
        loader, sampler = data_mod.make_train_loader(spec.train, args, info.rank, world, is_cuda)
        val_loader = data_mod.make_val_loader(spec.val, args, info.rank, world, is_cuda)
        spe = data_mod.steps_per_epoch(len(spec.train), args, world)
        if spe < 1:
            raise SystemExit("dataset too small for this --batch-size x world size x --accum")
    global_batch = args.batch_size * world * args.accum
    total_steps = spe * args.epochs
    warmup = args.warmup_steps if args.warmup_steps is not None else int(round(args.warmup_epochs * spe))
    lr = args.base_lr * global_batch / args.base_batch

    # ---- model / optimiser ----------------------------------------------------------
    torch.manual_seed(args.seed)  # identical initial weights on every rank
    model = models_mod.build_model(args.model, spec.in_channels, spec.num_classes,
                                   batch_norm=args.bn, width=args.width)
    if args.sync_bn and info.distributed:
        if is_cuda:
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        elif info.is_main:
            print("warning: --sync-bn needs CUDA; keeping per-process BatchNorm", file=sys.stderr)
    model.to(device)
    if args.channels_last:
        model.to(memory_format=torch.channels_last)
    if args.optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=args.momentum,
                              weight_decay=args.weight_decay, nesterov=args.momentum > 0)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=args.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule_mod.LRLambda(warmup, total_steps, args.min_lr_ratio))
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    if scaler.is_enabled():
        # The scaler skips optimizer steps whose gradients overflowed; the schedule
        # still advances by one per step on purpose, so PyTorch's ordering warning is noise.
        import warnings
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step()`")

    # ---- resume ---------------------------------------------------------------------
    resume_path, state = resolve_resume(args, info)
    start_epoch, start_pos, step = 0, 0, 0
    totals = [0.0, 0.0, 0.0]  # global loss*n, correct, n of the current epoch
    last_summary: dict = {}
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        scaler.load_state_dict(state["scaler"])
        start_epoch, start_pos, step = state["epoch"], state["step_in_epoch"], state["step"]
        totals = list(state.get("epoch_totals", totals))
        last_summary = state.get("last_summary", {})
        rng = state["rng"]
        ckpt_mod.set_rng_state(rng[info.rank % len(rng)])
        if state.get("world_size") != world or state.get("global_batch") != global_batch:
            if info.is_main:
                print(f"warning: checkpoint was written with world_size={state.get('world_size')}"
                      f" global_batch={state.get('global_batch')}; now {world} / {global_batch}:"
                      " the data order after resume differs", file=sys.stderr)
    else:
        torch.manual_seed(args.seed + info.rank)  # per-rank streams for augmentation etc.
        import random

        import numpy as np
        random.seed(args.seed + info.rank)
        np.random.seed(args.seed + info.rank)

    # ---- DDP ------------------------------------------------------------------------
    static_graph = args.static_graph
    if static_graph is None:
        static_graph = args.accum == 1
    elif static_graph and args.accum > 1:
        if info.is_main:
            print("warning: --static-graph with --accum > 1 (no_sync) is broken upstream"
                  " (pytorch/pytorch#143580); turning static_graph off", file=sys.stderr)
        static_graph = False
    bucket_cap = args.bucket_cap_mb if args.bucket_cap_mb is not None else (100.0 if is_cuda else 25.0)
    if info.distributed:
        kw = dict(gradient_as_bucket_view=True, bucket_cap_mb=bucket_cap, static_graph=static_graph)
        if is_cuda:
            kw.update(device_ids=[info.local_rank], output_device=info.local_rank)
        ddp = DDP(model, **kw)
        register_comm_hook(ddp, args.grad_compression, args, total_steps, info)
    else:
        ddp = model
    run_model = torch.compile(ddp) if args.compile else ddp
    crit = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)

    log = metrics_mod.MetricsLog(args.out, info.is_main, step if state is not None else None)
    run_rec = {"type": "run", "step": step, "world_size": world, "per_rank_batch": args.batch_size,
               "accum": args.accum, "global_batch": global_batch, "lr": lr, "precision": precision,
               "dataset": args.dataset, "model": args.model, "backend": info.backend,
               "device": str(device), "static_graph": static_graph if info.distributed else None,
               "bucket_cap_mb": bucket_cap, "grad_compression": args.grad_compression,
               "steps_per_epoch": spe, "epochs": args.epochs, "resumed_from": resume_path}
    log.write(dict(run_rec))
    log.print(f"world_size={world} backend={info.backend} device={device} precision={precision}"
              f" per-rank batch={args.batch_size} x accum {args.accum} -> global batch={global_batch}"
              f" lr={lr:g} (base {args.base_lr:g} @ {args.base_batch}) warmup={warmup}"
              f" steps/epoch={spe} total steps={total_steps}")
    if resume_path:
        log.print(f"resumed from {resume_path}: epoch {start_epoch} step {step}"
                  f" ({start_pos} steps into the epoch)")

    # ---- loop -------------------------------------------------------------------------
    step_sleep = float(os.environ.get(STEP_SLEEP_ENV, "0") or 0)
    win = torch.zeros(3, dtype=torch.float64, device=device)  # loss*n, correct, n (local)
    log_acc = [0.0, 0.0, 0.0]
    t_log, log_steps = time.perf_counter(), 0
    bench_images, bench_time = 0.0, 0.0
    stopped = False
    val_loss = val_acc = None

    def flush():
        """Global sums of the window since the last flush (one all-reduce)."""
        du.all_reduce_sum(win, info)
        vals = win.tolist()
        win.zero_()
        for i in range(3):
            totals[i] += vals[i]
            log_acc[i] += vals[i]

    def save(epoch: int, pos: int):
        rng = du.all_gather_object(ckpt_mod.rng_state(), info)
        if info.is_main:
            st = {"model": model.state_dict(), "optimizer": opt.state_dict(),
                  "scheduler": sched.state_dict(), "scaler": scaler.state_dict(),
                  "epoch": epoch, "step_in_epoch": pos, "step": step, "rng": rng,
                  "epoch_totals": list(totals), "last_summary": last_summary,
                  "world_size": world, "global_batch": global_batch, "args": vars(args)}
            ckpt_mod.save_checkpoint(st, args.out, args.keep_ckpts)

    def summary_of(epoch_float: float) -> dict:
        n = max(totals[2], 1.0)
        return {"epoch": epoch_float, "step": step, "train_loss": totals[0] / n,
                "train_acc": totals[1] / n, "val_loss": val_loss, "val_acc": val_acc}

    epoch = start_epoch
    while epoch < args.epochs and not stopped:
        pos = start_pos if epoch == start_epoch else 0
        if args.max_steps is not None and step >= args.max_steps:
            stopped = True
            break
        if sampler is not None:
            sampler.set_epoch(epoch)
            sampler.set_start(pos * args.accum * args.batch_size)
            it = iter(loader)
        _sync(device)
        t_seg = time.perf_counter()
        t_bench, bench_from = None, None
        k = pos
        while k < spe:
            if args.max_steps is not None and step >= args.max_steps:
                stopped = True
                break
            for m in range(args.accum):
                if synthetic:
                    x, y = synth.get(k * args.accum + m)
                else:
                    x, y = next(it)
                    x = x.to(device, non_blocking=True)
                    y = y.to(device, non_blocking=True)
                    if args.channels_last:
                        x = x.contiguous(memory_format=torch.channels_last)
                sync_ctx = ddp.no_sync() if (info.distributed and m < args.accum - 1) \
                    else contextlib.nullcontext()
                with sync_ctx:
                    with amp_ctx():
                        out = run_model(x)
                        loss = crit(out, y)
                    scaler.scale(loss / args.accum).backward()
                with torch.no_grad():
                    win[0] += loss.detach().double() * y.shape[0]
                    win[1] += (out.argmax(1) == y).sum()
                    win[2] += y.shape[0]
            if args.clip_grad > 0:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            sched.step()
            step += 1
            k += 1
            log_steps += 1
            done_here = k - pos
            if t_bench is None and done_here >= args.bench_warmup and k < spe:
                _sync(device)
                t_bench, bench_from = time.perf_counter(), done_here
            if step_sleep:
                time.sleep(step_sleep)
            if args.log_every and step % args.log_every == 0:
                flush()
                now = time.perf_counter()
                n = max(log_acc[2], 1.0)
                rec = {"type": "step", "step": step, "epoch": epoch + k / spe,
                       "loss": log_acc[0] / n, "acc": log_acc[1] / n,
                       "lr": opt.param_groups[0]["lr"], "images_per_s": log_acc[2] / (now - t_log),
                       "step_time_s": (now - t_log) / max(log_steps, 1)}
                log.write(rec)
                log.print(f"epoch {epoch} step {step} loss {rec['loss']:.4f} acc {rec['acc']:.4f}"
                          f" lr {rec['lr']:.4g} {rec['images_per_s']:.0f} img/s"
                          f" {rec['step_time_s'] * 1e3:.1f} ms/step")
                log_acc[:] = [0.0, 0.0, 0.0]
                t_log, log_steps = time.perf_counter(), 0
            if args.ckpt_every and step % args.ckpt_every == 0 and k < spe:
                flush()
                save(epoch, k)
        # ---- end of epoch (or stop) ----------------------------------------------------
        _sync(device)
        t_end = time.perf_counter()
        if t_bench is not None and (k - pos) > bench_from:
            measured_steps, measured_t = (k - pos) - bench_from, t_end - t_bench
        else:  # too few steps for a warm-up: measure them all
            measured_steps, measured_t = k - pos, t_end - t_seg
        ep_ips = measured_steps * global_batch / measured_t if measured_steps > 0 else None
        if measured_steps > 0:
            bench_images += measured_steps * global_batch
            bench_time += measured_t
        flush()
        if val_loader is not None:
            val_loss, val_acc = evaluate(model, val_loader, info, amp_ctx, args.channels_last)
        if k >= spe:  # full epoch
            last_summary = summary_of(epoch + 1)
            last_summary.update(type="epoch", images_per_s=ep_ips, epoch_time_s=t_end - t_seg)
            log.write(dict(last_summary))
            va = f" val_acc {val_acc:.4f} val_loss {val_loss:.4f}" if val_acc is not None else ""
            ips = f" {ep_ips:.0f} img/s" if ep_ips else ""
            log.print(f"== epoch {epoch + 1}/{args.epochs} step {step} train_loss"
                      f" {last_summary['train_loss']:.4f} train_acc {last_summary['train_acc']:.4f}"
                      f"{va}{ips} ({t_end - t_seg:.2f}s)")
            totals[:] = [0.0, 0.0, 0.0]
            epoch += 1
            save(epoch, 0)
        else:  # stopped part-way (--max-steps): checkpoint the position inside the epoch
            last_summary = summary_of(epoch + k / spe)
            last_summary.update(type="partial_epoch", images_per_s=ep_ips)
            log.write(dict(last_summary))
            save(epoch, k)
            stopped = True

    # ---- the end ------------------------------------------------------------------------
    final = {"epochs": last_summary.get("epoch", 0), "steps": step,
             "train_loss": last_summary.get("train_loss"), "train_acc": last_summary.get("train_acc"),
             "val_loss": last_summary.get("val_loss"), "val_acc": last_summary.get("val_acc"),
             "images_per_s": bench_images / bench_time if bench_time > 0 else None,
             "world_size": world, "global_batch": global_batch, "precision": precision,
             "dataset": args.dataset, "model": args.model, "stopped_early": stopped,
             "resumed_from": resume_path, "wall_s": time.time() - t_start}
    if info.is_main:
        log.write({"type": "final", **final})
        if not args.no_plot:
            try:
                metrics_mod.plot_metrics(log.path, os.path.join(args.out, "metrics.png"))
            except Exception as e:  # a plot must never fail the run
                print(f"warning: plot failed: {e}", file=sys.stderr)
        print("FINAL " + json.dumps(final), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
