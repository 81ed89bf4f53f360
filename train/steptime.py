"""Each rank's own work per step, for the launcher's slow-node comparison (cluster/observe/slow.py).

What is measured, per optimizer step (all micro-steps of --accum together):
- data: the time spent in next(batches), waiting on the data loader.
- compute: per micro-step, from the moment the model's own forward starts to the moment this
  rank's LAST parameter gradient was accumulated by its backward; summed over the micro-steps.
  The start is a forward pre-hook on the inner module, so it comes after DDP's broadcast of
  the buffers at the start of DDP's forward: that broadcast is a collective, and a fast rank
  waits in it for a slow one still in its previous optimizer step or its data (measured
  from the step's start, the fast ranks' compute was seen as long as the throttled one's).
  The end is when the rank is ready for its final all-reduce; what comes after it (waiting in
  the all-reduce for slower ranks, the optimizer step, the metrics' collectives) is not
  counted. Both moments come from hooks that only read the clock (a forward pre-hook and a
  post-accumulate-grad hook on every parameter), so training is unchanged (no no_sync(), no
  other comm hook). On CUDA the kernels are asynchronous, so the moments are CUDA events
  recorded in those hooks. An event is read only once it has completed (a read before that
  raises "device not ready"): a step's events wait in a queue, and each step's end reads the
  steps whose events have completed (event.query(), no wait), so no step waits for the GPU.
  Only when the queue is MAX_PENDING steps long does the oldest step's last event get waited
  for, which a CPU that far ahead of the GPU does soon anyway.

The file protocol (any program can write it; docs/failures.md): every ~second, each rank
replaces `$CLUSTER_HEARTBEAT_FILE.steps.<RANK>` with one JSON line
`{"rank": R, "compute": S, "data": S, "steps": N, "seconds": W}`: mean seconds per step over
the N steps since its previous line, and W the wall-clock seconds since that line (the first
line: since its first step began), so that N / W is the rank's step rate (`seconds` is
optional: a reader without it has no rate). The node's supervisor sends them with its
heartbeats; `cluster top` reads them for its step/s and work columns.

The trainer adds `"rate"`: steps per second over about the last RATE_S seconds, which a reader
prefers to steps / seconds. A line is written at the first step that ends after each whole
second of the wall clock (EVERY_S), not a second after the rank's own previous line, and the
rate's window runs from such a line to this one: the ranks of a synchronous job end each step
together, so their windows cover the same steps (give or take the one step a rank leaves a
moment later), and their rates agree. One-second windows that began at each rank's own moment
covered different steps (a slow step in one rank's window and not another's): one job's nodes
showed 4.8, 9.0 and 6.9 step/s.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from collections import deque
from typing import Any, Callable

import torch

EVERY_S = 1.0
RATE_S = 10.0
MAX_PENDING = 16      # steps whose CUDA events may be waiting to complete


def cuda_event() -> Any:
    """A CUDA timing event recorded now on the current stream."""
    ev = torch.cuda.Event(enable_timing=True)
    ev.record()
    return ev


class StepTimes:
    """`new_event`: makes an event recorded now (CUDA's, or a test's stand-in with the same
    query / synchronize / elapsed_time)."""

    def __init__(self, heartbeat_path: str | None, rank: int, device: torch.device,
                 every_s: float = EVERY_S, new_event: Callable[[], Any] = cuda_event,
                 clock: Callable[[], float] = time.time):
        self.path = f"{heartbeat_path}.steps.{rank}" if heartbeat_path else None
        self.rank, self.every_s = rank, every_s
        self.clock = clock                   # the wall clock: the same moments on every node
        self.cuda = device.type == "cuda"
        self.window = -math.inf              # the first step is written at once
        self.since: float | None = None      # the previous line's write
        self.total = 0                       # steps ended since the first (their events read or not)
        self.marks: list[tuple[float, int]] = []  # (when, total) at the lines of the last RATE_S
        self.compute = self.data = 0.0
        self.steps = 0
        self.step: int | None = None         # the training step done (the program's count)
        self.checkpoint: int | None = None   # the step of the newest checkpoint written
        self.saving = 0.0                    # seconds spent saving checkpoints, all of them
        self.last: dict | None = None        # the last line written with times
        self._step_data = self._step_compute = 0.0
        self._fwd_at: float | None = None        # this micro-step's forward start ...
        self._grad_at: float | None = None       # ... and its last gradient
        self._fwd_ev = self._grad_ev = None
        self._spans: list = []                   # CUDA: (forward start, last gradient) events
        self._new_event = new_event
        # CUDA: (data seconds, spans) of the steps whose events are not read yet, oldest first
        self._pending: deque[tuple[float, list]] = deque()

    def watch(self, model: torch.nn.Module) -> None:
        """Hooks on the inner model (not DDP's wrapper): its forward starting, and each
        parameter's gradient ready (the last one wins)."""
        if self.path is None:
            return
        model.register_forward_pre_hook(self._forward_starts)
        for p in model.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._grad_ready)

    def _forward_starts(self, _module, _inputs) -> None:
        self._close_micro_step()
        self._fwd_at = time.perf_counter()
        if self.cuda:
            self._fwd_ev = self._new_event()

    def _grad_ready(self, _param) -> None:
        self._grad_at = time.perf_counter()
        if self.cuda:
            self._grad_ev = self._new_event()

    def _close_micro_step(self) -> None:
        """Count the span from the last forward start to its last gradient, if it had one."""
        if self._fwd_at is not None and self._grad_at is not None and self._grad_at > self._fwd_at:
            if self.cuda:
                self._spans.append((self._fwd_ev, self._grad_ev))
            else:
                self._step_compute += self._grad_at - self._fwd_at
        self._fwd_at = self._grad_at = None

    def begin(self) -> None:
        """A step starts (an evaluation's forwards before it are not counted)."""
        if self.since is None:
            self.since = self.clock()        # the first line's seconds count from here
            self.marks = [(self.since, 0)]
        self._step_data = self._step_compute = 0.0
        self._fwd_at = self._grad_at = None
        self._spans = []

    def next(self, batches):
        """next(batches), its time counted as data."""
        t = time.perf_counter()
        item = next(batches)
        self._step_data += time.perf_counter() - t
        return item

    def end(self, step: int | None = None) -> None:
        """The step is done (its all-reduce queued, on CUDA maybe not run yet): count what is
        known; write the file now and then. step: the training step it was (resumes count on)."""
        if self.path is None:
            return
        self.step = step if step is not None else self.step
        self._close_micro_step()
        if self.cuda:
            if self._spans:
                self._pending.append((self._step_data, self._spans))
                self.total += 1
            self._spans = []
            self._read_completed()
        elif self._step_compute > 0:
            self._count(self._step_compute, self._step_data)
            self.total += 1
        self._step_data = self._step_compute = 0.0
        now = self.clock()
        window = math.floor(now / self.every_s) if self.every_s > 0 else now
        if self.steps and window > self.window:   # a new whole second since the previous line
            self._write(now)
            self.window = window

    def flush(self) -> None:
        """Count the steps whose events have completed and write a line if any is counted."""
        if self.path is None:
            return
        self._read_completed()
        if self.steps:
            now = self.clock()
            self._write(now)
            self.window = math.floor(now / self.every_s) if self.every_s > 0 else now

    def saved(self, step: int, seconds: float = 0.0) -> None:
        """A checkpoint of `step` is written, in `seconds`: said at once (the launcher waits
        for one before a planned restart), with what is counted so far. The seconds add up
        ("saving"): the launcher's goodput counts them apart from the training."""
        self.checkpoint = step
        self.saving += max(0.0, seconds)
        self.mark()

    def mark(self) -> None:
        """Write the step reached now, without reading a CUDA event: also on the way out of
        a failed step, where the device may be broken. The launcher reads it after the end."""
        if self.path is None:
            return
        if self.steps:
            self._write(self.clock())
        else:       # nothing counted since: the last line's times stay, for a reader of them
            self._replace({**(self.last or {"rank": self.rank}), **self._progress()})

    def _progress(self) -> dict:
        return {**({"step": self.step} if self.step is not None else {}),
                **({"checkpoint": self.checkpoint} if self.checkpoint is not None else {}),
                **({"saving": round(self.saving, 3)} if self.saving > 0 else {})}

    def _read_completed(self) -> None:
        """Count the queued steps whose events have all completed, oldest first; past
        MAX_PENDING, wait for the oldest."""
        while self._pending:
            data, spans = self._pending[0]
            events = [ev for span in spans for ev in span]
            if len(self._pending) > MAX_PENDING:
                for ev in events:
                    ev.synchronize()
            elif not all(ev.query() for ev in events):
                return
            self._pending.popleft()
            self._count(sum(a.elapsed_time(b) for a, b in spans) / 1e3, data)

    def _count(self, compute: float, data: float) -> None:
        if compute <= 0:
            return                  # no backward seen (a model without trainable parameters)
        self.compute += compute
        self.data += data
        self.steps += 1

    def _rate(self, now: float) -> float | None:
        """Steps per second from the newest line at least RATE_S old (else the first step's
        start) to now; the lines before it are dropped."""
        while len(self.marks) > 1 and self.marks[1][0] <= now - RATE_S:
            self.marks.pop(0)
        when, total = self.marks[0] if self.marks else (now, self.total)
        self.marks.append((now, self.total))
        return (self.total - total) / (now - when) if now > when else None

    def _write(self, now: float) -> None:
        # Wall-clock time, evaluations and uncounted steps included: a rate, not a work time.
        line = {"rank": self.rank, "compute": self.compute / self.steps,
                "data": self.data / self.steps, "steps": self.steps,
                "seconds": now - (self.since if self.since is not None else now),
                "rate": self._rate(now), **self._progress()}
        self.compute = self.data = 0.0
        self.steps = 0
        self.since = now
        self.last = line
        self._replace(line)

    def _replace(self, line: dict) -> None:
        if self.path is None:
            return
        tmp = f"{self.path}.tmp"
        try:
            with open(tmp, "w") as f:
                f.write(json.dumps(line) + "\n")
            os.replace(tmp, self.path)
        except OSError as e:
            print(f"warning: step times {self.path}: {e}; no more step times", file=sys.stderr)
            self.path = None
