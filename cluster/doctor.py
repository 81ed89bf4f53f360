"""`cluster doctor`: why nodes won't talk, found in seconds and named with the fix.

Every node at once, over the same transport as `cluster up`: SSH login (batch mode, host keys
per policy), what each node has (python, torch, CUDA, cuDNN, NCCL, driver, GPUs and whether
they are busy, /dev/shm, free disk, open-file limit, clock offset), the interface that reaches
the master, the master port free there and open to every node. Differences across nodes that
break a job fail, the others warn; the fingerprint shows each value once with the nodes that
have it. `--deep` also runs a real collective across all nodes (cluster/deep.py) and adds its
findings. While it runs, each phase is said as it begins and, on a terminal, counted
(PhaseLines).
"""
from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import IO, Any

import hostlist

from .errors import ClusterError, PreflightError
from .plan import Job, LaunchPlan, Templates, container_check, render, shquote
from .recovery.check import judge
from .recovery.gate import FAIL, PASS, Clock, Finding, clock_offset, evaluate, fingerprint
from .backends import REMOTE_NODES, supports
from .runs import DOCTOR_PREFIX, new_run_id
from .spec import Inventory, container_name
from .console import NodeProgress
from .deep import collective, deep_findings, deep_lines, deep_summary, tuning_lines

SCHEMA = 1


@dataclass
class Report:
    nodes: list[str]
    master: str
    port: int
    findings: list[Finding]
    fingerprint: dict[str, dict[str, list[str]]]
    deep: dict[str, Any] | None = None
    tuning: dict[str, Any] | None = None      # --tune-nccl: the table and what was kept
    seconds: float = 0.0                      # the whole of it, as the user waited
    # Each part's own seconds, in order: "survey" (probe, containers, reach), "collective"
    # (--deep), "tune-nccl" (every setting's launch).
    timings: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not any(f.status == FAIL for f in self.findings)

    def to_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "ok": self.ok, "seconds": round(self.seconds, 3),
                "timings": {k: round(v, 3) for k, v in self.timings.items()},
                "nodes": self.nodes, "master": {"name": self.master, "port": self.port},
                "checks": [dataclasses.asdict(f) for f in self.findings],
                "fingerprint": self.fingerprint, "deep": self.deep, "tuning": self.tuning}


def diagnose(inventory: Inventory, backend: Any, templates: Templates, *,
             deep: bool = False, run_deep: Callable[[str], dict[str, Any]] | None = None,
             run_tune: Callable[[], dict[str, Any]] | None = None,
             started: float | None = None,
             timer: Callable[[], float] = time.monotonic) -> Report:
    """Probe every node (never raising for one node's failure: it becomes a finding), check
    that every node reaches the master port, judge; with deep, run the collective too
    (run_deep(run_id): recorded as runs/<run_id>); with run_tune, the NCCL sweep. Each phase
    is announced to backend.progress (PhaseLines), if it has one. report.seconds counts from
    `started` (the command's start, on `timer`), so it is what the user waited for."""
    t0 = timer() if started is None else started
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
    report.timings["survey"] = timer() - t0
    if deep and run_deep is not None and report.ok:
        t = timer()
        run_id = f"{DOCTOR_PREFIX}{new_run_id()}"
        begin(backend, "collective", len(plan.nodes), run=run_id)
        report.deep = deep_summary(run_deep(run_id))
        report.findings += deep_findings(report.deep)
        report.timings["collective"] = timer() - t
    if run_tune is not None and report.ok:
        t = timer()
        try:
            report.tuning = run_tune()
        except PreflightError as exc:
            report.findings.append(Finding("all", "nccl tuning", FAIL, str(exc)))
        report.timings["tune-nccl"] = timer() - t
    report.seconds = timer() - t0
    return report


def deep_gate(inventory: Inventory, backend: Any, templates: Templates,
              console: Any) -> None:
    """`gate: deep` before the first start: doctor --deep's look (every node's facts judged
    deep, then a collective on all of them, each node's bandwidth against the job's median).
    Any failure raises PreflightError naming each one; nothing has started."""
    measure = collective(inventory, backend, templates)
    console.info(f"gate: deep: checking {len(inventory.hosts)} node(s) as cluster doctor --deep does")
    report = diagnose(inventory, backend, templates, deep=True,
                      run_deep=lambda run_id: measure({}, run_id=run_id))
    judge(report.findings, len(report.nodes), console)


def begin(backend: Any, phase: str, total: int, run: str | None = None) -> None:
    """Say that a phase starts (its nodes' ends are told by backend.each, phase=...); `run`,
    the run that records it."""
    progress = getattr(backend, "progress", None)
    if progress is None:
        return
    if run is not None and isinstance(progress, PhaseLines):
        progress.run = run
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


# --- output -------------------------------------------------------------------------------------


# What each phase does, said as it begins; the phases without a count draw no bar. "measure"
# counts the collective's measurements (collective.py's steps), not nodes.
PHASES = {
    "probe": "asking {total} node(s) what they have (python, torch, GPUs, disk, clock)",
    "inside": "starting {total} node(s)' container to see its torch and GPUs",
    "reach": "testing that {total} node(s) reach the master port",
    "collective": "running a collective across {total} node(s) (all_reduce, then every pair); "
                  "it is recorded as runs/{run}",
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
        self.run = "doctor-..."           # the run that records the phase (begin sets it)

    def __call__(self, phase: str, done: int, total: int) -> None:
        with self.lock:
            if phase != self.phase:
                if self.phase is not None:
                    self.close()
                self.phase = phase
                said = PHASES.get(phase, phase + ": {total} node(s)").format(total=total, run=self.run)
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
                 f"in {report.seconds:.1f} s{parts(report.timings)}")
    return "\n".join(lines)


PARTS = {"survey": "the survey", "collective": "the collective", "tune-nccl": "NCCL tuning"}


def parts(timings: Mapping[str, float]) -> str:
    """' (the survey 1.8 s, NCCL tuning 5.4 s)' when more than the survey ran, else ''."""
    if len(timings) < 2:
        return ""
    return " (" + ", ".join(f"{PARTS.get(k, k)} {v:.1f} s" for k, v in timings.items()) + ")"
