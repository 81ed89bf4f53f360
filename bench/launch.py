#!/usr/bin/env python3
"""Fan-out of the SSH backend against pdsh, both measured in the same run on fake nodes.

    sudo python bench/launch.py              # 8 nodes, 3 repeats
    sudo python bench/launch.py --nodes 16 --repeats 5

Needs root, iproute2, openssh and pdsh (the fixtures in tests/integration bring up one sshd
per network namespace). Three measurements, each the median of the repeats:

  connect+exec   `hostname` on every node: SshBackend's transports (parallel connect, one
                 exec each) vs `pdsh -R ssh -f 64 -w ... hostname`
  launch         `cluster up` of a trivial torchrun script (every node: rendezvous, print,
                 exit) vs pdsh running the same torchrun command line (c10d rendezvous) on
                 every node. `cluster up` also checks every node, pushes the scripts, syncs
                 the program and records the run; pdsh does none of that.

Prints one line per measurement with the ratio cluster / pdsh (below 1: cluster is faster).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TRIVIAL = """\
import os, socket
import torch.distributed as dist
dist.init_process_group("gloo")
print(dist.get_rank(), dist.get_world_size(), socket.gethostname(), flush=True)
dist.barrier()  # no rank may leave while another is still connecting its mesh
dist.destroy_process_group()
"""


def timed(fn) -> float:
    t0 = time.monotonic()
    fn()
    return time.monotonic() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if os.geteuid() != 0 or not shutil.which("pdsh"):
        print("needs root and pdsh (apt-get install pdsh)", file=sys.stderr)
        return 2

    from cluster.backends.ssh import SshBackend
    from cluster.inventory import load
    from tests.integration.fixtures import SshNodes

    with SshNodes(args.nodes) as sn:
        tmp = Path(tempfile.mkdtemp(prefix="cluster-bench-"))
        home, work, prog = tmp / "home", tmp / "work", tmp / "prog"
        for d in (home / ".ssh", work, prog):
            d.mkdir(parents=True)
        shutil.copy(sn.known_hosts_path, home / ".ssh" / "known_hosts")
        (prog / "trivial.py").write_text(TRIVIAL)
        inv_path = sn.write_inventory(home / "inv.yaml")
        env = dict(os.environ, HOME=str(home), PDSH_SSH_ARGS=f"-F {sn.ssh_config_path} -l%u %h")
        os.environ["HOME"] = str(home)
        addrs = [n.address for n in sn.nodes]
        wlist = ",".join(addrs)
        pdsh = ["pdsh", "-R", "ssh", "-f", "64", "-l", sn.user, "-w", wlist]

        inventory = load(inv_path)

        def cluster_fanout() -> None:
            backend = SshBackend(inventory.ssh)
            try:
                results = backend.each(inventory.hosts, lambda h: backend.transport(h).run("hostname"))
                bad = [r for _, r in results if isinstance(r, Exception) or r.code != 0]
                if bad:
                    raise SystemExit(f"fan-out failed: {bad}")
            finally:
                backend.close()

        def pdsh_fanout() -> None:
            subprocess.run(pdsh + ["hostname"], env=env, check=True, capture_output=True)

        def cluster_up() -> None:
            r = subprocess.run([sys.executable, "-m", "cluster", "up", "-i", inv_path, "--sync",
                                str(prog), "--", "trivial.py"], cwd=work, env=env,
                               capture_output=True, text=True)
            if r.returncode != 0:
                raise SystemExit(f"cluster up failed (logs: {work}/runs/):\n{r.stderr[-2000:]}")

        port = [29400]

        def pdsh_torchrun() -> None:
            port[0] += 1
            cmd = (f"cd {sn.workdir(1).rsplit('/', 1)[0]}/$(hostname) && "
                   f"{sn.python} -m torch.distributed.run --nnodes={args.nodes} "
                   f"--nproc_per_node=1 --rdzv_backend=c10d --rdzv_endpoint={addrs[0]}:{port[0]} "
                   f"--rdzv_id=bench{port[0]} trivial.py")
            r = subprocess.run(pdsh + [cmd], env=env, capture_output=True, text=True)
            if r.returncode != 0:
                raise SystemExit(f"pdsh torchrun failed:\n{r.stdout[-1000:]}{r.stderr[-2000:]}")

        cluster_up()          # first run: makes the workdirs, syncs the program to each
        rows = []
        for name, ours, theirs in (("connect+exec", cluster_fanout, pdsh_fanout),
                                   ("launch", cluster_up, pdsh_torchrun)):
            a = [timed(ours) for _ in range(args.repeats)]
            b = [timed(theirs) for _ in range(args.repeats)]
            ma, mb = statistics.median(a), statistics.median(b)
            rows.append((name, ma, mb))
            print(f"{name:13s} {args.nodes} nodes: cluster {ma:6.2f} s  pdsh {mb:6.2f} s  "
                  f"ratio {ma / mb:5.2f}", flush=True)
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
