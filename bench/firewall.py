#!/usr/bin/env python3
"""A firewall that silently drops the master port on one node: how long until someone says so.

    sudo python bench/firewall.py              # 2 fake nodes, node2 drops packets to the port

Needs root, iproute2, openssh, iptables and the test venv (tests/run makes it). On fake nodes
(one sshd per network namespace, tests/integration/fixtures), node2 gets
`iptables -A OUTPUT -p tcp -d <master> --dport <port> -j DROP`, then, in the same run:

  cluster up     `cluster up` of a 2-node all_reduce: seconds until it exits (code 3, naming
                 node2 and the port)
  cluster doctor the same inventory and port: seconds until it exits (code 3, naming node2)
  bare torchrun  the same torchrun command line on both nodes over ssh (c10d rendezvous):
                 seconds until each node's torchrun gives up, capped at --cap

Prints one line per measurement and the ratio.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROGRAM = ROOT / "tests" / "integration" / "programs"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cap", type=float, default=700.0, help="stop waiting for torchrun after this")
    ap.add_argument("--port", type=int, default=29321)
    args = ap.parse_args()
    if os.geteuid() != 0 or not shutil.which("iptables"):
        print("needs root and iptables", file=sys.stderr)
        return 2
    from tests.integration.fixtures import SshNodes

    with SshNodes(2) as sn:
        tmp = Path(tempfile.mkdtemp(prefix="cluster-bench-fw-"))
        home, work = tmp / "home", tmp / "work"
        (home / ".ssh").mkdir(parents=True)
        work.mkdir()
        shutil.copy(sn.known_hosts_path, home / ".ssh" / "known_hosts")
        inv = sn.write_inventory(home / "inv.yaml")
        env = dict(os.environ, HOME=str(home), NO_COLOR="1")
        master = sn.nodes[0].address
        sn.network.run_in(2, ["iptables", "-A", "OUTPUT", "-p", "tcp", "-d", master, "--dport",
                              str(args.port), "-j", "DROP"], check=True)

        t0 = time.monotonic()
        up = subprocess.run([sys.executable, "-m", "cluster", "up", "-i", inv, "--master-port",
                             str(args.port), "--sync", str(PROGRAM), "--", "allreduce.py"],
                            cwd=work, env=env, capture_output=True, text=True)
        ours = time.monotonic() - t0
        named = "node2: reach master" in up.stderr
        print(f"cluster up      exit {up.returncode} after {ours:7.1f} s "
              f"({'names node2 and the port' if named else 'DID NOT name node2'})", flush=True)

        t0 = time.monotonic()
        doc = subprocess.run([sys.executable, "-m", "cluster", "doctor", "-i", inv, "--master-port",
                              str(args.port)], cwd=work, env=env, capture_output=True, text=True)
        took = time.monotonic() - t0
        named = "FAIL node2: reach master" in doc.stdout and str(args.port) in doc.stdout
        print(f"cluster doctor  exit {doc.returncode} after {took:7.1f} s "
              f"({'names node2 and the port' if named else 'DID NOT name node2'})", flush=True)

        def torchrun(i: int) -> str:
            return (f"cd {sn.workdir(i)} && {sn.python} -m torch.distributed.run --nnodes=2 "
                    f"--nproc_per_node=1 --rdzv_backend=c10d --rdzv_endpoint={master}:{args.port} "
                    f"--rdzv_id=bench-fw allreduce.py")
        t0 = time.monotonic()
        procs = {i: subprocess.Popen(sn.ssh_argv(i, torchrun(i)), stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL) for i in (1, 2)}
        ended: dict[int, float] = {}
        while len(ended) < 2 and time.monotonic() - t0 < args.cap:
            for i, p in procs.items():
                if i not in ended and p.poll() is not None:
                    ended[i] = time.monotonic() - t0
            time.sleep(0.5)
        for i, p in procs.items():
            if p.poll() is None:
                p.kill()
        for i in (1, 2):
            took = f"{ended[i]:7.1f} s" if i in ended else f"> {args.cap:.0f} s (still waiting)"
            print(f"bare torchrun   node{i} gave up after {took}", flush=True)
        slowest = max(ended.values()) if len(ended) == 2 else args.cap
        print(f"ratio           cluster / bare torchrun (slowest node): {ours / slowest:.3f}")
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
