#!/usr/bin/env python3
"""Where one node's start-up goes, on this machine, without SSH: the node's process of a launch
(the bootloader with the probe's bundle, its answer, then the start bundle that makes it the
supervisor, which starts a launch.sh that only touches a marker), run as sshd would run it
(`bash -c COMMAND`), with the bundles on its input.

    python bench/node_startup.py [--python PATH] [--repeats N] [--before DIR]

Prints, as median [min-max] over N runs (interleaved):
  interpreter  `python -c pass` with site, with -S, with -I
  phases       wall-clock phases of the node's process, from time stamps a copy of the
               bootloader writes to stderr (this benchmark's copy only; CLOCK_MONOTONIC, the
               same clock on both sides)
  cpu          user+system CPU of the node's process and its children, probe to the job's end
The node's python is --python (default: $CLUSTER_TEST_PYTHON, else this one).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cluster.backends import shipping  # noqa: E402


def stamped_boot() -> str:
    """The bootloader, writing '@WHAT SECONDS' to stderr at each step."""
    b = shipping.BOOT
    for old, new in (("import os,sys,json,types,marshal\n", "import os,sys,json,types,marshal,time\n"
                      "def _s(w):os.write(2,('@%s %.6f\\n'%(w,time.monotonic())).encode())\n"
                      "_s('boot')\n"),
                     (" exec(g(", " _s('load '+n);exec(g("),
                     (",x.__dict__);return x\n", ",x.__dict__);_s('loaded '+n);return x\n"),
                     (" P=k.get(n)", " _s('main '+n);P=k.get(n)")):
        if old not in b:
            raise SystemExit(f"bench/node_startup.py: the bootloader changed ({old!r} is gone)")
        b = b.replace(old, new, 1)
    return b


def fmt(values: list[float]) -> str:
    return f"{statistics.median(values):6.1f} ms [{min(values):.1f}-{max(values):.1f}]"


def interpreter(python: str, repeats: int) -> None:
    variants = {"site": [], "-S": ["-S"], "-I": ["-I"]}
    took: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(repeats):
        for name, flags in variants.items():
            t0 = time.perf_counter()
            subprocess.run([python, *flags, "-c", "pass"], check=True)
            took[name].append((time.perf_counter() - t0) * 1000)
    for name, values in took.items():
        print(f"interpreter  python {name:5s} -c pass          {fmt(values)}")


def one_node(python: str, boot: str, flags: str) -> tuple[dict[str, float], float]:
    """(phase -> ms, CPU ms) of one node's process, probe to the job's marker."""
    d = tempfile.mkdtemp(prefix="node-startup-")
    marker = os.path.join(d, "marker")
    probe = shipping.program("probe", "facts", "--workdir", d, "--own", "127.0.0.1",
                             "--master", "127.0.0.1", "--dir", f"{d}/.cluster/r/n", "--port", "29999",
                             dir=d)
    command = " ".join([shlex.quote(python), flags, "-c", shlex.quote(boot), "probe", "facts"])
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    with tempfile.TemporaryFile() as err:
        t0 = time.monotonic()
        p = subprocess.Popen(["bash", "-c", command], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=err)
        assert p.stdin and p.stdout
        p.stdin.write(probe.data)
        p.stdin.flush()
        facts = json.loads(p.stdout.readline())
        t1 = time.monotonic()
        start = shipping.start(facts["dir"], ["--run-id", "r", "--node", "n", "--grace", "5",
                                              "--keepalive", "60"], f"touch {marker}\n".encode())
        p.stdin.write(start.data + b'{"env": {}}\n')
        p.stdin.flush()
        while not os.path.exists(marker):
            time.sleep(0.0002)
        t2 = time.monotonic()
        time.sleep(0.05)                 # the job has ended: the launcher goes, the node stops
        p.stdin.close()
        p.stdout.read()
        p.wait()
        err.seek(0)
        at: dict[str, float] = {}
        for line in err.read().decode().splitlines():
            if line.startswith("@"):
                what, value = line[1:].rsplit(" ", 1)
                at.setdefault(what, float(value))
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime) * 1000
    spans = [("bash, the interpreter (site if asked)", t0, at["boot"]),
             ("probe module: loaded, its imports", at["load probe"], at["loaded probe"]),
             ("probe: its facts, answer read", at["main probe"], t1),
             ("start bundle: read, written, loaded", t1, at["load supervisor"]),
             ("supervisor module: loaded", at["load supervisor"], at["loaded supervisor"]),
             ("supervisor: to the job's marker", at["main supervisor"], t2),
             ("total, probe to the job", t0, t2)]
    return {name: (b - a) * 1000 for name, a, b in spans}, cpu


def phases(python: str, repeats: int) -> None:
    boot = stamped_boot()
    variants = {"as shipped (-S)": "-S", "with site, for comparison": ""}
    rows: dict[str, dict[str, list[float]]] = {k: {} for k in variants}
    for _ in range(repeats):
        for name, flags in variants.items():
            spans, cpu = one_node(python, boot, flags)
            for span, ms in [*spans.items(), ("CPU of the node's processes", cpu)]:
                rows[name].setdefault(span, []).append(ms)
    for name, spans in rows.items():
        print(f"phases       {name}")
        for span, values in spans.items():
            print(f"               {span:34s} {fmt(values)}")


def shipping_of(root: str, name: str):
    """backends/shipping.py of the checkout at root, as its own module (standard library only)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, f"{root}/cluster/backends/shipping.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module                   # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def life_cpu(ship, python: str, d: str) -> float:
    """CPU ms of one node's life by that code's own protocol: its probe's facts, then its
    start bundle, a job that exits at once, the supervisor's end."""
    probe = ship.program("probe", "facts", "--workdir", d, "--own", "127.0.0.1", "--master",
                         "127.0.0.1", "--dir", f"{d}/.cluster/r/n", dir=d)
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    p = subprocess.Popen(["bash", "-c", ship.boot_command(shlex.quote(python), probe)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert p.stdin and p.stdout
    p.stdin.write(probe.data)
    p.stdin.flush()
    facts = json.loads(p.stdout.readline())
    start = ship.start(facts["dir"], ["--run-id", "r", "--node", "n", "--grace", "5", "--keepalive", "0"],
                       b"true\n")
    out, _ = p.communicate(start.data + b'{"env": {}}\n', timeout=60)
    assert b'"final"' in out, out[-500:]
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime) * 1000


def before_after(python: str, before: str, repeats: int) -> None:
    codes = {"this code": shipping, "before": shipping_of(before, "shipping_before")}
    cpu: dict[str, list[float]] = {k: [] for k in codes}
    for i in range(repeats + 1):
        for name, ship in codes.items():
            ms = life_cpu(ship, python, tempfile.mkdtemp(prefix="node-life-"))
            if i:                                 # the first of each fills the node's caches
                cpu[name].append(ms)
    for name, values in cpu.items():
        print(f"node life    {name:10s} CPU {fmt(values)}")
    ratio = statistics.median(cpu["this code"]) / statistics.median(cpu["before"])
    print(f"node life    this code / before {ratio:.2f} (median of {repeats}, interleaved)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--python", default=os.environ.get("CLUSTER_TEST_PYTHON", sys.executable))
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--before", help="a checkout of the code before a change, measured beside this one")
    args = ap.parse_args()
    print(f"node python: {args.python}")
    if args.before:
        before_after(args.python, args.before, args.repeats)
        return 0
    interpreter(args.python, args.repeats)
    phases(args.python, args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
