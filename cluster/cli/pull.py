"""`cluster pull [RUN] PATH [PATH...]`: files from every node of a run into runs/<id>/pulled/."""
from __future__ import annotations

from typing import TYPE_CHECKING

import click

from .. import resolve
from ..console import Console
from ..pull import check_path, pull as pull_files, split_args
from ..runs import RunDir
from .main import CONTEXT, complete_run, main

if TYPE_CHECKING:
    from click.shell_completion import CompletionItem


def _complete(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[CompletionItem]:
    """The first argument may be a RUN: run ids complete there."""
    return [] if ctx.params.get("args") else complete_run(ctx, param, incomplete)


@main.command(context_settings=CONTEXT)
@click.argument("args", nargs=-1, required=True, metavar="[RUN] PATH [PATH...]",
                shell_complete=_complete)
@click.option("--node", help="Only this node (by name).")
def pull(args: tuple[str, ...], node: str | None) -> None:
    """Copy PATH (a file or folder, relative to each node's workdir) from every node of RUN
    (default: the newest) into runs/<id>/pulled/<node>/."""
    run, paths = split_args(args)
    paths = [check_path(p) for p in paths]        # before anything is read or contacted
    rd = RunDir.find(run)
    backend = resolve.recorded_backend(rd)
    try:
        pull_files(rd, paths, backend, Console(), node=node)
    finally:
        backend.close()
