"""`cluster doctor --deep`: a real collective across all nodes, run as a job like any other,
and what it measured.

The collective (cluster/remote/collective.py, which each remote node's check brings into its
workdir's .cluster/tools) runs under torchrun through cluster.launch, recorded as
runs/doctor-<id>: the all_reduce sum, bus bandwidth per message size, and bandwidth between
every pair of nodes, naming the slow one. `measure_collective` is the one function that runs
such a collective with given environment variables; `--tune-nccl` (tune_nccl) runs it once
per NCCL socket setting. While it measures, rank 0's '@@progress' lines are counted and said
as they come (Capture, step_lines, and the progress doctor.PhaseLines draws).
"""
from __future__ import annotations

import dataclasses
import json
import statistics
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from . import tuning
from .backends import REMOTE_NODES, supports
from .backends.node import TOOLS_DIR
from .console import Console
from .errors import PreflightError, RunFailed
from .plan import Job
from .recovery.gate import FAIL, PASS, Finding
from .runs import DOCTOR_PREFIX, RunDir, new_run_id
from .spec import Inventory
from .plan import Templates

COLLECTIVE = Path(__file__).resolve().parent / "remote" / "collective.py"
SLOW_LINK = 0.5                          # a pair below half the median bandwidth is slow
DEEP_SIZES = (65536, 1 << 20, 16 << 20)  # --deep's message sizes, bytes
PROGRESS = "@@progress "                 # rank 0's line after each measurement (collective.py)

# The collective's steps as they end: steps(done, total, say), say "" or a line for the user.
Steps = Callable[[int, int, str], None]



def collective_job(run_id: str, shipped: bool) -> Job:
    """The collective as a job: where each node's start put it (shipped, relative to the
    workdir), else where it is here (nodes on this machine)."""
    script = f"{TOOLS_DIR}/{COLLECTIVE.name}" if shipped else str(COLLECTIVE)
    return Job(run_id=run_id, script=script)


def collective_env(sizes: Sequence[int], iters: int,
                   extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = {"CLUSTER_DOCTOR_SIZES": ",".join(str(s) for s in sizes),
           "CLUSTER_DOCTOR_ITERS": str(iters)}
    env.update(extra or {})
    return env


class Measure(Protocol):
    def __call__(self, env: Mapping[str, str], sizes: Sequence[int] = ...,
                 iters: int = ..., show_steps: bool = ..., run_id: str | None = ...) -> dict[str, Any]: ...


def collective(inventory: Inventory, backend: Any, templates: Templates) -> Measure:
    """measure(env, sizes, iters): one run of the collective on the inventory's nodes with env
    added, started and recorded like any run, through cluster.launch: as runs/<run_id>/ (a
    new doctor-<time>-<hex> when not given),
    which status, logs, down and top pass over when no RUN is named. Remote nodes get the
    collective program with each check (backend.tools), in the same round trip. With
    show_steps, each measurement as it ends goes to backend.progress (step_lines)."""
    from . import launch
    shipped = supports(backend, REMOTE_NODES)
    if shipped:
        backend.tools[COLLECTIVE.name] = COLLECTIVE.read_bytes()

    def measure(env: Mapping[str, str], sizes: Sequence[int] = DEEP_SIZES, iters: int = 5,
                show_steps: bool = True, run_id: str | None = None) -> dict[str, Any]:
        job = collective_job(run_id or f"{DOCTOR_PREFIX}{new_run_id()}", shipped)
        run = RunDir.create(job.run_id)
        if not shipped:        # nodes on this machine: their folders under the run's here
            job = dataclasses.replace(job, node_root=run.node_root())
        steps = step_lines(getattr(backend, "progress", None)) if show_steps else None
        return measure_collective(
            inventory, lambda inv, j, c: launch.up(inv, j, templates, backend, run,
                                                   ["cluster", "doctor"], c),
            job, collective_env(sizes, iters, extra=env), steps=steps)
    return measure


def step_lines(progress: Any) -> Steps | None:
    """The collective's steps told to doctor's progress (PhaseLines): counted as the phase
    "measure" (the collective's launch checks the nodes in between: a phase of its own, so
    the step count is one too), each say written as a line by progress.say, if it has one."""
    if progress is None:
        return None
    say = getattr(progress, "say", None)

    def steps(done: int, total: int, text: str) -> None:
        progress("measure", done, total)
        if text and say is not None:
            say(text)
    return steps


def measure_collective(inventory: Inventory, launch_job: Callable[[Inventory, Job, Console], int],
                       job: Job, env: Mapping[str, str], steps: Steps | None = None) -> dict[str, Any]:
    """Run the collective across the inventory's nodes with `env` added to every node's
    environment; return what rank 0 measured (sum_ok, allreduce bandwidth per size, pairs).
    `launch_job` is cluster.launch.up bound to a backend: the same path as any run. `steps`
    hears of each measurement as rank 0 ends it."""
    hosts = tuple(h.replace(env=tuple({**dict(h.env), **env}.items())) for h in inventory.hosts)
    console = Capture(steps)
    try:
        launch_job(dataclasses.replace(inventory, hosts=hosts), job, console)
    except RunFailed as exc:
        raise RunFailed(f"the collective failed: {exc}", details="\n".join(console.lines[-20:])) from None
    for line in console.lines:
        if "@@doctor " in line:
            return json.loads(line.split("@@doctor ", 1)[1])
    raise RunFailed("the collective printed no result", details="\n".join(console.lines[-20:]))


def tune_nccl(inventory: Inventory, measure: Callable[[Mapping[str, str]], dict[str, Any]],
              cache: tuning.Cache, settings: Sequence[Mapping[str, str]] | None = None,
              shown: Callable[[tuning.Row], None] | None = None) -> dict[str, Any]:
    """Measure every NCCL socket setting (measure(env) runs the collective with env on every
    node), keep the best for these nodes in the cache, and say what was kept. Raises
    PreflightError when the collective did not run on NCCL (no GPUs): nothing to tune."""
    def on_nccl(env: Mapping[str, str]) -> dict[str, Any]:
        measured = measure(env)
        if measured.get("backend") != "nccl":
            raise PreflightError(
                f"the collective ran on {measured.get('backend')}, not NCCL (no GPU on the "
                f"nodes?): NCCL's socket settings change nothing there. Nothing was stored")
        return measured
    if len(inventory.hosts) < 2:
        raise PreflightError("NCCL's sockets carry data between nodes: --tune-nccl needs 2 or "
                             "more nodes (for one host forced onto sockets, use --local --nodes 2 "
                             "with NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 in the inventory's env)")
    rows = tuning.sweep(on_nccl, settings if settings is not None else tuning.grid(), shown)
    chosen = tuning.choose(rows)
    entry = cache.store(inventory, chosen, rows)
    return {"cache": str(cache.path), "chosen": entry["env"], "label": entry["label"],
            "measured_at": entry["measured_at"], "table": entry["table"]}


def tuning_lines(tuned: dict[str, Any]) -> list[str]:
    sizes = sorted({int(s) for row in tuned["table"] for s in row["busbw_gbps"]})
    head = f"  {'setting':<24}" + "".join(f"{s / 2**20:>10.0f} MiB" for s in sizes)
    lines = ["", "NCCL socket settings, all_reduce bus bandwidth (GB/s):", head]
    for row in tuned["table"]:
        mark = "  <- kept" if row["env"] == tuned["chosen"] else ""
        lines.append(f"  {row['label']:<24}" + "".join(
            f"{row['busbw_gbps'].get(str(s), 0.0):>14.3f}" for s in sizes) + mark)
    kept = " ".join(f"{k}={v}" for k, v in sorted(tuned["chosen"].items())) or "NCCL's defaults"
    lines.append(f"kept {kept} for these nodes in {tuned['cache']}; `cluster up` on them applies "
                 f"it (the inventory's env wins; --no-tuning ignores it)")
    return lines


class Capture(Console):
    """A console that keeps what the nodes print instead of showing it; rank 0's progress
    lines ('@@progress {"done", "total", "say"}') also go to `steps` as they come."""

    def __init__(self, steps: Steps | None = None) -> None:
        super().__init__(color=False)
        self.lines: list[str] = []
        self.steps = steps

    def node_line(self, label: str, index: int, text: str) -> None:
        with self.lock:
            self.lines.append(text)
        step = parse_step(text) if self.steps is not None and PROGRESS in text else None
        if step is not None and self.steps is not None:
            self.steps(*step)

    def info(self, text: str) -> None:
        with self.lock:
            self.lines.append(f"cluster: {text}")

    def raw(self, text: str) -> None:
        pass


def parse_step(line: str) -> tuple[int, int, str] | None:
    """(done, total, say) from a node's line with '@@progress {json}' in it; None when the
    JSON is cut or not what collective.py writes (a progress line is never worth failing)."""
    try:
        told = json.loads(line.split(PROGRESS, 1)[1])
    except ValueError:
        return None
    if not isinstance(told, dict):
        return None
    done, total, say = told.get("done"), told.get("total"), told.get("say", "")
    if not (isinstance(done, int) and isinstance(total, int) and isinstance(say, str)):
        return None
    return done, total, say


def deep_summary(measured: dict[str, Any]) -> dict[str, Any]:
    pairs = measured.get("pairs") or []
    median = statistics.median(p["gbps"] for p in pairs) if pairs else None
    slow = [p for p in pairs if median and p["gbps"] < SLOW_LINK * median]
    return {**measured, "median_pair_gbps": median, "slow_pairs": slow, "slowest": slowest(slow, pairs)}


def slowest(slow: list[dict[str, Any]], pairs: list[dict[str, Any]]) -> str | None:
    """The node every slow link touches (a slow NIC), else the slowest link itself."""
    if not slow:
        return None
    common = set.intersection(*({p["a"], p["b"]} for p in slow))
    nodes = {n for p in pairs for n in (p["a"], p["b"])}
    if len(common) == 1 and len(nodes) > 2:
        return f"node {common.pop()}"
    worst = min(slow, key=lambda p: p["gbps"])
    return f"link {worst['a']} - {worst['b']}"


def deep_findings(deep: dict[str, Any]) -> list[Finding]:
    out = [Finding("all", "collective", PASS if deep.get("sum_ok") else FAIL,
                   f"all_reduce over {deep.get('world_size')} process(es) ({deep.get('backend')}): "
                   f"{'right sum' if deep.get('sum_ok') else 'WRONG sum'}",
                   "" if deep.get("sum_ok") else "a node computes or transfers wrongly: run again, "
                   "then check its GPUs and NICs")]
    if deep.get("slowest"):
        out.append(Finding("all", "bandwidth", "warn",
                           f"{deep['slowest']} is far below the others ({len(deep['slow_pairs'])} "
                           f"link(s) under {SLOW_LINK:.0%} of the median "
                           f"{deep['median_pair_gbps']:.2f} GB/s)",
                           "check that node's NIC, cable and interface choice"))
    return out



def deep_lines(deep: dict[str, Any]) -> list[str]:
    lines = ["", f"collective ({deep['backend']}, {deep['world_size']} processes): "
                 f"sum {'right' if deep['sum_ok'] else 'WRONG'}"]
    for r in deep["allreduce"]:
        lines.append(f"  all_reduce {r['bytes'] / 2**20:9.3f} MiB  bus bandwidth {r['busbw_gbps']:8.3f} GB/s")
    for p in deep["pairs"]:
        lines.append(f"  {p['a']} <-> {p['b']}: {p['gbps']:8.3f} GB/s ({p['bytes'] / 2**20:.1f} MiB ping-pong)")
    return lines
