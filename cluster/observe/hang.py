"""The hang watchdog's evidence, read: where each rank was when no rank made progress.

Stacks come from py-spy (`Thread 0x.. (active): "MainThread"`, then `func (file:line)` lines)
or from Python's faulthandler (`Current thread 0x.. (most recent call first):`, then
`File "file", line N in func` lines). Pure functions: text in, a summary out.
"""
from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hostlist

from ..runs import make_private_dir, write_private

FAULTHANDLER_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+) in (\S+)')
PY_SPY_FRAME = re.compile(r"^\s+(\S+) \(([^:()]+):(\d+)\)")
# Frames of these are where a rank waits, not where the program is: look past them for the
# caller that the user wrote.
LIBRARY = re.compile(r"/(site-packages|dist-packages|lib/python3\.\d+)/|^<frozen ")


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    func: str

    @property
    def short(self) -> str:
        return f"{Path(self.file).name}:{self.line}"


def main_thread(text: str) -> list[Frame]:
    """The frames of the thread that matters, innermost first: faulthandler's current
    thread (the one the signal reached: the main thread), or py-spy's MainThread."""
    blocks: list[tuple[str, list[Frame]]] = []
    for line in text.splitlines():
        if line.startswith(("Current thread", "Thread ")):
            blocks.append((line, []))
            continue
        m = FAULTHANDLER_FRAME.match(line)
        if m and blocks:
            blocks[-1][1].append(Frame(m.group(1), int(m.group(2)), m.group(3)))
            continue
        m = PY_SPY_FRAME.match(line)
        if m and blocks:
            blocks[-1][1].append(Frame(m.group(2), int(m.group(3)), m.group(1)))
    for head, frames in blocks:
        if head.startswith("Current thread") or '"MainThread"' in head:
            return frames
    return blocks[0][1] if blocks else []


def where(frames: Sequence[Frame]) -> str:
    """'all_reduce in train.py:212': the innermost call, and the user's line that made it."""
    if not frames:
        return "no Python stack (the process had exited, or no dump came back)"
    inner = frames[0]
    user = next((f for f in frames if not LIBRARY.search(f.file)), None)
    if user is None or user == inner:
        return f"{inner.func} in {inner.short}"
    return f"{inner.func} in {user.short} ({user.func})"


@dataclass(frozen=True)
class Group:
    where: str
    ranks: tuple[int, ...]
    nodes: tuple[str, ...]

    def text(self) -> str:
        ranks = _ranges(self.ranks)
        label = f"rank {ranks}" if len(self.ranks) == 1 else f"ranks {ranks}"
        return f"{label} ({hostlist.collect_hostlist(list(self.nodes))}): {self.where}"


def groups(stacks: Mapping[str, Sequence[Mapping[str, Any]]]) -> list[Group]:
    """Ranks grouped by where they are, the largest group first."""
    by_where: dict[str, list[tuple[int, str]]] = {}
    for label, records in stacks.items():
        node = label.rsplit(" ", 1)[0]
        for rec in records:
            by_where.setdefault(where(main_thread(rec.get("text", ""))), []).append((rec["rank"], node))
    out = [Group(w, tuple(sorted(r for r, _ in members)),
                 tuple(dict.fromkeys(n for _, n in sorted(members))))
           for w, members in by_where.items()]
    return sorted(out, key=lambda g: (-len(g.ranks), g.ranks))


def summary(stacks: Mapping[str, Sequence[Mapping[str, Any]]]) -> list[str]:
    """One line per group; the groups smaller than the largest are the odd ones."""
    found = groups(stacks)
    if not found:
        return ["no stacks came back from any node"]
    lines = [g.text() for g in found]
    if len(found) > 1:
        odd = [g for g in found[1:]]
        lines.append("odd one(s) out: " + "; ".join(g.text() for g in odd))
    return lines


def odd_node(stacks: Mapping[str, Sequence[Mapping[str, Any]]]) -> tuple[str, str] | None:
    """(node, where its ranks are) when every rank elsewhere than the largest group is on that
    one node: the hang's odd one out, which the node ledger holds against it."""
    found = groups(stacks)
    odd = found[1:]
    nodes = {n for g in odd for n in g.nodes}
    if len(nodes) != 1:
        return None
    return nodes.pop(), "; ".join(g.text() for g in odd)


def _ranges(ranks: Sequence[int]) -> str:
    """0,1,2,5 -> '0-2,5'."""
    runs: list[list[int]] = []          # [first, last] of each run of consecutive ranks
    for r in sorted(ranks):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ",".join(f"{first}" if first == last else f"{first}-{last}" for first, last in runs)


def last_lines(tails: dict[str, list[str]]) -> str:
    """What each node printed last before the watchdog fired, a section per node."""
    return "\n".join(f"== {label}: its last {len(lines)} line(s)\n" + "".join(f"{t}\n" for t in lines)
                     for label, lines in sorted(tails.items()))


def save(run: Any, hang: Any, console: Any) -> None:
    """The evidence under runs/<id>/hang/ (private): one file per rank, each node's last log
    lines, and the summary, which is printed too."""

    folder = run.path / "hang"
    make_private_dir(folder)
    for label, records in hang.stacks.items():
        node = label.rsplit(" ", 1)[0]
        for rec in records:
            write_private(folder / f"{node}-rank{rec['rank']}.txt",
                          f"# {rec.get('how')} stack of rank {rec['rank']} (pid {rec.get('pid')}) "
                          f"on {node}\n{rec.get('text', '')}")
    write_private(folder / "last-lines.txt", last_lines(getattr(hang, "last_lines", {}) or {}))
    lines = summary(hang.stacks)
    write_private(folder / "summary.txt", "\n".join(lines) + "\n")
    console.info(f"where every rank was after {hang.seconds:.0f} s without progress "
                 f"(stacks in {folder}/):")
    for line in lines:
        console.info(f"  {line}")
