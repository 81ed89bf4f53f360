"""Where a launch's time goes, from launch to done: the phases of one `cluster up` (from its run's
events and timings) and of one bare ssh + torchrun loop, each ended by a fact on the nodes that
the job program itself stamps (STAMPS: every rank writes when its torchrun agent and it were
started, when its rendezvous was done and when it was about to exit). One wall clock: the
test nodes are network namespaces of this machine. Used by bench/launch.py."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

# The job: a gloo all_reduce's worth (init, barrier, destroy) that stamps its phases into
# DIR/<rank>.json and exits at once, so its exit is the stamp's moment (no interpreter
# teardown between the two, the same for both launchers).
STAMPS = """\
import json, os, sys, time
def started(pid):
    # the wall time pid started, from /proc (10 ms): its starttime against the uptime
    with open("/proc/%d/stat" % pid) as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        up = float(f.read().split()[0])
    return time.time() - up + ticks / os.sysconf("SC_CLK_TCK")
stamps = {"agent": started(os.getppid()), "worker": started(os.getpid())}
import torch.distributed as dist
dist.init_process_group("gloo")
stamps["joined"] = time.time()
dist.barrier()  # no rank may leave while another is still connecting its mesh
dist.destroy_process_group()
stamps["exit"] = time.time()
with open(os.path.join(sys.argv[1], os.environ["RANK"] + ".json"), "w") as f:
    json.dump(stamps, f)
os._exit(0)
"""

# (name, what it is), in order; each ends where the next begins.
PHASES = (
    ("imports", "the launcher's own start: python, its imports, the inventory, the plan"),
    ("logins+checks", "every login and every node's check (cluster) or ssh's login (bare)"),
    ("start", "the scripts onto the nodes, the supervisor, launch.sh: until every agent runs"),
    ("spawn", "torchrun's import, its rendezvous of agents, the workers' spawn"),
    ("rendezvous", "the workers' import of torch and init_process_group"),
    ("job", "the job itself (a barrier), until the last worker's exit"),
    ("end", "from the last worker's exit to the launcher's exit (the prompt back)"),
)


def of_stamps(folder: Path) -> dict[str, float]:
    """The nodes' facts, the latest rank's of each: every agent started, every worker started,
    every rendezvous done, the last worker's exit."""
    got = [json.loads(p.read_text()) for p in folder.glob("*.json")]
    if not got:
        raise SystemExit(f"no rank stamped its phases into {folder}")
    return {k: max(g[k] for g in got) for k in ("agent", "worker", "joined", "exit")}


def of_run(run_dir: Path) -> dict[str, float]:
    """The launcher's own moments (wall clock) from its events: the checks began and ended."""
    found: dict[str, float] = {}
    for line in (run_dir / "events.jsonl").read_text().splitlines():
        ev = json.loads(line)
        if ev.get("attempt") == 0 and ev["kind"] in ("launch", "check", "checked"):
            found.setdefault(ev["kind"], ev["t"])
    return found


def cluster_phases(t0: float, t_end: float, run_dir: Path, stamps: dict[str, float]) -> dict[str, float]:
    """Seconds in each phase of one `cluster up`, t0/t_end: its Popen and its exit."""
    ev = of_run(run_dir)
    return _split(t0, [ev["check"], ev["checked"], stamps["agent"], stamps["worker"],
                       stamps["joined"], stamps["exit"], t_end])


def bare_phases(t0: float, t_end: float, stamps: dict[str, float]) -> dict[str, float]:
    """The same for the bare loop: no launcher of its own (imports 0), ssh's login and the
    remote shell until torchrun's python runs (logins+checks), nothing to ship (start 0)."""
    return _split(t0, [t0, stamps["agent"], stamps["agent"], stamps["worker"], stamps["joined"],
                       stamps["exit"], t_end])


def _split(t0: float, ends: list[float]) -> dict[str, float]:
    out, last = {}, t0
    for (name, _), end in zip(PHASES, ends):
        out[name] = end - last
        last = end
    out["total"] = ends[-1] - t0
    out["to agents"] = ends[2] - t0            # the start: launch until every agent runs
    return out


def table(rows: dict[str, list[dict[str, float]]]) -> str:
    """A Markdown table: each phase's median seconds per launcher (columns), from repeats."""
    names = list(rows)
    keys = [n for n, _ in PHASES] + ["to agents", "total"]
    lines = ["| phase | " + " | ".join(names) + " |", "| --- |" + " ---: |" * len(names)]
    for key in keys:
        cells = [f"{statistics.median(r[key] for r in rows[n]):.2f}" for n in names]
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
