#!/usr/bin/env python3
"""A lost node replaced by the spare: from the failure to the first training step of the next
attempt at full world size, split into its parts, on fake nodes (one sshd per network
namespace: tests/integration/fixtures).

    sudo /opt/cluster-venv/bin/python bench/failover.py       # 3 repeats: 60 s, 2 s, 2 s + 1 s
    sudo /opt/cluster-venv/bin/python bench/failover.py --repeats 1 --keepalive 2 --stop-timeout ""

Needs root, iproute2, openssh and the test venv (tests/run makes it). Four nodes: `cluster up
--nodes 3 --max-restarts 1` runs the reference trainer (train/train.py, CPU, digits, checkpoint
every --ckpt-every steps, a line a step) on node1-3 while node4 waits as the spare. Once
training has passed its first checkpoint, node3's link is cut (its veth down; the time of the
cut on this benchmark's clock), and the benchmark waits for the first step of the next
attempt, then stops the run (Ctrl-C), restores the link and checks that nothing is left on
node3. The time from the cut to that step, in parts:

  detection   the cut -> the launcher's first failure event (node3 lost)
  stop        -> the attempt's end (the other nodes' trainers stopped: SIGTERM, a checkpoint)
  set-aside   -> the next attempt's start (node3 set aside, node4 in, the check of every node)
  start       start -> started (the start sent to each node's staged process)
  rendezvous  started -> the trainer's first heartbeat on the last node: torchrun up, its
              rendezvous, the workers up (torch imported) and through init_process_group
  setup+load  -> rank 0's "resumed from" line (the trainer's data and model set up, the
              checkpoint picked by rank 0, broadcast and loaded)
  first step  -> rank 0's line of its first step after the resume

The launcher's events (runs/<id>/events.jsonl) carry its monotonic clock (`m`), which is the
machine's, as this benchmark's is: the cut and the trainer's lines (stamped here as the
launcher relays them, milliseconds after they are printed) are on the same clock. The first
step is the trainer's own line, not a heartbeat: the trainer beats once as it starts, before
its set-up, and the timeline keeps a node's beats at most one each 5 s. That first beat
ends the rendezvous instead of the `joined` event: a node looks for its joined workers on a
backoff up to 2 s apart, its heartbeat file every 0.25 s.

The same parts of the first attempt (its check -> its first step, no checkpoint to load) are
the cold start it is compared with, in the same run; their setup parts' difference is what
the checkpoint's load adds (also timed alone: torch.load of the checkpoint file here).
Each keepalive (--keepalive, seconds of silence before a node counts as lost; 60 s by
default) is measured --repeats times, A B A B; so is the shortest keepalive with the
trainer's --stop-timeout at each of --stop-timeout (its default: 10 s, the wait for a step
boundary that a rank blocked in a collective with the lost node never reaches). The table
gives median [min-max] per part, and whether everything after the detection, less the
checkpoint's load, is under the goal (5 s).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GOAL = 5.0              # seconds after the detection, the checkpoint's load aside (the issue)
CUT = 3                 # the node whose link is cut
STEP = re.compile(r"^\[node1 0\] epoch \d+ step (\d+) loss ")
PARTS = ("detection", "stop", "set-aside", "start", "rendezvous", "setup+load", "first step")
COLD = ("check", "start", "rendezvous", "setup", "first step")


class Launcher:
    """`cluster up` running, each line of its output stamped with this machine's monotonic
    clock as it arrives."""

    def __init__(self, argv: list[str], cwd: Path, env: dict[str, str]) -> None:
        self.popen = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      start_new_session=True)
        self.lines: list[tuple[float, str]] = []
        self.cond = threading.Condition()
        self.pumps = [threading.Thread(target=self._pump, args=(s,), daemon=True)
                      for s in (self.popen.stdout, self.popen.stderr)]
        for t in self.pumps:
            t.start()

    def _pump(self, stream) -> None:
        for line in stream:
            with self.cond:
                self.lines.append((time.monotonic(), line.rstrip("\n")))
                self.cond.notify_all()
        with self.cond:
            self.cond.notify_all()

    def first(self, pred, since: float = 0.0, timeout: float = 300.0) -> tuple[float, str]:
        """The first line after `since` for which pred(line) holds: (its time, the line)."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                for m, line in self.lines:
                    if m >= since and pred(line):
                        return m, line
                done = self.popen.poll() is not None and not any(t.is_alive() for t in self.pumps)
                if done or time.monotonic() > deadline:
                    tail = "\n".join(line for _, line in self.lines[-40:])
                    raise SystemExit(f"not seen ({'exited' if done else 'timed out'}):\n{tail}")
                self.cond.wait(0.2)

    def stop(self, timeout: float = 180.0) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGINT)
        code = self.popen.wait(timeout)
        for t in self.pumps:
            t.join(5)
        return code

    def run_id(self) -> str:
        for _, line in self.lines:
            if m := re.search(r"run (\d{8}-\d{6}-[0-9a-f]{4})", line):
                return m.group(1)
        raise SystemExit("no run id in the launcher's output")


def step_of(line: str) -> int | None:
    m = STEP.match(line)
    return int(m.group(1)) if m else None


def events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()
            if line.strip()]


def at(evs: list[dict], kind: str, attempt: int, after: float = 0.0) -> float:
    """The launcher's clock at the first event of that kind in that attempt."""
    got = [e["m"] for e in evs if e["kind"] == kind and e.get("attempt") == attempt
           and e["m"] >= after]
    if not got:
        raise SystemExit(f"no {kind} event in attempt {attempt}: {[e['kind'] for e in evs]}")
    return min(got)


def every_node(evs: list[dict], kind: str, attempt: int) -> float:
    """The launcher's clock when the last node had its first event of that kind."""
    first: dict[str, float] = {}
    for e in evs:
        if e["kind"] == kind and e.get("attempt") == attempt:
            first[e["node"]] = min(e["m"], first.get(e["node"], e["m"]))
    if len(first) < 3:
        raise SystemExit(f"{kind} from {sorted(first)} only, attempt {attempt}")
    return max(first.values())


def split(evs: list[dict], cut: float, resumed: float, step: float) -> dict[str, float]:
    """The failover's parts, in seconds (pure: the events and this clock's times in)."""
    marks = [cut, at(evs, "failed", 0, after=cut), at(evs, "ended", 0), at(evs, "start", 1),
             at(evs, "started", 1), every_node(evs, "beat", 1), resumed, step]
    return {name: b - a for name, a, b in zip(PARTS, marks, marks[1:])}


def cold(evs: list[dict], announced: float, step: float) -> dict[str, float]:
    """The first attempt's start in the same parts: its check -> its first step."""
    marks = [at(evs, "check", 0), at(evs, "start", 0), at(evs, "started", 0),
             every_node(evs, "beat", 0), announced, step]
    return {name: b - a for name, a, b in zip(COLD, marks, marks[1:])}


def torch_load(path: Path) -> tuple[float, int]:
    """Seconds to load the checkpoint here (median of 5, after one to warm the cache), bytes."""
    import torch
    times = []
    for _ in range(6):
        t0 = time.perf_counter()
        torch.load(path, map_location="cpu", weights_only=False)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]), path.stat().st_size


class Failover:
    def __init__(self, sn, tmp: Path, ckpt_every: int) -> None:
        self.sn, self.tmp, self.ckpt_every = sn, tmp, ckpt_every
        self.work = tmp / "work"
        self.work.mkdir(parents=True)
        tmp.chmod(0o755)

    def home(self, name: str) -> Path:
        """A fresh HOME each repeat: its own node ledger, where node3's lost connection of the
        repeat before would count against it (two make a quarantine)."""
        home = self.tmp / name
        (home / ".ssh").mkdir(parents=True, mode=0o700)
        shutil.copy(self.sn.known_hosts_path, home / ".ssh" / "known_hosts")
        return home

    def once(self, config: Config, k: int) -> dict:
        keepalive, stop_timeout = config
        home = self.home(f"home-{label(config)}-{k}".replace(" ", ""))
        inv = Path(self.sn.write_inventory(home / "inv.yaml"))
        inv.write_text(inv.read_text() + f"ssh: {{keepalive: {keepalive:g}}}\n")
        env = dict(os.environ, HOME=str(home), NO_COLOR="1", COLUMNS="200", PYTHONUNBUFFERED="1",
                   PYTHONPATH=str(ROOT))
        env.pop("SSH_AUTH_SOCK", None)
        ckpt = f"ckpt-{home.name}"          # each repeat trains anew
        argv = [sys.executable, "-m", "cluster", "up", "-i", str(inv), "--nodes", "3",
                "--max-restarts", "1", "--", "cluster-train/train.py", "--epochs", "100",
                "--ckpt-every", str(self.ckpt_every), "--log-every", "1", "--no-plot",
                "--out", f"out-{home.name}", "--checkpoint-dir", ckpt,
                *(["--stop-timeout", f"{stop_timeout:g}"] if stop_timeout is not None else [])]
        launcher = Launcher(argv, self.work, env)
        try:
            return self.measure(launcher, ckpt)
        finally:
            code = launcher.stop()
            self.sn.network.set_link(CUT, up=True)
            self.clean(launcher, code, keepalive)

    def measure(self, launcher: Launcher, ckpt: str) -> dict:
        launcher.first(lambda s: "spares: node4 wait" in s, timeout=120)
        announced, _ = launcher.first(lambda s: s.startswith("[node1 0] world_size="))
        first, _ = launcher.first(lambda s: step_of(s) is not None, since=announced)
        # a checkpoint exists (written at ckpt_every) and steps are being made after it
        launcher.first(lambda s: (step_of(s) or 0) >= self.ckpt_every + 2)
        cut = time.monotonic()
        self.sn.network.set_link(CUT, up=False)
        resumed, line = launcher.first(lambda s: s.startswith("[node1 0] resumed from "), cut,
                                       timeout=600)
        step, _ = launcher.first(lambda s: step_of(s) is not None, since=resumed, timeout=300)
        evs = events(self.work / "runs" / launcher.run_id())
        path = Path(line.split("resumed from ", 1)[1].rsplit(": epoch", 1)[0])
        if not path.is_absolute():      # relative to the trainer's folder on node1
            path = next((p for p in (Path(self.sn.workdir(1)) / d / path
                                     for d in ("", "cluster-train")) if p.exists()), path)
        load, size = torch_load(path)
        lost = [e.get("node") for e in evs if e["kind"] == "failed" and e["m"] >= cut]
        return {"parts": split(evs, cut, resumed, step), "cold": cold(evs, announced, first),
                "torch_load": load, "ckpt_bytes": size, "lost": lost,
                "set_aside": [s for _, s in launcher.lines if "takes its place" in s],
                "resumed": line}

    def clean(self, launcher: Launcher, code: int, keepalive: float) -> None:
        """Nothing of the run left on any node, node3 included once its link is back."""
        from tests.integration.conftest import run_processes_in, wait_until
        left = lambda: {i: run_processes_in(self.sn, i) for i in range(1, 5)}  # noqa: E731
        if wait_until(lambda: not any(left().values()), 2 * keepalive + 60, 0.5) is None:
            raise SystemExit(f"left on the nodes after the run (exit {code}): {left()}")


Config = tuple[float, "float | None"]      # the keepalive, the trainer's --stop-timeout


def label(config: Config) -> str:
    keepalive, stop_timeout = config
    return f"keepalive {keepalive:g} s" + (f", --stop-timeout {stop_timeout:g}"
                                           if stop_timeout is not None else "")


def stats(values: list[float]) -> str:
    return f"{statistics.median(values):6.2f} [{min(values):.2f}-{max(values):.2f}]"


def table(results: dict[Config, list[dict]]) -> list[str]:
    """One column per configuration, a row per part; the sums and the cold start below."""
    keys = list(results)
    head = "| part | " + " | ".join(label(k) for k in keys) + " |"
    out = [head, "|---|" + "---|" * len(keys)]
    col = lambda f: " | ".join(stats([f(r) for r in results[k]]) for k in keys)  # noqa: E731
    for name in PARTS:
        out.append(f"| {name} | {col(lambda r: r['parts'][name])} |")
    rest = lambda r: sum(v for n, v in r["parts"].items() if n != "detection")  # noqa: E731
    load = lambda r: max(0.0, r["parts"]["setup+load"] - r["cold"]["setup"])  # noqa: E731
    out.append(f"| **failure -> first step** | {col(lambda r: sum(r['parts'].values()))} |")
    out.append(f"| the rest (after detection) | {col(rest)} |")
    out.append(f"| checkpoint load (setup+load - the cold start's setup) | {col(load)} |")
    out.append(f"| the rest less the load | {col(lambda r: rest(r) - load(r))} |")
    out.append(f"| cold start: check -> first step | "
               f"{col(lambda r: sum(r['cold'].values()))} |")
    for name in COLD:
        out.append(f"| cold: {name} | {col(lambda r: r['cold'][name])} |")
    ms = lambda r: 1000 * r["torch_load"]  # noqa: E731
    out.append("| torch.load of the checkpoint alone, ms | "
               + " | ".join(f"{statistics.median(ms(r) for r in results[k]):.1f} "
                            f"({results[k][0]['ckpt_bytes'] / 1e6:.2f} MB)" for k in keys) + " |")
    return out


def verdicts(results: dict[Config, list[dict]]) -> list[str]:
    out = []
    for k in results:
        rs = results[k]
        med = lambda f: statistics.median(f(r) for r in rs)  # noqa: E731
        det = med(lambda r: r["parts"]["detection"])
        rest = med(lambda r: sum(v for n, v in r["parts"].items() if n != "detection"))
        load = med(lambda r: max(0.0, r["parts"]["setup+load"] - r["cold"]["setup"]))
        cold_s = med(lambda r: sum(r["cold"].values()))
        under = "under" if rest - load < GOAL else "OVER"
        out.append(f"{label(k)}: detection {det:.2f} s + the rest {rest:.2f} s "
                   f"(less the checkpoint's load {load:.2f} s: {rest - load:.2f} s, {under} the "
                   f"{GOAL:g} s goal); a restart costs {rest:.2f} s after detection vs a cold "
                   f"start's {cold_s:.2f} s (check -> first step), {rest / cold_s:.2f}x")
    return out


def main() -> int:
    from cluster.spec import DEFAULT_KEEPALIVE
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--keepalive", default=f"{DEFAULT_KEEPALIVE:g},2",
                    help="seconds, comma-separated (default: the default and 2)")
    ap.add_argument("--stop-timeout", default="1", help="the trainer's, seconds, each with "
                    "the shortest keepalive, comma-separated ('': none; the trainer's is 10)")
    ap.add_argument("--ckpt-every", type=int, default=5, help="the trainer's, in steps")
    ap.add_argument("--json", default="", help="write the raw results here")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("needs root (network namespaces)", file=sys.stderr)
        return 2
    os.environ.setdefault("CLUSTER_TEST_PYTHON", "/opt/cluster-venv/bin/python")
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(ROOT / "cluster")], check=True,
                   stdout=subprocess.DEVNULL)
    from tests.integration.fixtures import SshNodes
    keepalives = [float(x) for x in args.keepalive.split(",") if x]
    configs: list[Config] = [(k, None) for k in keepalives] + [
        (min(keepalives), float(x)) for x in args.stop_timeout.split(",") if x]
    results: dict[Config, list[dict]] = {c: [] for c in configs}
    with SshNodes(4) as sn:
        bench = Failover(sn, Path(tempfile.mkdtemp(prefix="cluster-bench-")), args.ckpt_every)
        for k in range(args.repeats):
            for config in configs:                  # A B A B: the machine's swings shared
                r = bench.once(config, k)
                results[config].append(r)
                parts = ", ".join(f"{n} {v:.2f}" for n, v in r["parts"].items())
                print(f"{label(config)}, repeat {k + 1}: {parts}; cold start "
                      f"{sum(r['cold'].values()):.2f} s; {r['set_aside'][:1]}", flush=True)
    print(f"\nfailure -> first step of the next attempt at world size 3, median [min-max] of "
          f"{args.repeats}, seconds\n")
    print("\n".join(table(results)))
    print()
    print("\n".join(verdicts(results)))
    if args.json:
        Path(args.json).write_text(json.dumps({label(k): v for k, v in results.items()},
                                              indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
