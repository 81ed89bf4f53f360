"""The verbs of a recorded run: `cluster status`, `cluster logs`, `cluster down`."""
from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import click

from .. import backends
from ..backends import EXEC, NODE_CHECKS, supports
from ..handle import LogErrors, detached_error, first_failed
from .main import CONTEXT, NotifyUrl, SafePath, complete_run, main
from ..errors import ClusterError, InputError, Interrupted, NodeLost, RunFailed
from ..nodes import NodeStatus, node_row, outcome
from ..runs import RunDir
from ..console import Console
from ..observe import timeline as tl
from ..observe.alerts import Notifier, known_secrets


@main.command(context_settings=CONTEXT)
@click.argument("run", required=False, shell_complete=complete_run)
@click.option("--timeline", "draw", is_flag=True,
              help="Also write runs/RUN/timeline.png (timeline.json without matplotlib) and print its path.")
@click.option("--metrics-textfile", "textfile", type=SafePath(dir_okay=False), metavar="PATH",
              help="Instead of the table, write the run's metrics (Prometheus text, the names "
                   "`cluster up --metrics-port` serves) to PATH at once, for node_exporter's "
                   "textfile collector; quiet, for a timer.")
@click.option("--goodput", "show_goodput", is_flag=True,
              help="Instead of the nodes, where the wall time went: RUN's attempts, or with no "
                   "RUN the last runs (of -i INVENTORY), a row each (docs/goodput.md).")
@click.option("-i", "--inventory", type=click.Path(dir_okay=False, path_type=Path),
              help="With --goodput: only the runs of this inventory file.")
@click.option("--last", type=click.IntRange(1, 10000), default=10, show_default=True,
              help="With --goodput: how many runs.")
@click.option("--json", "as_json", is_flag=True, help="With --goodput: JSON, not a table.")
def status(run: str | None, draw: bool, textfile: str | None, show_goodput: bool,
           inventory: Path | None, last: int, as_json: bool) -> None:
    """Each node of RUN (default: the newest): running / exited with code / stopped / lost."""
    from rich.console import Console as RichConsole
    from rich.table import Table
    if show_goodput:
        goodput_report(run, inventory, last, as_json)
        return
    if inventory is not None or as_json:
        raise InputError("-i/--inventory and --json go with --goodput")
    rd = RunDir.find(run)
    rd.launched()
    if textfile is not None:
        write_metrics(rd, textfile)
        return
    backend = backends.recorded(rd)
    try:
        rows = backend.status(rd)
    finally:
        backend.close()
    table = Table(title=f"run {rd.run_id} ({rd.meta()['backend']})")
    for col in ("rank", "node", "state", "exit code", "pid", "uptime", "detail"):
        table.add_column(col)
    for r in rows:
        uptime = time.strftime("%H:%M:%S", time.gmtime(r.uptime)) if r.uptime else ""
        table.add_row(str(r.rank), r.name, r.state, "" if r.code is None else str(r.code),
                      "" if r.pid is None else str(r.pid), uptime, r.detail)
    out = RichConsole()
    out.print(table)
    meta = rd.meta()
    attempts = meta.get("attempts") or []
    if len(attempts) > 1 or meta.get("attempt"):
        for a in attempts:
            cls = f" (class: {a['class']}, {a.get('rule')})" if a.get("class") else ""
            out.print(f"attempt {a['attempt'] + 1} ({', '.join(a['nodes'])}): {a['ended']}{cls}",
                      markup=False, highlight=False)
    for line in (run_notes(meta, started=bool(rows)) + launcher_gone(meta, rows) + quarantine(rd)
                 + goodput_lines(rd)):
        out.print(line, markup=False, highlight=False)
    if draw:
        from ..observe import timeline_png
        timeline_png.write(rd, Console())


def goodput_lines(rd: RunDir) -> list[str]:
    """The run's goodput line, and each attempt's when there were several."""
    from ..observe import goodput
    g = goodput.of_run(rd)
    if g is None:
        return []
    rows = g.get("attempts") or []
    return [goodput.line(g)] + ([f"  attempt {a['attempt'] + 1}: {goodput.line(a)}" for a in rows]
                                if len(rows) > 1 else [])


def goodput_report(run: str | None, inventory: Path | None, last: int, as_json: bool) -> None:
    """`status --goodput`: RUN's attempts, or the last runs, as a table or JSON."""
    import json
    from rich.console import Console as RichConsole
    from rich.table import Table
    from ..observe import goodput
    from ..runs import runs_root
    if run is not None:
        rd = RunDir.find(run)
        g = goodput.of_run(rd)
        if g is None:
            raise InputError(f"run {rd.run_id} has no goodput: it was detached, a dry run, or "
                             f"never reached its check")
        found = [(f"{rd.run_id} attempt {a['attempt'] + 1}", a) for a in g["attempts"]]
        found.append((f"{rd.run_id} (all)", g))
    else:
        found = [(rd.run_id, g) for rd, g in goodput.recent(runs_root(), inventory, last)]
    if as_json:
        click.echo(json.dumps([{"run": name, **g} for name, g in found], indent=1))
        return
    table = Table(title="goodput: where the wall time went (seconds; docs/goodput.md)")
    order = ["training"] + [p for p in goodput.PARTS if p != "training"]
    for col in ("run", "goodput", "wall") + tuple(goodput.SHORT[p] for p in order):
        table.add_column(col, justify="left" if col == "run" else "right", no_wrap=True)
    for name, g in found:
        frac = "" if g.get("fraction") is None else f"{g['fraction'] * 100:.1f}%"
        table.add_row(name, frac, f"{g['wall']:.1f}",
                      *(f"{g['parts'].get(p, 0.0):.1f}" for p in order))
    RichConsole(width=max(140, shutil.get_terminal_size().columns)).print(table)
    if not found:
        click.echo("no run with a goodput" + (f" of {inventory}" if inventory else "")
                   + " (attached runs of `cluster up` record one)")


def write_metrics(rd: RunDir, path: str) -> None:
    """The run's metrics from what its nodes say now, as `cluster top` reads them."""
    from .. import resolve
    from ..observe import metrics, top
    backend = resolve.recorded_backend(rd)
    try:
        collect = top.collect if supports(rd.meta()["backend"], EXEC) else top.collect_slurm
        rows = collect(rd, backend)
    finally:
        backend.close()
    try:
        metrics.write_textfile(path, top.metrics_view(rd.run_id, rows, rd.meta()))
    except OSError as exc:
        raise InputError(f"Invalid value for --metrics-textfile: cannot write {path}: "
                         f"{exc.strerror or exc}") from None


def quarantine(rd: RunDir) -> list[str]:
    """The run's nodes that the node ledger holds in quarantine now (nodes the launcher
    checks; a scheduler chooses its own)."""
    if not supports(rd.meta().get("backend") or "", NODE_CHECKS):
        return []
    from ..recovery.pool import ledger_for, quarantined_lines
    inventory = rd.inventory()
    names = [n["name"] for n in rd.meta().get("nodes") or []]
    return [line for _, line in quarantined_lines(ledger_for(inventory.source, inventory.gate),
                                                  names)]


def run_notes(meta: dict, started: bool) -> list[str]:
    """What the record says beyond the nodes' rows: why it was stopped, how the launch ended,
    or that no node has started yet (it is being checked, or its check failed)."""
    notes = []
    error = meta.get("error") or ""
    if meta.get("stopped_because"):
        notes.append(f"stopped because {meta['stopped_because']}"
                     + (f" (exit code {meta['exit_code']})" if meta.get("exit_code") else ""))
        if error.startswith("interrupted"):
            error = ""             # that stop, not a signal from someone else: said above
    if error:
        notes.append(f"ended with exit code {meta.get('exit_code')}: {error}")
    elif not started:
        notes.append("no node has started yet (the nodes are being checked)")
    for slow in meta.get("slow_nodes") or []:        # this attempt's, named while it runs
        notes.append(slow_note(slow))
    return notes


def launcher_gone(meta: dict, rows: list[NodeStatus]) -> list[str]:
    """An attached run that every node has ended while its launcher recorded no end (no
    attempt's exits, no error): the launcher was killed or its machine went down, and each
    node's supervisor stopped its job when the launcher's connection closed. Said, with the
    nodes' outcome (once, when they agree)."""
    if (meta.get("detached") or meta.get("exits") or meta.get("error") or not rows
            or any(r.state not in ("exited", "stopped") for r in rows)):
        return []
    _ok, words = outcome(rows)
    return ["the launcher ended without recording how the run ended (it was killed, or its "
            "machine went down); the nodes say: " + words]


def slow_note(slow: dict) -> str:
    """'slow node [b 1]: ranks 2,3 at 1.52x the job's median (compute), named after 65 s'."""
    ranks = ",".join(str(r) for r in slow.get("ranks") or [])
    reference = slow.get("reference", "the job's median").removesuffix("'s")
    return (f"slow node [{slow.get('node')}]: ranks {ranks} at {slow.get('ratio')}x "
            f"{reference} ({slow.get('part')}), named after {slow.get('after_s')} s")


@main.command(context_settings=CONTEXT)
@click.argument("run", required=False, shell_complete=complete_run)
@click.option("-f", "--follow", is_flag=True,
              help="Keep printing until the run ends, then its outcome (exit 4 if it failed).")
@click.option("--node", help="Only this node (by name).")
@click.option("--notify", multiple=True, type=NotifyUrl(), metavar="URL",
              help="With -f: POST the run's first failure and its finish to URL when it ends, "
                   "as cluster up's alerts (a detached run's; docs/alerts.md; repeatable).")
def logs(run: str | None, follow: bool, node: str | None, notify: tuple[str, ...]) -> None:
    """The output of RUN (default: the newest), prefixed by node. Following, it ends with the
    run's outcome, and its exit code says it: 0 when every node exited 0, 4 when one did not
    (5 when one was lost), so `cluster logs -f && ...` goes on only after a success."""
    if notify and not follow:
        raise InputError("--notify goes with -f: what it sends is the end of the run followed")
    rd = RunDir.find(run)
    names = [n["name"] for n in rd.started().get("nodes") or []]
    if node and node not in names:
        raise InputError(f"Invalid value for --node: {node!r} is not in run {rd.run_id} ({', '.join(names)})")
    from ..console import LineSplitter
    console = Console()
    backend = backends.recorded(rd)
    splitters: dict[str, LineSplitter] = {}
    errors = LogErrors()              # the workers' own errors, for the outcome
    try:
        for label, chunk in backend.logs(rd, node=node, follow=follow):
            sp = splitters.setdefault(label, LineSplitter())
            for line in sp.feed(chunk):
                console.node_line(label, list(splitters).index(label), line)
                errors.line(label, line)
        for label, sp in splitters.items():
            for line in sp.flush():
                console.node_line(label, list(splitters).index(label), line)
                errors.line(label, line)
        if follow:
            rows = [r for r in backend.status(rd) if not node or r.name == node]
            try:
                report_outcome(rd, rows, console, errors.causes())
            except ClusterError as exc:
                _notify_end(rd, notify, rows, errors.causes(), exc, console)
                raise
            _notify_end(rd, notify, rows, errors.causes(), None, console)
    finally:
        backend.close()


def _notify_end(rd: RunDir, urls: tuple[str, ...], rows: list, causes: dict[str, str],
                error: ClusterError | None, console: Console) -> None:
    """logs -f --notify: the followed run's first failure and its finish, the alerts an
    attached run's launcher sends (docs/alerts.md), its secrets' values in this shell
    redacted; a few seconds at most."""
    if not urls:
        return
    notifier = Notifier(urls, rd.run_id, known_secrets(rd.hosts(), os.environ), console.info)
    now, first = time.time(), first_failed(rows)
    if first is not None:
        notifier.listen({"kind": tl.FAILED, "t": now, "node": f"{first.name} {first.rank}",
                         "what": causes.get(first.name) or f"{first.state} {first.code}"})
    notifier.listen({"kind": tl.OUTCOME, "t": now, "ok": error is None,
                     **({"error": error.message} if error else {"code": 0})})
    notifier.close()


def report_outcome(rd: RunDir, rows: list, console: Console,
                   causes: dict[str, str] | None = None) -> None:
    """The followed run's outcome, last: a line on success, else the error (exit 4, or 5
    when a node was lost), led by the first node to fail and its worker's own error."""
    ok, words = outcome(rows)
    if ok:
        console.info(f"run {rd.run_id} succeeded: {words}")
        return
    error = NodeLost if any(r.state == "lost" for r in rows) else RunFailed
    first = first_failed(rows)
    if first is None and error is RunFailed and rows and all(r.state == "stopped" or r.code == 0
                                                             for r in rows):
        # A stop, no failure: exit as the stop's code on the nodes says (143, 137 after the
        # grace), as the Python API's wait() of the run does.
        codes = {r.code for r in rows if r.state == "stopped"}
        signum = next(iter(codes)) - 128 if codes in ({137}, {143}) else signal.SIGTERM
        raise Interrupted(f"run {rd.run_id} was stopped: {words}", signum=signum)
    if first is None:
        raise error(f"run {rd.run_id} did not succeed: {words}")
    said = detached_error(rows, rd.run_id, causes)
    others = [r for r in rows if r is not first and not (r.state == "exited" and r.code == 0)]
    raise error(f"run {rd.run_id} did not succeed: {said.message if said else words}"
                + (f"; then {len(others)} other node(s) did not succeed" if others else ""))


STOP_HOW = {"term": "; every one ended within the grace after SIGTERM",
            "kill": "; SIGKILL after the grace"}


def _end(name: str, ended: dict[str, Any]) -> str:
    """How a node that had ended by itself ended, as `cluster status` says it."""
    state = "stopped" if ended.get("stopped") else "exited"
    return node_row(0, name, {**ended, "state": state}).said()


@main.command(context_settings=CONTEXT)
@click.argument("run", required=False, shell_complete=complete_run)
def down(run: str | None) -> None:
    """Stop every node of RUN (default: the newest) and verify nothing is left."""
    rd = RunDir.find(run)
    rd.started()
    backend = backends.recorded(rd)
    console = Console()
    try:
        reports = backend.stop_run(rd)
    finally:
        backend.close()
    bad = False
    for name, rep in reports.items():
        if rep.get("error"):
            bad = True
            console.info(f"[{name}] {rep['error']}")
        elif rep.get("left"):
            bad = True
            console.info(f"[{name}] still alive after SIGKILL: {rep['left']}")
        elif "state" in rep:       # a scheduler job: its state after the cancel
            console.info(f"[{name}] {rep['state']}")
        elif rep.get("ended"):     # nothing of it was running: it had ended by itself
            console.info(f"[{name}] had already ended, {_end(name, rep['ended'])}: nothing to stop")
        else:
            console.info(f"[{name}] stopped ({len(rep.get('signalled', []))} process(es) signalled"
                         f"{STOP_HOW.get(str(rep.get('how')), '')})")
    stops = {name: rep["how"] for name, rep in reports.items() if rep.get("how")}
    if stops:
        rd.update(stops={**(rd.meta().get("stops") or {}), **stops})
    if bad:
        raise ClusterError(f"run {rd.run_id}: not every node could be stopped")


