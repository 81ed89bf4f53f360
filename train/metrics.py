"""Metrics: stdout + JSONL (rank 0 only), and a PNG plot at the end."""
from __future__ import annotations

import json
import os
import sys
import time


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
