"""`cluster pull [RUN] PATH [PATH...]`: files from every node of a run, copied at once into
runs/<id>/pulled/<node>/, each PATH relative to the node's workdir.

The PATH rules are checked before anything is contacted; the copying is the recorded backend's
`pull` capability (backends/pull.py for nodes behind a transport); every node reports, and the
outcome is one exit code: 0 when every PATH came from some node, 3 when a node could not be
reached, 1 when a PATH was on no node or a copy failed. A PATH that only some nodes have is
the usual case, not a failure: rank 0 alone writes the checkpoints, on whichever node the
rendezvous made it rank 0; each node's line says what it lacked.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .console import Console, human_bytes
from .errors import ClusterError, InputError, PreflightError
from .runs import RunDir, make_private_dir, runs_root
from .texts import control_char

RUN_LIKE = re.compile(r"\d{8}-")        # how a run id begins: YYYYmmdd-HHMMSS-xxxx


def check_path(path: str) -> str:
    """A PATH below the workdir, normalised ('./ckpt//a/' -> 'ckpt/a'); InputError for an
    absolute path, a '..' that would leave the workdir, the workdir itself, a control
    character."""
    bad = control_char(path)
    if bad:
        raise InputError(f"Invalid value for PATH: control character {bad} in {path!r}")
    if path.startswith(("/", "~")):
        raise InputError(f"Invalid value for PATH: {path!r} is absolute; PATH is relative to "
                         f"each node's workdir (e.g. checkpoints/)")
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise InputError(f"Invalid value for PATH: {path!r} leaves the workdir ('..'); PATH is "
                         f"relative to each node's workdir and stays inside it")
    if not parts:
        raise InputError(f"Invalid value for PATH: {path!r} is the whole workdir; name a file "
                         f"or folder in it (e.g. checkpoints/)")
    return "/".join(parts)


def split_args(args: Sequence[str], root: Path | None = None) -> tuple[str | None, list[str]]:
    """[RUN] PATH [PATH...]: the first of two or more arguments is the RUN when it names a
    run in the runs folder (its id or the start of one) or begins as a run id does."""
    first = args[0]
    root = root or runs_root()
    named = root.is_dir() and any(p.name.startswith(first) and (p / "run.json").is_file()
                                  for p in root.iterdir())
    if len(args) < 2:
        if named and RUN_LIKE.match(first):
            raise InputError(f"Missing argument PATH: {first!r} is a run; name what to pull "
                             f"from it (cluster pull RUN PATH [PATH...])")
        return None, list(args)
    if named or RUN_LIKE.match(first):
        return first, list(args[1:])
    return None, list(args)


def pull(run: RunDir, paths: Sequence[str], backend: Any, console: Console,
         node: str | None = None) -> int:
    """Copy every PATH from every node (or `node`) of the run; print one line per node and a
    last line. Returns 0, or raises a ClusterError whose exit code says what failed."""
    meta = run.meta()
    names = [n["name"] for n in meta.get("nodes") or ()]
    if node is not None and node not in names:
        raise InputError(f"Invalid value for --node: {node!r} is not in run {run.run_id} "
                         f"({', '.join(names)})")
    fetch = getattr(backend, "pull", None)     # a capability (backends/__init__.py)
    if fetch is None:
        raise InputError(f"the {backend.name} backend cannot pull files from its nodes")
    if meta.get("dry_run"):
        raise InputError(f"run {run.run_id} was a dry run: nothing ran on its nodes (name the "
                         f"run to pull from: cluster pull RUN PATH)")
    into = run.path / "pulled"
    make_private_dir(into)
    results = fetch(run, list(paths), into, node=node)
    for name, result in results.items():
        console.info(f"[{name}] {describe(result)}")
    line, failed, nowhere = totals(results, list(paths), into)
    if not failed and not nowhere:
        console.info(line)
        return 0
    message = line + (f"; incomplete from {', '.join(failed)}" if failed else "") \
        + (f"; on no node: {', '.join(nowhere)}" if nowhere else "")
    if any(isinstance(r, PreflightError) for r in results.values()):
        raise PreflightError(message)       # a node could not be reached
    raise ClusterError(message)


def describe(result: Any) -> str:
    """One node's line: what came and where, or why not."""
    if isinstance(result, Exception):
        return f"failed: {result}"
    text = f"{result.files} file(s) ({human_bytes(result.bytes)}) into {result.into}/"
    if result.unchanged:
        text += f", {result.unchanged} already there"
    if result.missing:
        text += f"; not on this node: {', '.join(result.missing)}"
    return text


def totals(results: dict[str, Any], paths: list[str],
           into: Path) -> tuple[str, list[str], list[str]]:
    """The last line (how many nodes gave each PATH), the nodes that failed (unreached, a copy
    that failed) and the PATHs that came from no node."""
    done = [r for r in results.values() if not isinstance(r, Exception)]
    failed = sorted(n for n, r in results.items() if isinstance(r, Exception))
    gave = {p: sum(p not in r.missing for r in done) for p in paths}
    line = (f"pulled {sum(r.files for r in done)} file(s) "
            f"({human_bytes(sum(r.bytes for r in done))}) into {into}/; "
            + ", ".join(f"{p} from {n} of {len(results)} node(s)" for p, n in gave.items()))
    return line, failed, [p for p, n in gave.items() if n == 0]
