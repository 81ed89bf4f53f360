"""`cluster doctor`: why nodes won't talk, found in seconds and named with the fix.

Every node at once, over the same transport as `cluster up`: SSH login (batch mode, host keys
per policy), what each node has (python, torch, CUDA, cuDNN, NCCL, driver, GPUs and whether
they are busy, /dev/shm, free disk, open-file limit, clock offset), the interface that reaches
the master, the master port free there and open to every node. Differences across nodes that
break a job fail, the others warn; the fingerprint shows each value once with the nodes that
have it. `--deep` runs a real collective across all nodes (cluster/remote/collective.py, which each
remote node's check brings into its workdir's .cluster/tools):
the all_reduce sum, bus bandwidth per message size, and bandwidth between every pair of nodes,
naming the slow one. `measure_collective` is the one function that runs such a collective with
given environment variables; `--tune-nccl` (tune_nccl) runs it once per NCCL socket setting.
While it measures, rank 0's '@@progress' lines are counted and said as they come (Capture,
step_lines, PhaseLines).
"""
from __future__ import annotations

import dataclasses
import json
import statistics
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

import hostlist

from . import tuning
from .errors import ClusterError, PreflightError, RunFailed
from .plan import Job, LaunchPlan, Templates, container_check, render, shquote
from .preflight import FAIL, PASS, Clock, Finding, clock_offset, evaluate, fingerprint
from .backends import REMOTE_NODES, supports
from .backends.node import TOOLS_DIR
from .runs import DOCTOR_PREFIX, RunDir, new_run_id
from .spec import Inventory, container_name
from .console import Console, NodeProgress

SCHEMA = 1
COLLECTIVE = Path(__file__).resolve().parent / "remote" / "collective.py"
SLOW_LINK = 0.5                          # a pair below half the median bandwidth is slow
DEEP_SIZES = (65536, 1 << 20, 16 << 20)  # --deep's message sizes, bytes
PROGRESS = "@@progress "                 # rank 0's line after each measurement (collective.py)

# The collective's steps as they end: steps(done, total, say), say "" or a line for the user.
Steps = Callable[[int, int, str], None]


@dataclass
class Report:
    nodes: list[str]
    master: str
    port: int
    findings: list[Finding]
    fingerprint: dict[str, dict[str, list[str]]]
    deep: dict[str, Any] | None = None
    tuning: dict[str, Any] | None = None      # --tune-nccl: the table and what was kept
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not any(f.status == FAIL for f in self.findings)

    def to_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "ok": self.ok, "seconds": round(self.seconds, 3),
                "nodes": self.nodes, "master": {"name": self.master, "port": self.port},
                "checks": [dataclasses.asdict(f) for f in self.findings],
                "fingerprint": self.fingerprint, "deep": self.deep, "tuning": self.tuning}


def diagnose(inventory: Inventory, backend: Any, templates: Templates, *,
             deep: bool = False, run_deep: Callable[[], dict[str, Any]] | None = None) -> Report:
    """Probe every node (never raising for one node's failure: it becomes a finding), check
    that every node reaches the master port, judge; with deep, run the collective too. Each
    phase is announced to backend.progress (PhaseLines), if it has one."""
    t0 = time.monotonic()
    plan = render(inventory, Job(run_id=f"{DOCTOR_PREFIX}{new_run_id()}", script="-"), templates)
    begin(backend, "probe", len(plan.nodes))
    facts, clock, findings = survey(backend, plan)
    for name, inside in look_inside(backend, plan, templates, facts).items():
        facts[name]["inside"] = inside
    reach = None
    # Not with the master unreached, nor with its port in use (that fails its own check; a
    # connection test to another program's listener proves nothing).
    if facts.get(plan.master.host.name, {}).get("port_free", False):
        begin(backend, "reach", len(facts))
        try:
            reach = backend.reach(plan)
        except ClusterError as exc:
            findings.append(listener_finding(plan, exc))
    findings += evaluate(plan, facts, reach, deep=True, clock=clock)
    report = Report(nodes=[n.host.name for n in plan.nodes], master=plan.master.host.name,
                    port=plan.master_port, findings=findings,
                    fingerprint=fingerprint(facts, deep=True))
    if deep and run_deep is not None and report.ok:
        begin(backend, "collective", len(plan.nodes))
        report.deep = deep_summary(run_deep())
        report.findings += deep_findings(report.deep)
    report.seconds = time.monotonic() - t0
    return report


def begin(backend: Any, phase: str, total: int) -> None:
    """Say that a phase starts (its nodes' ends are told by backend.each, phase=...)."""
    progress = getattr(backend, "progress", None)
    if progress is not None:
        progress(phase, 0, total)


def listener_finding(plan: LaunchPlan, exc: ClusterError) -> Finding:
    """The master's listener for the connection test could not start: why, and what to do."""
    master = plan.master.host.name
    return Finding(master, "reach master", FAIL,
                   f"could not test whether the nodes reach {plan.master_addr}:{plan.master_port}: "
                   f"no listener could be started on {master} ({exc})",
                   f"free port {plan.master_port} on {master}, or choose another port "
                   f"(--master-port, or master_port in the inventory; left out, one is derived)")


def survey(backend: Any, plan: LaunchPlan, now: Callable[[], float] = time.time,
           ) -> tuple[dict[str, dict[str, Any]], dict[str, Clock], list[Finding]]:
    """Each node's facts (deep), its clock against this machine's (`now`), and a finding for
    every node that could not be reached or probed."""
    def one(node: Any) -> tuple[dict[str, Any], Clock]:
        sent = now()
        facts = backend.probe_node(node, plan, deep=True, make_dir=False)
        received = now()
        return facts, clock_offset(sent, received, facts.get("time_start", facts["time"]),
                                   facts["time"])
    results = backend.each(plan.nodes, one, phase="probe")
    facts, clock, findings = {}, {}, []
    for node, r in results:
        name = node.host.name
        if isinstance(r, Exception):      # the message says what to do (errors carry their fix)
            findings.append(Finding(name, "ssh" if isinstance(r, PreflightError) else "python",
                                    FAIL, str(r)))
            continue
        facts[name], clock[name] = r
        findings.append(Finding(name, "ssh", PASS, "logged in over SSH (batch mode, host key checked)"
                                if supports(backend, REMOTE_NODES) else f"reached ({backend.name})"))
    return facts, clock, findings


# --- inside each node's container image ---------------------------------------------------------

# Runs with the image's python: what torch there is and which GPUs it sees.
IMAGE_CHECK = """import json, sys
out = {"python": sys.version.split()[0]}
try:
    import torch
    out.update(torch=torch.__version__, cuda=torch.version.cuda)
    out["device_count"] = torch.cuda.device_count() if torch.cuda.is_available() else 0
    out["cudnn"] = torch.backends.cudnn.version()
    if out["device_count"]:
        v = torch.cuda.nccl.version()
        out["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
except Exception as exc:
    out["error"] = "%s: %s" % (type(exc).__name__, exc)
print("@@inside " + json.dumps(out), flush=True)
"""
INSIDE_TIMEOUT = 300.0         # a first start may unpack a large image


def look_inside(backend: Any, plan: LaunchPlan, templates: Templates,
                facts: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """On every node whose image is there: start its container as a run would and say what
    torch and GPUs it sees (by node name)."""
    nodes = [n for n in plan.nodes if n.host.container
             and ((facts.get(n.host.name) or {}).get("container") or {}).get("image_id")]
    if nodes:
        begin(backend, "inside", len(nodes))
    results = backend.each(nodes, lambda n: inside(backend.transport(n.host), n, plan, templates),
                           phase="inside")
    return {n.host.name: r if not isinstance(r, Exception) else {"error": str(r)}
            for n, r in results}


def inside(transport: Any, node: Any, plan: LaunchPlan, templates: Templates) -> dict[str, Any]:
    container = node.host.container
    name = container_name(plan.run_id, node.host.name)
    script = container_check(node.host, name, templates, IMAGE_CHECK)
    res = transport.run("bash -s", input=script.encode(), timeout=INSIDE_TIMEOUT)
    for line in reversed(res.stdout.decode(errors="replace").splitlines()):
        if line.startswith("@@inside "):
            return json.loads(line[len("@@inside "):])
    if res.code is None:          # timed out or cut: the container may still be there
        transport.run(f"{container.runtime} rm --force {shquote(name)}", timeout=60)
    said = [line for line in res.text().splitlines() if "level=warning" not in line]
    return {"error": "\n".join(said)[-500:] or f"exit code {res.code}"}


# --- --deep: a real collective -----------------------------------------------------------------


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
                 iters: int = ..., show_steps: bool = ...) -> dict[str, Any]: ...


def collective(inventory: Inventory, backend: Any, templates: Templates) -> Measure:
    """measure(env, sizes, iters): one run of the collective on the inventory's nodes with env
    added, started and recorded like any run, through cluster.launch: as runs/doctor-<id>/,
    which status, logs, down and top pass over when no RUN is named. Remote nodes get the
    collective program with each check (backend.tools), in the same round trip. With
    show_steps, each measurement as it ends goes to backend.progress (step_lines)."""
    from . import launch
    shipped = supports(backend, REMOTE_NODES)
    if shipped:
        backend.tools[COLLECTIVE.name] = COLLECTIVE.read_bytes()

    def measure(env: Mapping[str, str], sizes: Sequence[int] = DEEP_SIZES, iters: int = 5,
                show_steps: bool = True) -> dict[str, Any]:
        job = collective_job(f"{DOCTOR_PREFIX}{new_run_id()}", shipped)
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


# --- output -------------------------------------------------------------------------------------


# What each phase does, said as it begins; the phases without a count draw no bar. "measure"
# counts the collective's measurements (collective.py's steps), not nodes.
PHASES = {
    "probe": "asking {total} node(s) what they have (python, torch, GPUs, disk, clock)",
    "inside": "starting {total} node(s)' container to see its torch and GPUs",
    "reach": "testing that {total} node(s) reach the master port",
    "collective": "running a collective across {total} node(s) (all_reduce, then every pair); "
                  "it is recorded as runs/doctor-<id>",
    "check": "checking {total} node(s) before the collective starts",
    "measure": "measuring in {total} steps (the sum, each message size, each round of pairs)",
}
UNCOUNTED = {"reach", "collective"}


class NodeCounts(NodeProgress):
    VERBS = {**NodeProgress.VERBS, "probe": "probed", "inside": "looked inside",
             "measure": "measured"}
    UNITS = {**NodeProgress.UNITS, "measure": "steps"}


class PhaseLines:
    """Doctor's progress on stderr, as backend.progress(phase, done, total): a line as each
    phase begins (a log shows where the time went), and on a terminal a live count of the
    nodes (or the collective's steps) done (console.NodeProgress, from one on). Phases come
    one after another, so a new one ends the last one's count. say(text) writes what a step
    found as a line of its own, on a terminal and in a log alike."""

    def __init__(self, stream: IO[str], terminal: bool | None = None,
                 counter: Callable[[str, int, int], None] | None = None) -> None:
        self.stream = stream
        terminal = stream.isatty() if terminal is None else terminal
        self.counter = counter or NodeCounts(stream, min_nodes=1, enabled=terminal)
        self.lock = threading.Lock()
        self.phase: str | None = None

    def __call__(self, phase: str, done: int, total: int) -> None:
        with self.lock:
            if phase != self.phase:
                if self.phase is not None:
                    self.close()
                self.phase = phase
                said = PHASES.get(phase, phase + ": {total} node(s)").format(total=total)
                self.stream.write(f"cluster: {said}\n")
                self.stream.flush()
            if phase not in UNCOUNTED:
                self.counter(phase, done, total)

    def say(self, text: str) -> None:
        """One indented line; above the live count when one is drawn, so neither garbles
        the other."""
        line = f"cluster:   {text}"
        with self.lock:
            above = getattr(self.counter, "above", None)
            if above is None or not above(line):
                self.stream.write(line + "\n")
                self.stream.flush()

    def close(self) -> None:
        close = getattr(self.counter, "close", None)
        if close is not None:
            close()




def render_text(report: Report) -> str:
    """Nodes with the same results share a row (hostlist); problems each get their fix."""
    from rich.console import Console as RichConsole
    from rich.table import Table
    checks = list(dict.fromkeys(f.check for f in report.findings if f.node != "all"))
    status = {(f.node, f.check): f.status for f in report.findings}
    groups: dict[tuple[str, ...], list[str]] = {}
    for node in report.nodes:
        groups.setdefault(tuple(status.get((node, c), "") for c in checks), []).append(node)
    table = Table(title=f"cluster doctor: {len(report.nodes)} node(s), master "
                        f"{report.master}:{report.port}")
    table.add_column("nodes")
    for c in checks:
        table.add_column(c)
    for row, nodes in groups.items():
        table.add_row(hostlist.collect_hostlist(nodes), *row)
    rc = RichConsole(record=True, width=160)
    with rc.capture() as cap:
        rc.print(table)
    lines = [cap.get().rstrip()]
    problems = [f for f in report.findings if f.status in ("warn", "fail")]
    if problems:
        lines.append("")
        for f in problems:
            lines.append(f"{f.status.upper()} {f.node}: {f.check}: {f.detail}")
            if f.fix:
                lines.append(f"     fix: {f.fix}")
    lines.append("")
    for attr, values in report.fingerprint.items():
        text = "; ".join(f"{v} on {hostlist.collect_hostlist(n)}" for v, n in values.items())
        lines.append(f"{attr}: {text}")
    if report.deep:
        lines += deep_lines(report.deep)
    if report.tuning:
        lines += tuning_lines(report.tuning)
    lines.append("")
    lines.append(f"{'OK' if report.ok else 'FAILED'}: {sum(f.status == 'fail' for f in report.findings)} "
                 f"failure(s), {sum(f.status == 'warn' for f in report.findings)} warning(s) "
                 f"in {report.seconds:.1f} s")
    return "\n".join(lines)


def deep_lines(deep: dict[str, Any]) -> list[str]:
    lines = ["", f"collective ({deep['backend']}, {deep['world_size']} processes): "
                 f"sum {'right' if deep['sum_ok'] else 'WRONG'}"]
    for r in deep["allreduce"]:
        lines.append(f"  all_reduce {r['bytes'] / 2**20:9.3f} MiB  bus bandwidth {r['busbw_gbps']:8.3f} GB/s")
    for p in deep["pairs"]:
        lines.append(f"  {p['a']} <-> {p['b']}: {p['gbps']:8.3f} GB/s ({p['bytes'] / 2**20:.1f} MiB ping-pong)")
    return lines
