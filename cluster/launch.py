"""The one flow of every backend (local, SSH, SLURM): plan, record, check (check.py), start,
watch, and what came of it; a whole-job restart after a failure while restarts are left."""
from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .backends import Backend, NodeProcess, Record, node_checks
from .recovery.check import checked_plan
from .console import Console
from .errors import InputError, Interrupted, NodeLost, RunFailed
from .observe.hang import odd_node, save as save_hang
from .observe.hang_timeout import timeout_of
from .inventory import unset_forwarded
from .nodes import NodeExit
from .recovery.ledger import Ledger
from .recovery.classes import STOP, Verdict, classify, decide
from .recovery.grow import Readmission, rejoined
from .recovery.pool import attempt_events, culprits, remember, replace
from .plan import Job, Plan, Templates
from .runs import RunDir
from .observe.slow import SlowNodes
from .spec import HangAuto, Host, Inventory, SlowNode
from .observe import metrics
from .observe import timeline as tl
from .observe.alerts import known_secrets
from .observe.views import RunViews
from .observe.watch import Watcher, WatchResult

def dry_run(inventory: Inventory, job: Job, templates: Templates, run: RunDir,
            backend: Backend[Any], argv: list[str], console: Console,
            environ: Mapping[str, str] = os.environ) -> Plan:
    """Render and record the plan, print it, and what this shell does not set that a launch
    needs (secret_env, env_forward: said, never a value); contact nothing."""
    plan: Plan = backend.plan(inventory, job, templates)
    run.record(plan, inventory, backend.name, argv, {"dry_run": True})
    console.raw(str(plan))
    preview = getattr(backend, "preview", None)     # an optional capability (backends/__init__)
    if preview is not None:
        text, notes = preview(plan)
        console.raw(text)
        for note in notes:
            console.info(note)
    for note in unset_notes(inventory, environ):
        console.info(note)
    console.info(f"dry run {plan.run_id}: {plan.dry_run_note(run.path)}")
    return plan


def unset_notes(inventory: Inventory, environ: Mapping[str, str]) -> list[str]:
    """For a dry run: each name a launch would refuse for, as a placeholder, never a value."""
    notes = [f"dry run: secret_env {name}=<not set in this shell>; a launch refuses until "
             f"it is exported (a secret's value is never printed or written)"
             for name in missing_secrets(inventory, environ)]
    notes += [f"dry run: env_forward {name}=<not set in this shell>, so the scripts above "
              f"leave it out; a launch refuses until it is exported"
              for name in unset_forwarded(inventory, environ)]
    return notes


def missing_secrets(inventory: Inventory, environ: Mapping[str, str]) -> list[str]:
    return sorted({name for h in inventory.hosts for name in h.secret_env if name not in environ})


def secret_values(inventory: Inventory,
                  environ: Mapping[str, str] = os.environ) -> dict[str, dict[str, str]]:
    """Per host, the values of its secret_env names, from the launching shell. They are held
    in memory only and handed to each node's supervisor over its connection at start."""
    missing = missing_secrets(inventory, environ)
    if missing:
        raise InputError(f"secret environment variable(s) {', '.join(missing)} not set in this "
                         f"shell (secret_env / --secret-env take their values from it); "
                         f"export them first. Nothing was contacted")
    return {h.name: {name: environ[name] for name in h.secret_env} for h in inventory.hosts}


# Open files per node in the launcher: its SSH socket, its log file, and room for a second
# channel's pipes (local nodes) and the SFTP session of a sync.
FILES_PER_NODE = 4


# (getrlimit, setrlimit): resource's, or a test's
Limits = tuple[Callable[[int], tuple[int, int]], Callable[[int, tuple[int, int]], None]]


def ensure_open_files(nodes: int, limits: Limits | None = None) -> None:
    """Raise this process's soft limit on open files to what `nodes` need (up to the hard
    limit): 1024, the usual soft default, runs out near 250 nodes. Raises InputError, before
    anything is contacted, when even the hard limit is too low."""
    import resource
    get, set_ = limits or (resource.getrlimit, resource.setrlimit)
    soft, hard = get(resource.RLIMIT_NOFILE)
    need = FILES_PER_NODE * nodes + 64
    if soft == resource.RLIM_INFINITY or soft >= need:
        return
    if hard != resource.RLIM_INFINITY and hard < need:
        raise InputError(f"{nodes} nodes need about {need} open files; this shell allows "
                         f"{hard} (ulimit -Hn). Raise it (limits.conf, systemd LimitNOFILE) "
                         f"or launch fewer nodes. Nothing was contacted")
    room = need * 2                       # headroom for a --min-nodes retry, doctor's pairs
    set_(resource.RLIMIT_NOFILE, (room if hard == resource.RLIM_INFINITY else min(room, hard), hard))


@dataclass(frozen=True)
class Options:
    """How `cluster up` runs a job, beyond what to run and where."""
    detach: bool = False
    preflight: bool = True        # cross-node checks and the interface written into each script
    restarts: int = 0             # whole-job restarts after a failure, one budget for the job
    restart_after: float = 0.0    # failures in the first S seconds are configuration: no restart
    min_nodes: int | None = None  # a lost node is left out of the next attempt while this many remain
    hang_timeout: float | str = 0.0   # no progress anywhere for this long: stacks, then stop
    hang_auto: HangAuto = HangAuto()  # how hang_timeout 'auto' learns it (cluster.observe.hang_timeout)
    slow_node: SlowNode = SlowNode()  # when a node is named slow (cluster.observe.slow)
    ledger: Ledger | None = field(default=None, compare=False)   # what each node did, kept
    spares: tuple[Host, ...] = ()     # hosts that take the place of one set aside (--nodes N)
    replace_slow: bool = False        # a node named slow is set aside too (--replace-slow)
    grow: bool = False                # a lost node back: restart at full size at a checkpoint
    readmit_every: float = 30.0       # seconds between two looks at a lost node (gate.readmit_every)
    metrics: metrics.Endpoint | None = None   # where the live metrics are served (observe.metrics)
    launched: float | None = None     # time.monotonic() when the command began (goodput's start)
    notify: tuple[str, ...] = ()      # URLs the run's alerts are POSTed to (observe/alerts.py)
    # Set by another thread (the Python API's Run.down) to stop every node, as Ctrl-C does.
    stop: threading.Event | None = field(default=None, compare=False)


def up(inventory: Inventory, job: Job, templates: Templates, backend: Backend[Any], run: RunDir,
       argv: list[str], console: Console, options: Options = Options(),
       environ: Mapping[str, str] = os.environ) -> int:
    """Check, start, watch; after a failure, with restarts left, the whole job again on a
    fresh rendezvous (CLUSTER_RESTART_COUNT on the nodes), leaving lost nodes out while
    options.min_nodes remain. Each step goes into runs/<id>/events.jsonl as it happens; an
    attached run ends by writing its timeline (cluster.observe.timeline_png)."""
    timeline = tl.recorder_for(run.path)
    views = RunViews(run, timeline, console, launched=options.launched, serve_at=options.metrics,
                     notify=options.notify,
                     secrets=known_secrets((*inventory.hosts, *options.spares), environ))
    try:
        views.open()
        code = _up(inventory, job, templates, backend, run, argv, console, options, environ,
                   timeline)
    except BaseException as exc:
        views.ended(not options.detach and tl.CHECK in timeline.kinds,   # not a refused line
                    ok=False, error=str(exc) or type(exc).__name__)
        raise
    else:
        views.ended(not options.detach, ok=code == 0, code=code)
        return code
    finally:
        views.close()


def _up(inventory: Inventory, job: Job, templates: Templates, backend: Backend[Any], run: RunDir,
        argv: list[str], console: Console, options: Options, environ: Mapping[str, str],
        timeline: tl.Recorder) -> int:
    secrets = secret_values(inventory, environ)
    ensure_open_files(len(inventory.hosts))
    checks = node_checks(backend)
    if checks is not None:   # every login starts now, while the plan is recorded and rendered
        checks.open_all(inventory.hosts)
    if hasattr(backend, "note"):        # what the backend tells the user goes where the run's does
        backend.note = console.info
    history: list[Record] = []
    spares = list(options.spares)          # taken from as nodes are set aside
    target = len(inventory.hosts)          # the job's size, which it grows back to
    readmit = Readmission(getattr(backend, "answers", None), options.readmit_every,
                          options.grow, console.info)
    try:
        return _attempts(inventory, job, templates, backend, run, argv, console, options,
                         secrets, timeline, history, spares, target, readmit)
    finally:
        readmit.close()


def _attempts(inventory: Inventory, job: Job, templates: Templates, backend: Backend[Any],
              run: RunDir, argv: list[str], console: Console, options: Options,
              secrets: dict[str, dict[str, str]], timeline: tl.Recorder, history: list[Record],
              spares: list[Host], target: int, readmit: Readmission) -> int:
    """Each attempt in turn, until one ends without a restart."""
    while True:
        job = dataclasses.replace(job, attempt=len(history))
        timeline.attempt = job.attempt
        timeline.event(tl.CHECK)
        inventory, plan = checked_plan(inventory, job, templates, backend, run, argv, console,
                                       options, history, spares)
        timeline.event(tl.CHECKED)
        if options.stop is not None and options.stop.is_set():
            checks = node_checks(backend)
            if checks is not None:
                checks.release()               # checked, not started: the staged nodes let go
            raise Interrupted(f"stopped before run {plan.run_id} started; nothing was started",
                              signum=signal.SIGTERM)
        t0 = time.monotonic()
        timeline.event(tl.START)
        procs = backend.start(plan, detach=options.detach, secrets=secrets, run=run)
        timeline.event(tl.STARTED, nodes=list(plan.log_names))    # each node's label (a lane)
        spent = _spent(history)
        console.info(backend.start_note(procs, plan)
                     + (f" ({_attempt_of(spent, options.restarts)})" if spent else ""))
        run.update(**backend.started(plan, procs, run),
                   timings={**(run.meta().get("timings") or {}), "start": round(time.monotonic() - t0, 3)})
        if options.detach:
            timeline.event(tl.DETACHED)
            console.info(f"detached; follow with `cluster logs -f {plan.run_id}`, "
                         f"stop with `cluster down {plan.run_id}`")
            return 0
        logs = {label: run.path / "logs" / name for label, name in plan.log_names.items()}
        timeout = timeout_of(options.hang_timeout, options.hang_auto, console.info)
        readmit.attempt(below=len(inventory.hosts) < target)
        result = Watcher(procs, console, logs, settle=plan.stop_grace + 30,
                         hang_timeout=timeout, stop=options.stop,
                         timeline=timeline, slow=SlowNodes(options.slow_node),
                         on_slow=lambda slow: run.update(slow_nodes=slow),
                         planned=readmit.planned, on_checkpoint=readmit.on_checkpoint).run()
        timeline.flush()
        odd = odd_node(result.hang.stacks) if result.hang else None
        events = attempt_events(plan.run_id, result.exits, result.first_failure, result.causes,
                                result.slow, result.ok, odd)
        verdict = _verdict(result, odd)
        _record(run, plan, backend, procs, result, history, console, verdict)
        remember(options.ledger, events, console.info)
        timeline.event(tl.ENDED, how=_ending(result),
                       **({"odd_node": odd[0], "odd_frame": odd[1]} if odd else {}))
        if result.planned:
            console.info(result.planned)
            timeline.event(tl.RESTART, why=result.planned, planned=True)
        else:
            retry = _retry(result, plan, options, history, verdict)
            if retry is None:
                return _outcome(result, plan, console)
            console.info(retry)
            timeline.event(tl.RESTART, why=retry, **_cause_of(result),
                           **({"class": verdict.cls} if verdict else {}))
            before = inventory.hosts
            held = culprits(events, options.replace_slow)
            inventory = _next_hosts(inventory, held, spares, options, console)
            _aside(timeline, before, inventory.hosts, held)
            lost = {e.node for e in events if e.kind == "lost"}
            kept = {h.name for h in inventory.hosts}
            readmit.lost([h for h in before if h.name in lost and h.name not in kept])
        inventory = rejoined(inventory, readmit.take_back(), spares, target, options.ledger,
                             console.info)


def _verdict(result: WatchResult, odd: tuple[str, str] | None) -> Verdict | None:
    """The failure's class (cluster.recovery.classes), from the first failure's evidence;
    None for an attempt that finished or was interrupted."""
    if result.ok or result.interrupted or result.planned:
        return None
    label, ex = result.first_failure if result.first_failure else ("", None)
    return classify(result.causes.get(label), lost=bool(ex and ex.lost),
                    hang=result.hang is not None, gate_failed=False,
                    odd_one_out=odd[0] if odd else None, ended=ex.detail if ex else "")


def _record(run: RunDir, plan: Plan, backend: Backend[Any], procs: list[NodeProcess],
            result: WatchResult, history: list[Record], console: Console,
            verdict: Verdict | None = None) -> None:
    """run.json: this attempt's exits, how it ended and its failure's class; the hang
    evidence under hang/."""
    if result.hang is not None:
        save_hang(run, result.hang, console)
    history.append({"attempt": len(history), "nodes": plan.node_names or result.nodes,
                    "master_port": plan.master_port,
                    "ended": _ending(result), **_cause_of(result), "joined": sorted(joined(result)),
                    "seconds": round(time.monotonic() - result.started, 1),
                    **({"slow_nodes": result.slow} if result.slow else {}),
                    **({"step": result.step} if result.step is not None else {}),
                    **({"checkpoint": result.checkpoint} if result.checkpoint is not None else {}),
                    **({"planned": True} if result.planned else {}),
                    **({"class": verdict.cls, "rule": verdict.rule} if verdict else {})})
    run.update(exits={k: dataclasses.asdict(v) for k, v in result.exits.items()},
               interrupted=signal.Signals(result.signum).name if result.interrupted else None,
               attempts=history, slow_nodes=result.slow, **backend.ended(plan, procs, result))


def _ending(result: WatchResult, with_cause: bool = False) -> str:
    """How the attempt ended; with_cause: a failure led by its worker's own error (the
    restart line); without, as the timeline and run.json's `ended` put it (their `cause`
    and the timeline's failure event carry the error apart)."""
    if result.interrupted:
        return f"interrupted ({signal.Signals(result.signum).name})"
    if result.hang is not None:
        return f"hang: no progress for {result.hang.seconds:.0f} s"
    if result.planned:
        return f"stopped for a restart: {result.planned}"
    if result.first_failure:
        label, ex = result.first_failure
        return _failed(label, ex, result.causes.get(label) if with_cause else None)
    return "finished"


def _failed(label: str, ex: NodeExit, cause: str | None) -> str:
    """'node [b] failed: RuntimeError: boom (exit code 1)': the worker's own error leads,
    how the node ended after it; the final error's first words and a restart's."""
    return f"node [{label}] failed: {f'{cause} ({ex.describe()})' if cause else ex.describe()}"


def _cause_of(result: WatchResult) -> dict[str, str]:
    """{"cause": the first failure's worker's own error} for run.json's attempt and the
    restart's event; {} when none was seen."""
    cause = result.causes.get(result.first_failure[0]) if result.first_failure else None
    return {"cause": cause} if cause else {}


def _retry(result: WatchResult, plan: Plan, options: Options,
           history: list[Record], verdict: Verdict | None = None) -> str | None:
    """Why the job starts again, or None when it does not (configuration, or a failure
    whose class says a restart would fail again: result.not_retried says why)."""
    if result.ok or result.interrupted or _spent(history) > options.restarts:
        return None
    why_not = _configuration(result, options)
    if why_not:
        result.not_retried = (f"{why_not}, which is configuration ({CONFIGURATION}) and would "
                              f"fail again")
        return None
    decision = decide(_failures(history)[:-1], verdict, step=result.step) if verdict else None
    if decision is not None and decision.action == STOP:
        result.not_retried = decision.why
        return None
    return (f"{_ending(result, with_cause=True)}; restarting the whole job on a fresh rendezvous "
            f"({_attempt_of(_spent(history), options.restarts)})")


def _failures(history: list[Record]) -> list[Record]:
    """The attempts that ended in a failure or a stop, not those the launcher stopped to grow."""
    return [h for h in history if not h.get("planned")]


def _spent(history: list[Record]) -> int:
    """Restarts the failures so far have spent (the first attempt is none)."""
    return len(_failures(history))


# What a failure before the rendezvous completed comes from; it would fail again.
CONFIGURATION = "a torchrun option, the python, torch, the environment, the master's address"


def _attempt_of(attempt: int, restarts: int) -> str:
    """'attempt 2 of 3, 1 restart left' for the attempt starting (0 the first), the restarts
    left once it has started (that restart is spent), with --max-restarts `restarts`."""
    left = restarts - attempt
    after = "no restart left" if left == 0 else f"{left} restart{'s' if left > 1 else ''} left"
    return f"attempt {attempt + 1} of {restarts + 1}, {after}"


def _configuration(result: WatchResult, options: Options) -> str | None:
    """Why this failure is configuration, which a restart would only repeat; None if not."""
    if not joined(result):
        return ("it failed before its rendezvous was complete (no node's torchrun had started "
                "its workers)")
    if time.monotonic() - result.started < options.restart_after:
        return f"it failed in its first {options.restart_after:g} s (--restart-after)"
    return None


def joined(result: WatchResult) -> set[str]:
    """The nodes of this attempt (each reports an exit) that had joined its rendezvous: all of
    them once one node is known to have started its workers, else none. torchrun starts them
    only after its rendezvous is complete, which needs every node: each attempt runs with a
    fixed --nnodes (--min-nodes only shrinks the next attempt), and rank assignment gathers
    every node's entry first, under the static rendezvous too. Known from events, never from
    a sample: a node's report of a failed worker, a node that finished, a supervisor that
    stopped the node's workers or found them left after its torchrun died."""
    proof = (result.had_workers or any(ex.ok for ex in result.exits.values())
             or any(report.get("workers") for report in result.stops.values()))
    return set(result.exits) if proof else set()


def _next_hosts(inventory: Inventory, held: dict[str, str], spares: list[Host],
               options: Options, console: Console) -> Inventory:
    """The next attempt's hosts: each node the failure is held against set aside, a spare in
    its place (taken from `spares`), or left out while --min-nodes remain (cluster.recovery.pool)."""
    if not held:
        return inventory
    out = replace(inventory.hosts, held, spares, min_nodes=options.min_nodes)
    return out.applied(inventory, spares, console.info)


def _aside(timeline: tl.Recorder, before: Sequence[Host], after: Sequence[Host],
           held: Mapping[str, str]) -> None:
    """An event for each host the next attempt leaves out, why, and the spare in its place."""
    names = {h.name for h in after}
    came = [h.name for h in after if h.name not in {b.name for b in before}]
    for host in before:
        if host.name not in names:
            timeline.event(tl.ASIDE, host=host.name, why=held.get(host.name, "set aside"),
                           **({"spare": came.pop(0)} if came else {}))


def _evidence(result: WatchResult, label: str) -> str:
    """What the final error shows under its line: the failing worker's own traceback (its last
    frames and error; torchrun's closing banner only names the rank), else the node's last
    lines; then the other ranks' errors, which came of it (a peer's gloo "Connection closed")."""
    if label in result.tracebacks:
        rank, trace = result.tracebacks[label]
        who = f"rank {rank}'s traceback" if rank is not None else "its worker's traceback"
        text = f"{who} ([{label}]):\n" + "\n".join(f"  | {line}" for line in trace)
    else:
        tail = result.tails.get(label) or []
        text = (f"last {len(tail)} line(s):\n" + "\n".join(f"  | {line}" for line in tail)
                if tail else "")
    if result.then:
        shown = result.then[:OTHER_ERRORS]
        more = len(result.then) - len(shown)
        text += (f"\nthen {len(result.then)} other rank(s) failed, most likely because it did:\n"
                 + "\n".join(f"  | {line}" for line in shown)
                 + (f"\n  | ... and {more} more (each node's log has its own)" if more else ""))
    return text.lstrip("\n")


# The other ranks' errors shown under a failure: at 1,000 nodes every rank says its peer is gone.
OTHER_ERRORS = 8


def _outcome(result: WatchResult, plan: Plan, console: Console) -> int:
    left = result.leftovers()
    if left:
        console.info(f"WARNING: processes of run {plan.run_id} still alive: {left}")
    if result.interrupted:
        name = signal.Signals(result.signum).name
        summaries = [r["summary"] for r in result.stops.values() if r.get("summary")]
        what = "; ".join(summaries) or (f"every node of run {plan.run_id} was stopped"
                                       + (f" except {left}" if left else ""))
        raise Interrupted(f"interrupted ({name}); {what}", signum=result.signum)
    not_retried = result.not_retried
    why_not = f"; not restarted: {not_retried}" if not_retried else ""
    if result.hang is not None:
        raise RunFailed(f"run {plan.run_id} hung: no progress on any node for "
                        f"{result.hang.seconds:.0f} s; every node was stopped (stacks: "
                        f"runs/{plan.run_id}/hang/){why_not}")
    if result.first_failure:
        label, ex = result.first_failure
        stopped = len(set(result.stops) - {label})     # the others (it may be stopped too)
        msg = (f"{_failed(label, ex, result.causes.get(label))}; "
               f"{'stopped the other ' + str(stopped) + ' node(s)' if stopped else 'no other node was running'}"
               f" (logs: {plan.logs_hint})")
        if ex.lost:
            msg += (f"; if it is only cut off, [{label}] stops its own processes within "
                    f"ssh.keepalive of losing the launcher")
        raise (NodeLost if ex.lost else RunFailed)(msg + why_not, details=_evidence(result, label))
    console.info(f"run {plan.run_id}: all {plan.node_count} node(s) finished")
    return 0
