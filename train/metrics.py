"""Metrics: per-step sums kept on the device, images/s per epoch, stdout + JSONL (rank 0
only), and a PNG plot at the end."""
from __future__ import annotations

import json
import os
import sys
import time

import torch

if __package__ in (None, ""):
    import dist_utils as du
else:
    from . import dist_utils as du


class StepMetrics:
    """Loss and accuracy sums of the steps since the last flush, kept on the device so that no
    step waits for the host; `flush` sums them over ranks (one all-reduce) into host totals."""

    def __init__(self, device: torch.device):
        self.buf = torch.zeros(3, dtype=torch.float64, device=device)  # loss*n, correct, n (local)
        self.log_sums = [0.0, 0.0, 0.0]
        self.t_log, self.log_steps = time.perf_counter(), 0

    def add(self, loss: torch.Tensor, out: torch.Tensor, y: torch.Tensor) -> None:
        with torch.no_grad():
            self.buf[0] += loss.detach().double() * y.shape[0]
            self.buf[1] += (out.argmax(1) == y).sum()
            self.buf[2] += y.shape[0]

    def flush(self, info, totals: list[float]) -> None:
        du.all_reduce_sum(self.buf, info)
        vals = self.buf.tolist()
        self.buf.zero_()
        for i in range(3):
            totals[i] += vals[i]
            self.log_sums[i] += vals[i]

    def take_log_window(self) -> tuple[float, float, float, float]:
        """(loss, accuracy, images/s, seconds per step) since the previous log line."""
        now = time.perf_counter()
        loss, correct, n = self.log_sums
        n1, dt = max(n, 1.0), now - self.t_log
        window = (loss / n1, correct / n1, n / dt, dt / max(self.log_steps, 1))
        self.log_sums = [0.0, 0.0, 0.0]
        self.t_log, self.log_steps = now, 0
        return window


class EpochClock:
    """Images/s of an epoch's steps after its first --bench-warmup ones. Synchronises the device
    at the epoch's start, at the end of the warm-up and at the end: never per step."""

    def __init__(self, device: torch.device, warmup: int, first_pos: int):
        self.device, self.warmup, self.first = device, warmup, first_pos
        self._sync()
        self.t0 = time.perf_counter()
        self.t_bench: float | None = None
        self.bench_from = 0
        self.steps, self.seconds, self.elapsed = 0, 0.0, 0.0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def step_done(self, pos: int, steps_per_epoch: int) -> None:
        done = pos - self.first
        if self.t_bench is None and done >= self.warmup and pos < steps_per_epoch:
            self._sync()
            self.t_bench, self.bench_from = time.perf_counter(), done

    def stop(self, pos: int) -> None:
        self._sync()
        t_end, done = time.perf_counter(), pos - self.first
        self.elapsed = t_end - self.t0
        if self.t_bench is not None and done > self.bench_from:
            self.steps, self.seconds = done - self.bench_from, t_end - self.t_bench
        else:  # too few steps for a warm-up: measure them all
            self.steps, self.seconds = done, self.elapsed


class MetricsLog:
    """Writes one JSON object per line to ``<out>/metrics.jsonl``; no-op off rank 0."""

    def __init__(self, out_dir: str, enabled: bool, resume_step: int | None):
        self.enabled = enabled
        self.path = os.path.join(out_dir, "metrics.jsonl")
        self.t0 = time.time()
        if not enabled:
            return
        if resume_step is None:
            open(self.path, "w").close()  # fresh run: start a new file
        elif os.path.exists(self.path):
            # Resumed: drop records written after the checkpoint we resume from, so the
            # file reads as one uninterrupted run.
            kept = [r for r in read_jsonl(self.path)
                    if r.get("step", 0) <= resume_step or r.get("type") == "run"]
            with open(self.path, "w") as f:
                for r in kept:
                    f.write(json.dumps(r) + "\n")

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        record.setdefault("time", round(time.time(), 3))
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def print(self, msg: str) -> None:
        if self.enabled:
            print(msg, flush=True)


def read_jsonl(path: str) -> list[dict]:
    out = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by a kill
                pass
    return out


def plot_metrics(jsonl_path: str, png_path: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("warning: matplotlib not installed; skipping the plot", file=sys.stderr)
        return False
    recs = read_jsonl(jsonl_path)
    steps = [r for r in recs if r.get("type") == "step"]
    epochs = [r for r in recs if r.get("type") == "epoch"]
    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    if steps:
        ax[0].plot([r["step"] for r in steps], [r["loss"] for r in steps], label="train (window)")
        ax[1].plot([r["step"] for r in steps], [r["acc"] for r in steps], label="train (window)")
        ax[2].plot([r["step"] for r in steps], [r["images_per_s"] for r in steps], label="window")
    if epochs:
        ax[0].plot([r["step"] for r in epochs], [r["train_loss"] for r in epochs], "o-",
                   label="train (epoch)")
        ax[1].plot([r["step"] for r in epochs], [r["val_acc"] for r in epochs], "s-",
                   label="held-out (epoch)")
        ax[2].plot([r["step"] for r in epochs], [r["images_per_s"] for r in epochs], "o-",
                   label="epoch (after warm-up)")
    for a, t in zip(ax, ("loss", "accuracy", "images/s (global)")):
        a.set_title(t)
        a.set_xlabel("optimizer step")
        a.grid(alpha=0.3)
        if a.get_legend_handles_labels()[0]:
            a.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return True
