"""How long the hang watchdog waits: a fixed number of seconds, or (`--hang-timeout auto`) a
timeout learned from the job's own heartbeats. Pure: events in (a node's heartbeat, at a time
the caller reads from its clock), the timeout out; the Watcher owns the clock and the silence.

Learning, per attempt (a restart starts over: it reloads, compiles and warms up again):

- Start-up: until the heartbeats have shown the job's pace, the timeout is `startup`. The
  first interval of each node is not a sample: the reference trainer beats once as it starts,
  then sets up (data, model, NCCL, compile) before its first step, so that interval is
  start-up, not pace. The pace is known after MIN_SAMPLES intervals.
- Then: `multiple` x the interval between heartbeats, within [`floor`, `cap`]. The interval
  is a peak that decays: a longer interval raises it at once (a gradual slowdown raises the
  timeout step by step, never stopping the job; one slow step makes it more patient, the
  safe way), a shorter one lowers it only slowly, with a time constant of FORGET_S (one fast
  step changes nothing, and a long pause the job made once, an evaluation, a checkpoint,
  is still remembered when the next one comes half an hour later).

Sections: a beat may say that its node enters a long pause that makes no steps (a checkpoint
written, an evaluation): the heartbeat file holds `section NAME` (the reference trainer does it
around its checkpoint writes; docs/failures.md has the protocol). While any node is in one,
the timeout is at least `startup`, so a save of minutes never trips a timeout learned from
1 s steps, and a save that hangs is still stopped. The interval from a section's beat to the
node's next one is not a sample of the pace.

Intervals are per node (a node's beat after its own last one): with many nodes the beats of
all of them interleave, and the time between any two says nothing about a step. The node's
supervisor reports a beat at most once a second (cluster/remote/workers.py), so a job that
steps faster shows 1 s intervals: the floor decides there. The timeout rests on those reported
intervals (the watchdog sees nothing finer), but the line says the job's own pace too, which
each report carries (`pace`: the heartbeat file's changes the node saw since its last report).

The defaults (cluster.spec.HangAuto), for real clusters:
- startup 1200 s (20 min): the first step of a large job waits for the image or environment,
  data loading and sharding, the model built and loaded from a checkpoint, NCCL's set-up
  across every node and torch.compile, which alone takes minutes for a large model. 20 min
  covers that, and still bounds what a hang before the first step costs.
- multiple 10: step times on a shared cluster vary 2-3x (data loader stalls, garbage
  collection, a slow filesystem, NCCL retrying a link), and the intervals are sampled to the
  second; 10x leaves room for that and still stops a hung job in minutes when steps take
  seconds.
- floor 30 s: below it, ordinary hiccups of a healthy job (the same stalls, the 1 s sampling
  of the beats) would stop it; at 30 s a job that beats every half second and hangs is
  stopped, its stacks collected, well within a minute of its last beat.
- cap 1800 s (30 min): a job with minute-long steps would otherwise wait hours on a hang;
  a pause longer than that (a checkpoint of many minutes) is a section (above), or wants a
  higher cap or a fixed timeout.
"""
from __future__ import annotations

import math
from collections.abc import Callable

from ..spec import HangAuto

AUTO = "auto"
MIN_SAMPLES = 3        # intervals seen (after each node's first) before the pace is trusted
FORGET_S = 1800.0      # time constant over which a longer interval seen is forgotten
MATERIAL = 1.25        # the timeout is shown again when it changed by this factor either way


class FixedTimeout:
    """--hang-timeout S: S seconds, whatever the job does (0: the watchdog is off)."""

    def __init__(self, seconds: float) -> None:
        self.value = float(seconds)

    def beat(self, node: str, at: float, section: str | None = None,
             pace: float | None = None) -> None:
        pass

    def seconds(self) -> float:
        return self.value

    def why(self) -> str:
        return "--hang-timeout"


class LearnedTimeout:
    """--hang-timeout auto: the timeout learned from the heartbeats (see the module's doc).
    say: where the one line goes when the timeout changes materially."""

    def __init__(self, settings: HangAuto = HangAuto(),
                 say: Callable[[str], None] = lambda line: None) -> None:
        self.settings = settings
        self.say = say
        self.last_beat: dict[str, float] = {}     # node -> when its last beat came
        self.first_done: set[str] = set()         # nodes whose first interval has passed
        self.samples = 0                          # intervals counted (each node's first not)
        self.interval = 0.0                       # the decaying peak of the intervals
        self.updated = 0.0                        # when `interval` was last updated
        self.value = settings.startup
        self.shown = settings.startup             # the last value said
        self.sections: dict[str, str] = {}        # node -> the section it is in
        self.paces: dict[str, float] = {}         # node -> the job's own seconds between beats

    def beat(self, node: str, at: float, section: str | None = None,
             pace: float | None = None) -> None:
        """A heartbeat of `node` at time `at` (seconds, the caller's monotonic clock); with
        `section`, the node has entered that long pause (until its next beat without one);
        `pace`, the seconds between the job's own beats since the node's last report."""
        before = self.last_beat.get(node)
        self.last_beat[node] = at
        was = self.sections.pop(node, None)
        if section:
            self.sections[node] = section
            return
        if before is None or was is not None:     # a section's length is not the pace
            return
        if node not in self.first_done:
            self.first_done.add(node)             # its first interval: start-up, not pace
            return
        if pace is not None and pace > 0:
            self.paces[node] = pace
        self._learn(at - before, at)

    def _learn(self, interval: float, at: float) -> None:
        if self.samples and interval < self.interval:
            keep = math.exp(-(at - self.updated) / FORGET_S)
            self.interval = interval + (self.interval - interval) * keep
        else:
            self.interval = interval
        self.updated = at
        self.samples += 1
        if self.samples < MIN_SAMPLES:
            return
        s = self.settings
        self.value = min(s.cap, max(s.floor, s.multiple * self.interval))
        if not 1 / MATERIAL < self.value / self.shown < MATERIAL:
            self.shown = self.value
            self.say(self.line())

    def seconds(self) -> float:
        if self.sections:
            return max(self.value, self.settings.startup)
        return self.value

    def learning(self) -> bool:
        """Still on the start-up allowance."""
        return self.samples < MIN_SAMPLES

    def why(self) -> str:
        if self.sections:
            node, name = next(iter(self.sections.items()))
            return (f"--hang-timeout auto: [{node}] is in its {name} section: the start-up "
                    f"allowance, {self.settings.startup:g} s")
        if self.learning():
            return f"--hang-timeout auto: the start-up allowance, {self.settings.startup:g} s"
        return f"--hang-timeout auto: {self.reason()}"

    def line(self) -> str:
        """'hang timeout now 42 s: 10x the 4.2 s between heartbeats'."""
        return f"hang timeout now {self.value:.0f} s: {self.reason()}"

    def reason(self) -> str:
        s = self.settings
        pace = f"{s.multiple:g}x the {self.interval:.1f} s between heartbeats"
        job = max(self.paces.values(), default=None)     # the slowest node's
        if job is not None and job * MATERIAL < self.interval:   # the reports hide its pace
            pace = (f"{s.multiple:g}x the {self.interval:.1f} s between reported heartbeats "
                    f"(the job beats every {job:.2f} s; a node reports one a second at most)")
        if self.value == s.floor and s.multiple * self.interval < s.floor:
            return f"the floor (hang_auto.floor; {pace} is less)"
        if self.value == s.cap and s.multiple * self.interval > s.cap:
            return f"the cap (hang_auto.cap; {pace} is more)"
        return pace


def valid(value: object) -> bool:
    """--hang-timeout's value: 'auto', or a number of seconds >= 0 (0: off)."""
    if value == AUTO:
        return True
    return isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value) and value >= 0


def timeout_of(value: float | str, settings: HangAuto = HangAuto(),
               say: Callable[[str], None] = lambda line: None) -> FixedTimeout | LearnedTimeout:
    """The watchdog's timeout for --hang-timeout `value` (seconds, or 'auto')."""
    if value == AUTO:
        return LearnedTimeout(settings, say)
    return FixedTimeout(float(value))
