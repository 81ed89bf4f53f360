#!/usr/bin/env python3
"""Goodput, live metrics and alerts on four real runs: what each one says, sends and draws.

    PYTHONPATH=$PWD /opt/cluster-venv/bin/python bench/observe_runs.py
    PYTHONPATH=$PWD /opt/cluster-venv/bin/python bench/observe_runs.py --out /tmp/pictures

Four `cluster up --local --nodes 2` runs of the reference trainer (train/train.py on the CPU,
the digits, 3 epochs of 22 steps, a checkpoint every 10 steps), each in a fresh folder, with
`--metrics-port 0`, `--notify` to a real HTTP server of this script's own on 127.0.0.1, and a
secret (`--secret-env CANARY_TOKEN`, a random value each time). The trainer's test hooks (in
the launcher's environment, which the local backend passes to the nodes) make them go:

  clean      finishes                                                        exit 0
  failed     rank 0 raises at step --fail-at                                 exit 4
  restarted  the same, --max-restarts 1: attempt 2 resumes from the newest
             checkpoint (the hook fires in the first attempt only)           exit 0
  hung       every rank blocks after step --hang-after; --hang-timeout 15    exit 4

Every step sleeps --step-sleep s, so that the runs last long enough to be scraped. While a
run goes, its metrics URL (the launcher's `cluster: metrics: http://...` line) is scraped
until a node's cluster_node_step_rate is above 0; that sample is kept. After each run: its
exit code, the launcher's goodput line, `cluster status --goodput RUN`, the alerts received in
order (minus `time` and `launcher`), and checks: the exit code, the alerts' kinds in order, the
goodput's parts adding up to its wall time within 1%, the canary's value in no alert, not in
the launcher's output, and not in run.json, events.jsonl nor timeline.json. Then the clean
run's scrape (its cluster_ lines, the states at 0 left out). Each run's timeline.png is
copied to --out (default: a new temporary folder, printed). Exits 1 if an expectation failed.
Takes about two minutes on two idle cores.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
METRICS = re.compile(r"^cluster: metrics: (http://\S+)$")
GOODPUT = re.compile(r"^cluster: goodput .*$")
CANARY_ENV = "CANARY_TOKEN"


class Hook:
    """A webhook on 127.0.0.1 (a free port): each POST's JSON body kept in order, answered
    200."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                data = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with hook.lock:
                    hook.bodies.append(json.loads(data))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:    # quiet
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/alerts"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def take(self) -> list[dict[str, Any]]:
        """The bodies received since the last take."""
        with self.lock:
            out, self.bodies = self.bodies, []
        return out

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@dataclass
class Case:
    name: str
    code: int                      # the exit code expected
    kinds: list[str]               # the alerts expected, in order ("aside" allowed anywhere)
    env: dict[str, str] = field(default_factory=dict)
    args: list[str] = field(default_factory=list)


@dataclass
class Outcome:
    case: Case
    folder: Path
    code: int | None = None
    stdout: list[str] = field(default_factory=list)
    stderr: list[str] = field(default_factory=list)
    scrape: str | None = None      # the first scrape with a step rate above 0
    scrapes: int = 0
    began: float = 0.0             # time.time() before the launcher's process was made
    bodies: list[dict[str, Any]] = field(default_factory=list)
    run: Path | None = None
    problems: list[str] = field(default_factory=list)


def cases(args: argparse.Namespace) -> list[Case]:
    fail = {"CLUSTER_TRAIN_TEST_FAIL_AT_STEP": str(args.fail_at)}
    return [
        Case("clean", 0, ["finish"]),
        Case("failed", 4, ["failure", "finish"], fail),
        Case("restarted", 0, ["failure", "restart", "finish"], fail, ["--max-restarts", "1"]),
        Case("hung", 4, ["hang", "finish"],
             {"CLUSTER_TRAIN_TEST_HANG_AFTER_STEP": str(args.hang_after)},
             ["--hang-timeout", str(args.hang_timeout)]),
    ]


# -- one run --

def launch(case: Case, hook: Hook, canary: str, args: argparse.Namespace) -> Outcome:
    """`cluster up` in a fresh folder; its output read as it comes, its metrics scraped."""
    folder = Path(tempfile.mkdtemp(prefix=f"observe-{case.name}-"))
    out = Outcome(case, folder)
    env = dict(os.environ, PYTHONPATH=str(ROOT), NO_COLOR="1", COLUMNS="120",
               CUDA_VISIBLE_DEVICES="", CLUSTER_TRAIN_TEST_STEP_SLEEP=str(args.step_sleep),
               **{CANARY_ENV: canary}, **case.env)
    env.pop("CLUSTER_RUNS_DIR", None)
    argv = [sys.executable, "-m", "cluster", "up", "--local", "--nodes", "2",
            "--metrics-port", "0", "--notify", hook.url, "--secret-env", CANARY_ENV, *case.args,
            "--", "--device", "cpu", "--epochs", str(args.epochs), "--ckpt-every", "10",
            "--log-every", "20", "--no-plot", "--out", str(folder / "out")]
    out.began = time.time()
    proc = subprocess.Popen(argv, cwd=folder, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    found = threading.Event()
    url: list[str] = []

    def read_err() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            out.stderr.append(line.rstrip("\n"))
            m = METRICS.match(line.strip())
            if m and not url:
                url.append(m.group(1))
                found.set()

    def read_out() -> None:
        assert proc.stdout is not None
        out.stdout.extend(line.rstrip("\n") for line in proc.stdout)

    readers = [threading.Thread(target=f, daemon=True) for f in (read_err, read_out)]
    for t in readers:
        t.start()
    if found.wait(60):
        scrape(url[0], proc, out)
    try:
        out.code = proc.wait(args.timeout)
    except subprocess.TimeoutExpired:
        out.problems.append(f"still running after {args.timeout} s: stopped")
        os.killpg(proc.pid, signal.SIGINT)
        out.code = proc.wait(60)
    for t in readers:
        t.join(10)
    runs = sorted((folder / "runs").glob("*/run.json"))
    out.run = runs[-1].parent if runs else None
    out.bodies = hook.take()
    return out


def scrape(url: str, proc: subprocess.Popen, out: Outcome) -> None:
    """Scrape every 0.25 s until a node's step rate is above 0 (that text kept) or the run
    ends."""
    while proc.poll() is None:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                text = r.read().decode()
        except OSError:
            text = ""
        out.scrapes += 1
        if text and any(s.value > 0 for f in text_string_to_metric_families(text)
                        for s in f.samples if s.name == "cluster_node_step_rate"):
            out.scrape = text
            return
        time.sleep(0.25)


# -- what is checked --

def check(out: Outcome, canary: str) -> None:
    case, said = out.case, out.problems
    if out.code != case.code:
        said.append(f"exit code {out.code}, expected {case.code}")
    if out.run is None:
        said.append("no run folder (runs/*/run.json)")
        return
    got = [b.get("event") for b in out.bodies]
    if [k for k in got if k != "aside"] != case.kinds:
        said.append(f"alerts {got}, expected {case.kinds} (asides aside)")
    if any(b.get("run") != out.run.name for b in out.bodies):
        said.append("an alert names another run")
    if out.scrape is None:
        said.append(f"no scrape with a step rate above 0 ({out.scrapes} scrape(s))")
    g = json.loads((out.run / "run.json").read_text()).get("goodput")
    if not isinstance(g, dict):
        said.append("run.json has no goodput")
    elif abs(sum(g["parts"].values()) - g["wall"]) > 0.01 * g["wall"]:
        said.append(f"goodput's parts add up to {sum(g['parts'].values()):.3f} s, "
                    f"its wall is {g['wall']:.3f} s")
    places = {"the alerts": json.dumps(out.bodies), "stdout": "\n".join(out.stdout),
              "stderr": "\n".join(out.stderr)}
    for name in ("run.json", "events.jsonl", "timeline.json"):
        path = out.run / name
        places[name] = path.read_text(errors="replace") if path.exists() else ""
    for place, text in places.items():
        if canary in text:
            said.append(f"the canary's value is in {place}")


# -- what is said --

def report(out: Outcome, pictures: Path) -> None:
    case = out.case
    run = out.run.name if out.run else "?"
    print(f"== {case.name}: run {run} (folder {out.folder})")
    print(f"exit code: {out.code} (expected {case.code})")
    for line in out.stderr:
        if GOODPUT.match(line):
            print(line)
    if out.run is not None:
        print(status_goodput(out))
        print(f"wall by this script's clock: {own_wall(out):.2f} s (from before the launcher's "
              "process was made to its last event)")
        print(f"first progress vs checkpoints: {first_step_note(out.run)}")
    print(f"alerts ({len(out.bodies)}):")
    for b in out.bodies:
        print("  " + json.dumps({k: v for k, v in b.items() if k not in ("time", "launcher")},
                                separators=(",", ":")))
    print(f"scrape: {summary(out.scrape) if out.scrape else 'none'} ({out.scrapes} scrape(s))")
    if out.run is not None and (out.run / "timeline.png").exists():
        shutil.copy(out.run / "timeline.png", pictures / f"{case.name}-timeline.png")
        print(f"timeline: {pictures / f'{case.name}-timeline.png'}")
    print("checks: " + ("ok" if not out.problems else "FAILED: " + "; ".join(out.problems)))
    print()


def status_goodput(out: Outcome) -> str:
    """`cluster status --goodput RUN`, run in the run's folder."""
    assert out.run is not None
    env = dict(os.environ, PYTHONPATH=str(ROOT), NO_COLOR="1", COLUMNS="120")
    env.pop("CLUSTER_RUNS_DIR", None)
    res = subprocess.run([sys.executable, "-m", "cluster", "status", "--goodput", out.run.name],
                         cwd=out.folder, env=env, capture_output=True, text=True, timeout=60)
    if res.returncode != 0:
        out.problems.append(f"status --goodput: exit {res.returncode}: {res.stderr.strip()}")
    return "\n".join(line.rstrip() for line in (res.stdout + res.stderr).strip().splitlines())


def own_wall(out: Outcome) -> float:
    assert out.run is not None
    last = (out.run / "events.jsonl").read_text().splitlines()[-1]
    return float(json.loads(last)["t"]) - out.began


def first_step_note(run: Path) -> str:
    """Each attempt's first recorded beat that names a step, and its first checkpoint event,
    in seconds from the launch: goodput's training begins at the former, so a checkpoint
    before it says that the steps began earlier than goodput counts them."""
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    m0 = events[0]["m"]
    notes = []
    for attempt in sorted({e.get("attempt", 0) for e in events}):
        mine = [e for e in events if e.get("attempt", 0) == attempt]
        step = min((e["m"] for e in mine if e["kind"] == "beat" and "step" in e), default=None)
        ckpt = min(((e["m"], e["step"]) for e in mine if e["kind"] == "checkpoint"
                    and isinstance(e.get("step"), int)), default=None)
        late = step is not None and ckpt is not None and ckpt[0] < step
        notes.append(f"attempt {attempt + 1}: first step beat "
                     + (f"{step - m0:.1f} s" if step is not None else "none")
                     + (f", first checkpoint (step {ckpt[1]}) {ckpt[0] - m0:.1f} s"
                        if ckpt else ", no checkpoint")
                     + (" (steps were made before the first step beat recorded)" if late else ""))
    return "; ".join(notes)


def summary(text: str) -> str:
    """A scrape in a line: each node's step and step rate, the attempt."""
    nodes: dict[str, list[str]] = {}
    attempt = "?"
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in ("cluster_node_step", "cluster_node_step_rate"):
                nodes.setdefault(s.labels["node"], []).append(
                    f"{s.name.rsplit('_', 1)[-1]} {s.value:g}")
            elif s.name == "cluster_run_attempt":
                attempt = f"{s.value:g}"
    return f"attempt {attempt}; " + "; ".join(f"[{n}] {', '.join(v)}" for n, v in nodes.items())


def sample_lines(text: str) -> list[str]:
    """The cluster_ lines of a scrape, the states at 0 left out."""
    return [line for line in text.splitlines() if line.startswith("cluster_")
            and not (line.startswith("cluster_node_state{") and line.endswith(" 0.0"))]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None,
                   help="where the timeline pictures go (default: a new temporary folder)")
    p.add_argument("--epochs", type=int, default=3, help="the trainer's epochs (22 steps each)")
    p.add_argument("--step-sleep", type=float, default=0.05, help="seconds slept per step")
    p.add_argument("--fail-at", type=int, default=35, help="the step rank 0 raises at")
    p.add_argument("--hang-after", type=int, default=30, help="the step the ranks block after")
    p.add_argument("--hang-timeout", type=int, default=15, help="cluster up --hang-timeout")
    p.add_argument("--timeout", type=int, default=300, help="seconds a run may take")
    p.add_argument("--only", default="", help="only these runs (comma-separated names)")
    p.add_argument("--keep", action="store_true", help="keep the runs' folders")
    args = p.parse_args()
    pictures = args.out or Path(tempfile.mkdtemp(prefix="observe-runs-"))
    pictures.mkdir(parents=True, exist_ok=True)
    chosen = [c for c in cases(args) if not args.only or c.name in args.only.split(",")]
    print(f"observe_runs: {len(chosen)} run(s) of `cluster up --local --nodes 2`, the trainer "
          f"on the CPU ({args.epochs} epochs, {args.step_sleep} s a step); pictures: {pictures}")
    print()
    hook = Hook()
    outcomes = []
    try:
        for case in chosen:
            canary = "canary-" + secrets.token_hex(8)
            out = launch(case, hook, canary, args)
            check(out, canary)
            report(out, pictures)
            outcomes.append(out)
    finally:
        hook.close()
    clean = next((o for o in outcomes if o.case.name == "clean" and o.scrape), None)
    if clean is not None:
        print(f"== a scrape of the clean run (run {clean.run.name if clean.run else '?'}), "
              "its cluster_ lines, the states at 0 left out:")
        print("\n".join(sample_lines(clean.scrape or "")))
        print()
    failed = [o for o in outcomes if o.problems]
    for o in outcomes:
        if not args.keep:
            shutil.rmtree(o.folder, ignore_errors=True)
    print(f"pictures: {pictures}")
    print("all expectations met" if not failed else
          "expectations failed: " + ", ".join(o.case.name for o in failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
