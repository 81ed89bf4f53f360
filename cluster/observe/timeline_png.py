"""A run's timeline, written: runs/<id>/timeline.json always (cluster.observe.timeline), and the picture
runs/<id>/timeline.png when matplotlib is importable (it comes with the trainer extra, not with
cluster itself: imported here, lazily, and only here).

One lane per node: the check, the start, the join, its first output and beats (with the step
rate), its exit; the first failure, the stop, a hang's stalled stretch; each attempt a band.
Below the lanes, the goodput band: where the wall time went (cluster.observe.goodput's parts).
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from . import goodput
from . import timeline as tl
from ..console import Console
from ..errors import InputError
from ..runs import RunDir

INSTALL_HINT = "pip install 'cluster[train]'"

# Colours: a quiet palette, the failure red.
GREY, BLUE, GREEN, RED, ORANGE, PURPLE = "#b0b0b0", "#9ecae1", "#74c476", "#d62728", "#fd8d3c", "#9467bd"
STALLED = "#f6c5c5"               # a hang: running, but no progress
BANDS = ("#f7f7f7", "#e8eef7")


def write(run: RunDir, console: Console) -> Path:
    """Write timeline.json, draw timeline.png if it can, say which it wrote; the path of what
    it wrote (the picture, else the JSON)."""
    try:
        meta = run.meta()
    except InputError:          # a damaged record: the timeline is drawn from the events alone
        meta = {}
    facts = goodput.Facts()                 # taken in the same read of the events
    data = tl.timeline(_told(tl.read_events(run.path / tl.EVENTS), facts.add), meta)
    data["goodput"] = facts.result()
    json_path = tl.write_json(run.path, data)
    for note in data["notes"]:
        console.info(f"timeline: {note}")
    try:
        import matplotlib  # noqa: F401  (only: is it there)
    except ImportError:
        console.info(f"timeline: no picture, matplotlib is not installed ({INSTALL_HINT}); "
                     f"its events are in {json_path}")
        return json_path
    png = run.path / tl.PNG_NAME
    draw(data, png)
    console.info(f"timeline: {png}")
    return png


# The background drawing's own bound: it ends by itself, drawn or not, within this many seconds.
DRAW_LIMIT = 300


def write_later(run: RunDir, console: Console) -> None:
    """The end of an attached run: write() in a process of its own, at a low priority, so that
    nobody waits for matplotlib's import and the render (0.4 s). It is its own owner: it
    ends when drawn, and by its own alarm after DRAW_LIMIT s in any case. Says the path it
    writes, and how to draw it now."""
    has_png = importlib.util.find_spec("matplotlib") is not None
    name = tl.PNG_NAME if has_png else tl.JSON_NAME
    package = str(Path(__file__).resolve().parents[2])    # where `cluster` is imported from
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (package, os.environ.get("PYTHONPATH")) if p))
    try:
        subprocess.Popen([sys.executable, "-m", __name__, str(run.path)], env=env,
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True)
    except OSError as exc:
        console.info(f"timeline not drawn: {exc}")
        return
    console.info(f"timeline: {run.path / name} (drawn in the background; `cluster status {run.run_id} "
                 f"--timeline` draws it now)")
    if not has_png:
        console.info(f"timeline: no picture, matplotlib is not installed ({INSTALL_HINT})")


def _background(run_dir: str) -> int:
    """`python -m cluster.observe.timeline_png RUN_DIR`: write_later's process."""
    import signal
    signal.alarm(DRAW_LIMIT)
    try:
        os.nice(10)
    except OSError:
        pass
    with open(os.devnull, "w") as null:
        write(RunDir(Path(run_dir)), Console(out=null, err=null))
    return 0


def _told(events: Iterable[tl.Event], listener: Callable[[tl.Event], None]) -> Iterator[tl.Event]:
    for ev in events:
        listener(ev)
        yield ev


def draw(data: dict[str, Any], path: Path) -> None:
    """The picture of timeline() data, written privately to `path` (PNG)."""
    # A Figure of its own, never pyplot: a program of the Python API keeps its own backend
    # and figures (a notebook's), and no display is needed.
    from matplotlib.figure import Figure

    lanes = list(data["lanes"])
    end = max(data["end"], 1.0)
    # 0.45 in a lane, less past 30 nodes: the picture stays under about 17 in (1,500 px) tall
    lane = min(0.45, 14 / max(1, len(lanes)))
    gp = data.get("goodput")
    rows = len(lanes) + (1 if gp else 0)
    height = 2.6 + lane * max(1, rows)
    fig = Figure(figsize=(10, height), dpi=90)
    ax = fig.subplots()
    _bands(ax, data, end)
    for y, node in enumerate(lanes):
        _lane(ax, y, node, data["lanes"][node], data, end, lane / 0.45)
    _job(ax, data, len(lanes))
    every = max(1, round(0.15 / lane))          # a name every `every` lanes when they are thin
    ticks, names = list(range(0, len(lanes), every)), lanes[::every]
    if gp:
        _goodput_band(ax, len(lanes), gp)
        ticks, names = ticks + [len(lanes)], names + [_goodput_name(gp)]
    ax.set_yticks(ticks, names, fontsize=min(10, 72 * lane * every * 0.6))
    ax.set_ylim(rows - 0.4, -0.9)
    ax.set_xlim(-0.01 * end, end * 1.04)
    ax.set_xlabel("seconds since the launch began" + _clock(data))
    ax.set_title(_title(data), fontsize=10, loc="left")
    handles = _legend() + (_goodput_legend(gp) if gp else [])
    fig.legend(handles=handles, loc="lower center", ncol=6, fontsize=7, frameon=False)
    rows_below = -(-len(handles) // 6)
    fig.tight_layout(rect=(0, (0.1 + 0.14 * rows_below) / height, 1, 1))   # the legend's room
    _save(fig, path)


def _save(fig: Any, path: Path) -> None:
    """Written privately (0600), replacing the last picture at once."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        fig.savefig(f, format="png")
    tmp.replace(path)


def _title(data: dict[str, Any]) -> str:
    """How the run ended, with the worker's own error when one failed."""
    ended = [a["ended"] for a in data["attempts"] if a["ended"]]
    last = ended[-1] if ended else "no end recorded"
    final = data["attempts"][-1]["attempt"] if data["attempts"] else 0
    what = next((i.get("what") for lane in data["lanes"].values() for i in lane
                 if i["kind"] == tl.FAILED and i.get("attempt", 0) == final), None)
    tries = f" in attempt {len(data['attempts'])}" if len(data["attempts"]) > 1 else ""
    return f"run {data.get('run_id') or '?'}: {_short(last + tries + (f' ({what})' if what else ''), 110)}"


def _clock(data: dict[str, Any]) -> str:
    import time
    start = data.get("start")
    return f" at {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(start))}" if start else ""


def _short(text: str, n: int) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[: n - 1] + "…"


def _bands(ax: Any, data: dict[str, Any], end: float) -> None:
    """Each attempt a band behind the lanes, named at the top; each check a grey bar."""
    several = len(data["attempts"]) > 1
    for i, a in enumerate(data["attempts"]):
        nxt = data["attempts"][i + 1]["start"] if i + 1 < len(data["attempts"]) else end * 1.04
        ax.axvspan(a["start"], nxt, color=BANDS[i % 2], zorder=0)
        if several:
            ax.text(a["start"], -0.75, f" attempt {a['attempt'] + 1}", fontsize=8, va="center",
                    color="#555555")
    for c in data["checks"]:
        ax.axvspan(c["start"], c["end"], ymin=0.0, ymax=1.0, color=GREY, alpha=0.35, zorder=1,
                   hatch=None if c["ok"] is not False else "//")


def _lane(ax: Any, y: int, node: str, items: list[dict[str, Any]], data: dict[str, Any],
          end: float, size: float) -> None:
    """One node: a bar from its start to its exit: blue until its workers joined (or beat,
    which they do only after), green while they ran, then red from its failure (the node that
    failed first) or orange from the stop (the others) to its exit. Its marks, `size` times
    their size in a full-height lane. No bar in an attempt that did not start it (a node set
    aside, or under another label there: a spare's place, a grown job's new ranks)."""
    for attempt in sorted({a["attempt"] for a in data["attempts"]}):
        mine = [i for i in items if i.get("attempt", 0) == attempt]
        start = _job_x(data, tl.STARTED, attempt) or _job_x(data, tl.START, attempt)
        if start is None or not (mine or _started(data, node, attempt)):
            continue
        ex = next((i for i in mine if i["kind"] == tl.EXIT), None)
        stop = _attempt_end(data, attempt, end) if ex is None else ex["x"]
        ran = [i["x"] for i in mine if i["kind"] in (tl.JOINED, tl.BEAT)]
        joined = min(ran) if ran else stop
        failed = next((i["x"] for i in mine if i["kind"] == tl.FAILED), None)
        ended = ex is not None and not ex.get("ok")
        stall = next((s["at"] for s in data["stalled"] if s["attempt"] == attempt), None) if ended else None
        stopped = _job_x(data, tl.STOP, attempt) if ended else None
        cut = min(x for x in (failed, stall, stopped, stop) if x is not None)
        _bar(ax, y, start, joined, BLUE)
        _bar(ax, y, joined, cut, GREEN)
        if stall is not None:
            _bar(ax, y, stall, stopped or stop, STALLED, hatch="xx")
            cut = stopped or stop
        _bar(ax, y, cut, stop, RED if failed is not None else ORANGE)
        _marks(ax, y, mine, ex, size)


def _bar(ax: Any, y: int, start: float, end: float, colour: str, hatch: str | None = None) -> None:
    if end > start:
        ax.broken_barh([(start, end - start)], (y - 0.18, 0.36), facecolor=colour,
                       edgecolor=RED if hatch else colour, hatch=hatch, lw=0, zorder=2)


def _marks(ax: Any, y: int, mine: list[dict[str, Any]], ex: dict[str, Any] | None,
           size: float) -> None:
    words = size > 0.6                       # a lane too thin for words: the marks only
    beats = [i for i in mine if i["kind"] == tl.BEAT]
    if beats:
        ax.plot([b["x"] for b in beats], [y] * len(beats), "|", color="black", ms=7 * size, zorder=3)
        rate = _rate(beats)
        if rate and words:
            ax.text(beats[0]["x"], y + 0.24, f" {rate}", fontsize=7, va="top")
    first_out = next((i for i in mine if i["kind"] == tl.OUTPUT), None)
    if first_out:
        ax.plot(first_out["x"], y, "o", mfc="white", mec="black", ms=5 * size, zorder=4)
    joined = next((i for i in mine if i["kind"] == tl.JOINED), None)
    if joined:
        ax.plot(joined["x"], y, ">", color="#2c7a2c", ms=7 * size, zorder=4)
    for slow in (i for i in mine if i["kind"] == tl.SLOW):
        ax.plot(slow["x"], y, "v", color=PURPLE, ms=8 * size, zorder=5)
    failed = next((i for i in mine if i["kind"] == tl.FAILED), None)
    if failed:
        ax.plot(failed["x"], y, "X", color=RED, mec="black", ms=max(6.0, 10 * size), zorder=5)
        if words:
            ax.text(failed["x"], y - 0.26, _short(failed.get("what", "failed"), 60) + " ",
                    fontsize=7, color=RED, ha="right", va="bottom")
    if ex is not None:
        ax.plot(ex["x"], y, "s", color="black" if ex.get("ok") else RED, ms=5 * size, zorder=4)


def _rate(beats: list[dict[str, Any]]) -> str:
    """The mean interval between beats, the first recorded one to the last (each carries how
    many beats it stands for). A node reports a heartbeat at most once a second: a faster
    step rate reads as 'a beat every 1.0 s'."""
    if len(beats) < 2:
        return ""
    span = beats[-1]["x"] - beats[0]["x"]
    count = sum(b.get("n", 1) for b in beats[1:])
    if span <= 0:
        return ""
    return f"a beat every {span / count:.1f} s"


def _started(data: dict[str, Any], node: str, attempt: int) -> bool:
    """Whether the attempt's start named this lane (a start that names none: every lane)."""
    named = next((j.get("nodes") for j in data["job"]
                  if j["kind"] == tl.STARTED and j.get("attempt", 0) == attempt), None)
    return not named or node in named


def _job_x(data: dict[str, Any], kind: str, attempt: int) -> float | None:
    return next((j["x"] for j in data["job"] if j["kind"] == kind and j.get("attempt", 0) == attempt), None)


def _attempt_end(data: dict[str, Any], attempt: int, end: float) -> float:
    return next((a["end"] for a in data["attempts"] if a["attempt"] == attempt), end)


def _job(ax: Any, data: dict[str, Any], lanes: int) -> None:
    """The whole job's moments across every lane: the stop, a hang's stalled stretch, a
    restart, a detach."""
    grown = {j.get("attempt", 0) for j in data["job"] if j["kind"] == tl.RESTART and j.get("planned")}
    for j in data["job"]:
        if j["kind"] == tl.STOP:
            ax.axvline(j["x"], color=RED, ls="--", lw=1, zorder=3)
            # A planned stop: the job restarts at full size from this checkpoint (--grow).
            said = " stop to grow" if j.get("attempt", 0) in grown else " stop"
            ax.text(j["x"], -0.5, said, color=RED, fontsize=7, va="center")
        elif j["kind"] == tl.RESTART:
            ax.axvline(j["x"], color="#555555", ls=":", lw=1, zorder=3)
        elif j["kind"] == tl.DETACHED:
            ax.axvline(j["x"], color="#555555", ls=":", lw=1, zorder=3)
            ax.text(j["x"], -0.5, " detached: nothing recorded after", fontsize=7, color="#555555")
    for s in data["stalled"]:
        ax.axvspan(s["at"], s["hang"], color=RED, alpha=0.06, zorder=1)
        ax.axvline(s["at"], color=RED, lw=1.5, zorder=3)
        ax.text(s["at"], -0.5, " progress stopped here", color=RED, fontsize=8, va="center")


def _legend() -> list[Any]:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    return [Patch(color=GREY, alpha=0.5, label="check"), Patch(color=BLUE, label="starting"),
            Patch(color=GREEN, label="running"), Patch(color=RED, label="failed first"),
            Patch(color=ORANGE, label="stopped"),
            Patch(facecolor=STALLED, edgecolor=RED, hatch="xx", lw=0, label="no progress"),
            Line2D([], [], marker=">", color="#2c7a2c", ls="", label="joined"),
            Line2D([], [], marker="o", mfc="white", mec="black", ls="", label="first output"),
            Line2D([], [], marker="|", color="black", ls="", label="heartbeat"),
            Line2D([], [], marker="X", color=RED, ls="", label="first failure"),
            Line2D([], [], marker="s", color="black", ls="", label="exit"),
            Line2D([], [], color=RED, ls="--", label="stop"),
            Line2D([], [], marker="v", color=PURPLE, ls="", label="slow node")]


# The goodput band's colours, a part each: training green as the lanes' running.
PART_COLOURS = {"training": GREEN, "startup": BLUE, "rendezvous": "#c6dbef",
                "checkpoint": "#fdd0a2", "restart": ORANGE, "redone": "#fb6a4a",
                "detection": STALLED, "slow": PURPLE, "ending": GREY}


def _goodput_band(ax: Any, y: int, gp: dict[str, Any]) -> None:
    """One row below the lanes: each stretch of the wall time in its part's colour; the
    training after a slow node was named hatched (only its pace's excess is the cost)."""
    for x0, x1, part in gp.get("segments") or []:
        slow = part == "slow"
        ax.broken_barh([(x0, x1 - x0)], (y - 0.3, 0.6),
                       facecolor=PART_COLOURS["training" if slow else part],
                       edgecolor=PURPLE if slow else "none", hatch="//" if slow else None,
                       lw=0, zorder=2)


def _goodput_name(gp: dict[str, Any]) -> str:
    frac = gp.get("fraction")
    return f"goodput {frac * 100:.0f}%" if frac is not None else "goodput"


def _goodput_legend(gp: dict[str, Any]) -> list[Any]:
    """The parts the band shows, with their seconds."""
    from matplotlib.patches import Patch
    shown = {part for _, _, part in gp.get("segments") or []}
    return [Patch(facecolor=PART_COLOURS["training" if p == "slow" else p],
                  edgecolor=PURPLE if p == "slow" else "none", hatch="//" if p == "slow" else None,
                  lw=0, label=_part_label(p, gp["parts"][p]))
            for p in goodput.PARTS if p in shown or p == "training"]


def _part_label(part: str, seconds: float) -> str:
    if part == "slow":
        return f"after a slow node: its cost {seconds:.1f} s"
    return f"{goodput.NAMES[part]} {seconds:.1f} s"


if __name__ == "__main__":
    sys.exit(_background(sys.argv[1]))
