"""`cluster top [RUN]`: one row per node, refreshed: state, uptime, GPUs, the trainer's step,
the node's step rate."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import click

from .. import resolve
from ..backends import EXEC, supports
from .main import CONTEXT, complete_run, main
from ..runs import RunDir

if TYPE_CHECKING:
    from rich.table import Table


@main.command(context_settings=CONTEXT)
@click.argument("run", required=False, shell_complete=complete_run)
@click.option("--interval", type=click.FloatRange(min=0.5), default=2.0, show_default=True,
              metavar="SECONDS", help="Time between refreshes.")
@click.option("--once", is_flag=True, help="Print one table and exit (for scripts).")
def top(run: str | None, interval: float, once: bool) -> None:
    """Each node of RUN (default: the newest), refreshed until the run ends or Ctrl-C: state,
    uptime, GPU utilisation and memory per GPU, the reference trainer's step, loss, images/s,
    and each node's steps/s and own work per step (its slowest rank's)."""
    from rich.console import Console as RichConsole
    from rich.live import Live
    from ..observe import top as tp
    rd = RunDir.find(run)
    name = rd.meta()["backend"]
    backend = resolve.recorded_backend(rd)
    collect = tp.collect if supports(name, EXEC) else tp.collect_slurm

    def table() -> tuple[list[tp.Row], Table]:
        rows = collect(rd, backend)
        return rows, tp.render(rows, tp.title(rd.run_id, name))
    out = RichConsole()
    try:
        rows, shown = table()
        tp.fit(out, shown)
        if once or tp.ended(rows):
            out.print(shown)
            return
        with Live(shown, console=out, auto_refresh=False) as live:
            while not tp.ended(rows):
                time.sleep(interval)
                rows, shown = table()
                tp.fit(out, shown)
                live.update(shown, refresh=True)
        out.print(f"run {rd.run_id} has ended", highlight=False)
    except KeyboardInterrupt:
        return               # leaving top is what Ctrl-C is for here: exit 0
    finally:
        backend.close()
