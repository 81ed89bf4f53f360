"""Each rank's own work per step, for the launcher's slow-node comparison (cluster/slow.py).

What is measured, per optimizer step (all micro-steps of --accum together):
- data: the time spent in next(batches), waiting on the data loader.
- compute: from the step's start to the moment this rank's LAST parameter gradient was
  accumulated by its own backward, minus the data time in between. That moment is when the
  rank is ready for its final all-reduce; what comes after it (waiting in the all-reduce for
  slower ranks, the optimizer step, the metrics' collectives) is not counted, so a fast rank
  that waits for a slow one still reports its own short time. The moment comes from a
  post-accumulate-grad hook on every parameter: it only reads the clock, so training is
  unchanged (no no_sync(), no different comm hook). On CUDA the kernels are asynchronous, so
  the moment is a CUDA event recorded in that hook and read after the step.
  One wait is left inside: DDP's broadcast of the buffers at the start of forward, a
  collective, waits for the ranks still loading their data; it is short when data is not
  the slow part, and when it is, the slow node's data time still shows.

The file protocol (any program can write it; docs/failures.md): every ~second, each rank
replaces `$CLUSTER_HEARTBEAT_FILE.steps.<RANK>` with one JSON line
`{"rank": R, "compute": S, "data": S, "steps": N}`: mean seconds per step over the N steps
since its previous line. The node's supervisor sends them with its heartbeats.
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch

EVERY_S = 1.0


class StepTimes:
    def __init__(self, heartbeat_path: str | None, rank: int, device: torch.device,
                 every_s: float = EVERY_S):
        self.path = f"{heartbeat_path}.steps.{rank}" if heartbeat_path else None
        self.rank, self.every_s = rank, every_s
        self.cuda = device.type == "cuda"
        self.last_write = float("-inf")      # the first step is written at once
        self.compute = self.data = 0.0
        self.steps = 0
        self._start = self._step_data = 0.0
        self._grad_at: float | None = None
        self._start_ev = self._grad_ev = None

    def watch(self, model: torch.nn.Module) -> None:
        """Hooks that note when each parameter's gradient is ready (the last one wins)."""
        if self.path is None:
            return
        for p in model.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._grad_ready)

    def _grad_ready(self, _param) -> None:
        self._grad_at = time.perf_counter()
        if self.cuda:
            self._grad_ev = torch.cuda.Event(enable_timing=True)
            self._grad_ev.record()

    def begin(self) -> None:
        self._start, self._step_data, self._grad_at = time.perf_counter(), 0.0, None
        if self.cuda and self.path:
            self._start_ev = torch.cuda.Event(enable_timing=True)
            self._start_ev.record()

    def next(self, batches):
        """next(batches), its time counted as data."""
        t = time.perf_counter()
        item = next(batches)
        self._step_data += time.perf_counter() - t
        return item

    def end(self) -> None:
        """The step is done (its all-reduce included): count it; write the file now and then."""
        if self.path is None or self._grad_at is None:
            return
        if self.cuda and self._start_ev is not None and self._grad_ev is not None:
            own = self._start_ev.elapsed_time(self._grad_ev) / 1e3    # both done: step is over
        else:
            own = self._grad_at - self._start
        self.compute += max(0.0, own - self._step_data)
        self.data += self._step_data
        self.steps += 1
        now = time.monotonic()
        if now - self.last_write >= self.every_s:
            self._write()
            self.last_write = now

    def _write(self) -> None:
        line = {"rank": self.rank, "compute": self.compute / self.steps,
                "data": self.data / self.steps, "steps": self.steps}
        self.compute = self.data = 0.0
        self.steps = 0
        tmp = f"{self.path}.tmp"
        try:
            with open(tmp, "w") as f:
                f.write(json.dumps(line) + "\n")
            os.replace(tmp, self.path)
        except OSError as e:
            print(f"warning: step times {self.path}: {e}; no more step times", file=sys.stderr)
            self.path = None
