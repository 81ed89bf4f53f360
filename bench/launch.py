#!/usr/bin/env python3
"""The launcher's own costs at scale, against pdsh and a plain ssh loop, measured in the same run
on fake nodes (one sshd per network namespace: tests/integration/fixtures).

    sudo python bench/launch.py                          # everything, default sizes
    sudo python bench/launch.py --fanout 8,32 --repeats 3 --skip launch,teardown

Needs root, iproute2, openssh, pdsh and the test venv (tests/run makes it). Four measurements,
each repeated (A B C A B C ...) and reported as median [min-max]:

  fanout     N nodes each run a script that writes a marker file and exits; the time until
             every marker exists. `cluster up` (a template override: no torch, so the
             launcher's own cost is what is measured; the check phase and the
             supervisors included) vs `pdsh -R ssh -f 64` running the same script vs a plain
             loop of `ssh ... &`. Also the launching process's peak memory, threads and CPU,
             the nodes' CPU for the launch (each node's sshd and all it started, from
             /proc: these nodes share the launcher's cores, so a launch's time at scale is
             their CPU and the launcher's, added up), and, from one more launch outside the
             timed ones, the SSH commands (channels that exec a command) and SFTP sessions it
             opened per node.
  launch     a tiny gloo job (init, barrier, destroy) at 3 and 8 nodes, launch to done:
             `cluster up` (its default, static, and c10d) vs bare torchrun started over an ssh
             loop, and where each one's time goes, phase by phase (bench/phases.py: the
             launcher's events and what every rank stamps), as a table of medians.
  teardown   kill -9 of one rank while the others are idle, and Ctrl-C, to every node clean
             (checked per network namespace). At 8 nodes with real torchrun; at 8 and 64 with a
             stand-in agent (the standard library; 64 torch processes do not fit 24 GiB).
  plot       a PNG: fan-out time against N, log-log, for the three.

Prints one line per measurement and the ratio against pdsh / bare torchrun from the same run.
With --before DIR (a worktree of the code before a change: `git worktree add DIR COMMIT`),
that code is measured too, A B A B in the same run, for fanout, launch and teardown.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
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

from bench import phases  # noqa: E402

# torchrun's part in a teardown, without torch: workers in sessions of their own, the agent
# exits 1 when one of them dies (as torchrun does), every worker says its pid.
STAND_IN_AGENT = """\
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c",
    "import os, time; print('worker', os.getpid(), flush=True); time.sleep(600)"],
    start_new_session=True)
sys.exit(0 if child.wait() == 0 else 1)
"""


def stats(values: list[float]) -> str:
    return f"{statistics.median(values):7.2f} s [{min(values):.2f}-{max(values):.2f}]"


# Counts, in the launcher's process, every SSH command (a channel's exec) and SFTP session per
# node: imported at its start as sitecustomize (PYTHONPATH), written out as it exits.
COUNT_SESSIONS = """\
import atexit, collections, json, os, threading
import paramiko
_counts, _lock = collections.defaultdict(lambda: {"exec": 0, "sftp": 0}), threading.Lock()
def _counting(kind, real):
    def call(self, *args, **kwargs):
        peer = self.get_transport().getpeername()[0]
        with _lock:
            _counts[peer][kind] += 1
        return real(self, *args, **kwargs)
    return call
paramiko.Channel.exec_command = _counting("exec", paramiko.Channel.exec_command)
paramiko.Channel.invoke_subsystem = _counting("sftp", paramiko.Channel.invoke_subsystem)
atexit.register(lambda: open(os.environ["CLUSTER_BENCH_SESSIONS"], "w").write(json.dumps(_counts)))
"""


# The code measured: this checkout, and with --before the code before a change (a worktree),
# run A B A B in the same session. Set by main().
ROOTS: dict[str, Path] = {"cluster": ROOT}


class Bench:
    def __init__(self, sn, tmp: Path) -> None:
        from tests.integration.fixtures import SshNodes  # noqa: F401  (typing only)
        self.sn = sn
        self.tmp = tmp
        self.home = tmp / "home"
        (self.home / ".ssh").mkdir(parents=True)
        shutil.copy(sn.known_hosts_path, self.home / ".ssh" / "known_hosts")
        self.markers = tmp / "markers"
        self.markers.mkdir()
        self.markers.chmod(0o777)
        tmp.chmod(0o755)
        # PYTHONPATH: the cluster of this checkout, whatever else the venv has installed
        self.env = dict(os.environ, HOME=str(self.home), NO_COLOR="1", PYTHONPATH=str(ROOT),
                        PDSH_SSH_ARGS=f"-F {sn.ssh_config_path} -l%u %h")
        self.addrs = [n.address for n in sn.nodes]
        self.work = tmp / "work"
        self.work.mkdir()
        self.tpl = tmp / "tpl"
        self.tpl.mkdir()
        (self.tpl / "node.sh.j2").write_text(f"touch {self.markers}/{{{{ host.name }}}}\n")
        self.script = tmp / "mark.sh"
        self.script.write_text(f"touch {self.markers}/$(hostname)\n")
        self.script.chmod(0o755)

    def inventory(self, nodes: int, **defaults) -> str:
        return self.sn.write_inventory(self.home / f"inv-{nodes}.yaml",
                                       nodes=list(range(1, nodes + 1)), **defaults)

    def node_cpu(self) -> float:
        """CPU seconds the nodes have used: each node's sshd with every process it started and
        reaped (its sessions, and in them the node's shell, python, the job), read from
        /proc/PID/stat. Its rise over one launch is what that launch cost the nodes: on these
        nodes it is paid on the launcher's two cores, on a real cluster by each node."""
        tick, total = os.sysconf("SC_CLK_TCK"), 0
        for proc in self.sn._procs.values():
            try:
                fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += sum(int(x) for x in fields[11:15])     # utime stime cutime cstime
        return total / tick

    def clear(self) -> None:
        for p in self.markers.iterdir():
            p.unlink()

    def until_marked(self, n: int, procs: list[subprocess.Popen], t0: float,
                     timeout: float = 600) -> float:
        while len(os.listdir(self.markers)) < n:
            if time.monotonic() - t0 > timeout:
                raise SystemExit(f"markers: {len(os.listdir(self.markers))} of {n} after {timeout} s")
            if all(p.poll() is not None for p in procs) and len(os.listdir(self.markers)) < n:
                out = procs[0].stderr.read() if procs[0].stderr else ""
                raise SystemExit(f"{procs[0].args[:6]} ended early ({procs[0].returncode}): {out[-2000:]}")
            time.sleep(0.005)
        return time.monotonic() - t0

    # -- fan-out -------------------------------------------------------------------------

    def env_of(self, code: str) -> dict[str, str]:
        return dict(self.env, PYTHONPATH=str(ROOTS[code]))

    def fanout_cluster(self, n: int, code: str = "cluster") -> tuple[float, dict]:
        self.clear()
        inv = self.inventory(n)
        nodes0 = self.node_cpu()
        t0 = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-m", "cluster", "up", "-i", inv, "--templates",
                                 str(self.tpl), "--", "x"], cwd=self.work, env=self.env_of(code),
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        peak = Peak(proc.pid)
        took = self.until_marked(n, [proc], t0)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        peak.stop()
        lowest = peak.available_mb
        if proc.returncode != 0:
            raise SystemExit(f"cluster up failed: {proc.stderr.read()[-2000:]}")
        return took, {"rss_mb": usage.ru_maxrss / 1024, "cpu_s": usage.ru_utime + usage.ru_stime,
                      "threads": peak.threads, "timings": self.timings(), "available_mb": lowest,
                      "node_cpu_s": self.settled_node_cpu(nodes0)}

    def settled_node_cpu(self, before: float) -> float:
        """The nodes' CPU since `before`, once their sessions have ended and been reaped."""
        time.sleep(0.5)
        return self.node_cpu() - before

    def sessions_cluster(self, n: int) -> dict[str, dict[str, int]]:
        """One more fan-out launch, not timed: {node address: {"exec": SSH commands, "sftp":
        SFTP sessions}} the launcher opened."""
        hook = self.tmp / "count-sessions"
        hook.mkdir(exist_ok=True)
        (hook / "sitecustomize.py").write_text(COUNT_SESSIONS)
        out = self.tmp / "sessions.json"
        env = dict(self.env, PYTHONPATH=f"{hook}:{ROOT}", CLUSTER_BENCH_SESSIONS=str(out))
        self.clear()
        subprocess.run([sys.executable, "-m", "cluster", "up", "-i", self.inventory(n), "--templates",
                        str(self.tpl), "--", "x"], cwd=self.work, env=env, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return json.loads(out.read_text())

    def fanout_pdsh(self, n: int) -> tuple[float, float, float]:
        """Seconds until every marker exists, the CPU seconds of pdsh with its ssh clients, and
        the nodes' CPU seconds."""
        self.clear()
        nodes0 = self.node_cpu()
        t0 = time.monotonic()
        proc = subprocess.Popen(["pdsh", "-R", "ssh", "-f", "64", "-l", self.sn.user, "-w",
                                 ",".join(self.addrs[:n]), str(self.script)], env=self.env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        took = self.until_marked(n, [proc], t0)
        _, _, usage = os.wait4(proc.pid, 0)
        proc.returncode = 0
        return took, usage.ru_utime + usage.ru_stime, self.settled_node_cpu(nodes0)

    def fanout_ssh_loop(self, n: int) -> float:
        self.clear()
        t0 = time.monotonic()
        procs = [subprocess.Popen(self.sn.ssh_argv(i, str(self.script)), env=self.env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                 for i in range(1, n + 1)]
        took = self.until_marked(n, procs, t0)
        for p in procs:
            p.wait()
        return took

    def timings(self) -> dict:
        runs = sorted((self.work / "runs").iterdir())
        return json.loads((runs[-1] / "run.json").read_text()).get("timings", {})

    # -- launch to done ---------------------------------------------------------------------

    def stamped(self) -> Path:
        """An empty folder every rank stamps its phases into (bench/phases.py)."""
        d = self.tmp / "stamps"
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir()
        d.chmod(0o777)
        return d

    def launch_cluster(self, n: int, rendezvous: str | None, prog: Path,
                       code: str = "cluster") -> tuple[float, dict]:
        """Seconds from the launch to the prompt back, and its phases (rendezvous None: the
        inventory leaves it to cluster's default)."""
        inv = self.inventory(n, **({"rendezvous": rendezvous} if rendezvous else {}))
        stamps = self.stamped()
        t0 = time.time()
        r = subprocess.run([sys.executable, "-m", "cluster", "up", "-i", inv, "--sync", str(prog),
                            "--", "trivial.py", str(stamps)], cwd=self.work,
                           env=self.env_of(code), capture_output=True, text=True)
        t_end = time.time()
        if r.returncode != 0:
            raise SystemExit(f"cluster up failed:\n{r.stderr[-2000:]}")
        run_dir = sorted((self.work / "runs").iterdir())[-1]
        return t_end - t0, phases.cluster_phases(t0, t_end, run_dir, phases.of_stamps(stamps))

    def launch_bare(self, n: int, port: int) -> tuple[float, dict]:
        """torchrun on every node over an ssh loop (the program synced there already)."""
        master, stamps = self.addrs[0], self.stamped()
        t0 = time.time()
        procs = [subprocess.Popen(self.sn.ssh_argv(i, (
            f"cd {self.sn.workdir(i)} && {self.sn.python} -m torch.distributed.run --nnodes={n} "
            f"--nproc_per_node=1 --rdzv_backend=c10d --rdzv_endpoint={master}:{port} "
            f"--rdzv_id=bench{port} --local_addr={self.addrs[i - 1]} trivial.py {stamps}")),
            env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            for i in range(1, n + 1)]
        codes = [p.wait() for p in procs]
        t_end = time.time()
        if any(codes):
            raise SystemExit(f"bare torchrun failed: {codes}: {procs[0].stderr.read()[-1000:]}")
        return t_end - t0, phases.bare_phases(t0, t_end, phases.of_stamps(stamps))

    # -- teardown -----------------------------------------------------------------------------

    def teardown(self, n: int, how: str, real_torchrun: bool, prog: Path | None,
                 code: str = "cluster") -> float:
        """Seconds from kill -9 of one worker (how='kill') or SIGINT to `cluster up`
        (how='ctrl-c') until no process but sshd's is left in any node's namespace.
        prog: a folder synced to every node first (None: the template needs nothing)."""
        inv = self.inventory(n)
        program = ["allreduce.py", "--sleep", "600"] if real_torchrun else ["agent.py"]
        cmd = [sys.executable, "-m", "cluster", "up", "-i", inv,
               *(["--sync", str(prog)] if prog else []),
               *([] if real_torchrun else ["--templates", str(self.tpl_agent)]), "--", *program]
        proc = subprocess.Popen(cmd, cwd=self.work, env=self.env_of(code), stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True, start_new_session=True)
        ready, seen = ("sleeping" if real_torchrun else "worker"), 0
        for line in proc.stdout:
            seen += ready in line
            if seen == n:
                break
        victim = self.worker_pid(n, real_torchrun) if how == "kill" else 0
        t0 = time.monotonic()
        if how == "kill":
            os.kill(victim, signal.SIGKILL)
        else:
            os.kill(proc.pid, signal.SIGINT)
        while left := self.left_anywhere():
            if time.monotonic() - t0 > 120:
                raise SystemExit(f"teardown: still running after 120 s: {left[:5]}")
            time.sleep(0.02)
        took = time.monotonic() - t0
        try:                         # the launcher's own end: its records, the run's timeline
            proc.wait(300)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise SystemExit(f"teardown: every node clean after {took:.2f} s, but the launcher "
                             f"had not exited 300 s later") from None
        self.exited = time.monotonic() - t0
        return took

    def worker_pid(self, n: int, real_torchrun: bool) -> int:
        """A worker on the last node (not torchrun, not the supervisor): with torchrun, the
        process that carries its rank variables. Not by the script's name: the node's
        supervisor has it on its command line too (the check's --script), and until
        2026-12-06 this took the supervisor, the lowest pid, for the worker."""
        for pid_cmd in self.left(n):
            pid, cmd = pid_cmd.split(" ", 1)
            if (real_torchrun and "allreduce.py" in cmd and rank_of(int(pid))) or \
                    (not real_torchrun and "time.sleep(600)" in cmd):
                return int(pid)
        raise SystemExit(f"no worker found on node{n}: {self.left(n)}")

    def left(self, node: int) -> list[str]:
        from tests.integration.conftest import run_processes_in
        return run_processes_in(self.sn, node)

    def left_anywhere(self) -> list[int]:
        """Every process in any node's namespace but sshd's: one pass over /proc for all the
        nodes (a pass per node is N passes, and at 64 nodes the looking slowed what it timed)."""
        out = []
        for pid in self.sn.network.processes_in():
            try:
                if Path(f"/proc/{pid}/comm").read_text().strip() != "sshd":
                    out.append(pid)
            except OSError:
                continue
        return out


def rank_of(pid: int) -> bool:
    """pid carries torchrun's worker variables (GROUP_RANK and RANK)."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
    return any(v.startswith(b"GROUP_RANK=") for v in env) and any(v.startswith(b"RANK=") for v in env)


class Peak(threading.Thread):
    """The most threads a process had, and the least memory the machine had available,
    sampled from /proc."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.threads, self.done = pid, 0, threading.Event()
        self.available_mb = available_mb()
        self.start()

    def run(self) -> None:
        while not self.done.wait(0.05):
            self.available_mb = min(self.available_mb, available_mb())
            try:
                for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                    if line.startswith("Threads:"):
                        self.threads = max(self.threads, int(line.split()[1]))
            except OSError:
                return

    def stop(self) -> None:
        self.done.set()


def available_mb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    return 0.0


# The lightest stand-in for a stop at scale: no Python besides the node's supervisor.
SHELL_AGENT = "echo worker $$\nexec sleep 600\n"


def scale(n: int, results: dict) -> None:
    """One launch at n nodes (the most this machine holds): fan-out against pdsh, the
    launcher's memory, threads and CPU, the nodes' CPU and the machine's memory at its
    lowest; then a Ctrl-C stop of n nodes running a shell stand-in, to every node clean."""
    from tests.integration.fixtures import SshNodes
    # Past about 500 nodes on one segment the kernel's neighbour (ARP) table overflows at its
    # defaults (gc_thresh3 1024, pruned from gc_thresh2 512): nodes answer "no route to host"
    # or time out. A launcher host of 1,000 nodes on one L2 network needs the same.
    neigh = Path("/proc/sys/net/ipv4/neigh/default")
    saved = {k: (neigh / k).read_text() for k in ("gc_thresh1", "gc_thresh2", "gc_thresh3")}
    for k, v in (("gc_thresh3", 4 * n + 1024), ("gc_thresh2", 2 * n + 512), ("gc_thresh1", n)):
        (neigh / k).write_text(str(max(v, int(saved[k]))))
    try:
        scale_run(n, results, SshNodes)
    finally:
        for k in ("gc_thresh1", "gc_thresh2", "gc_thresh3"):
            (neigh / k).write_text(saved[k])


def scale_run(n: int, results: dict, SshNodes) -> None:
    t0 = time.monotonic()
    with SshNodes(n, max_sessions=50) as sn:
        up = time.monotonic() - t0
        b = Bench(sn, Path(tempfile.mkdtemp(prefix="cluster-bench-")))
        free0 = available_mb()
        took, f = b.fanout_cluster(n)
        ptook, pcpu, pnodes = b.fanout_pdsh(n)
        print(f"scale {n} nodes ({up:.0f} s to bring up, {free0 / 1024:.1f} GiB available then): "
              f"cluster {took:.1f} s, pdsh {ptook:.1f} s, cluster/pdsh {took / ptook:.2f}; "
              f"launcher {f['rss_mb']:.0f} MB peak RSS, {f['threads']} threads "
              f"({f['threads'] / n:.2f} per node), {f['cpu_s']:.1f} s CPU "
              f"({1000 * f['cpu_s'] / n:.1f} ms per node; pdsh's ssh clients {1000 * pcpu / n:.1f}); "
              f"nodes' CPU {1000 * f['node_cpu_s'] / n:.0f} ms per node (pdsh's {1000 * pnodes / n:.0f}); "
              f"machine memory available at its lowest {f['available_mb'] / 1024:.1f} GiB; "
              f"phases {f['timings']}", flush=True)
        b.tpl_agent = b.tmp / "tpl-shell"
        b.tpl_agent.mkdir()
        (b.tpl_agent / "node.sh.j2").write_text(SHELL_AGENT)
        stop = b.teardown(n, "ctrl-c", False, None)
        print(f"scale {n} nodes: Ctrl-C, shell stand-in: {stop:.2f} s to every node clean, "
              f"the launcher exited at {b.exited:.2f} s", flush=True)
        results["scale"][n] = {"cluster": took, "pdsh": ptook, "pdsh_cpu": pcpu,
                               "pdsh_node_cpu": pnodes, "launcher": f, "stop_ctrl_c": stop,
                               "launcher_exited": b.exited,
                               "bring_up": up, "available_before_mb": free0}


def fanout(sizes: list[int], repeats: int, results: dict) -> None:
    from tests.integration.fixtures import SshNodes
    for n in sizes:
        with SshNodes(n, max_sessions=50) as sn:
            b = Bench(sn, Path(tempfile.mkdtemp(prefix="cluster-bench-")))
            ours: dict[str, list[float]] = {c: [] for c in ROOTS}
            facts: dict[str, list[dict]] = {c: [] for c in ROOTS}
            failed: dict[str, list[str]] = {c: [] for c in ROOTS}
            for code in ROOTS:
                attempt(b, n, code, failed)          # warm-up: workdirs, host keys, caches
            pdsh, pdsh_cpu, pdsh_nodes, loop = [], [], [], []
            for _ in range(repeats):
                for code in ROOTS:
                    if (got := attempt(b, n, code, failed)) is not None:
                        ours[code].append(got[0])
                        facts[code].append(got[1])
                took, cpu, nodes = b.fanout_pdsh(n)
                pdsh.append(took)
                pdsh_cpu.append(cpu)
                pdsh_nodes.append(nodes)
                loop.append(b.fanout_ssh_loop(n))
            for code in ROOTS:
                if failed[code]:
                    print(f"fanout {n:4d} nodes: {code} FAILED {len(failed[code])} of "
                          f"{repeats + 1} launches: {failed[code][0][-300:]}", flush=True)
                if ours[code] and (code == "cluster" or ours["cluster"]):
                    fanout_line(n, code, ours, facts[code], pdsh, pdsh_cpu, loop)
                    node_line(n, code, facts[code], pdsh_nodes)
            sessions = b.sessions_cluster(n)
            def per(kind: str) -> str:      # "1 on 31 nodes, 2 on 1"
                counts: dict[int, int] = {}
                for c in sessions.values():
                    counts[c[kind]] = counts.get(c[kind], 0) + 1
                return ", ".join(f"{k} on {v}" for k, v in sorted(counts.items()))
            print(f"fanout {n:4d} nodes: per node, SSH commands: {per('exec')}; SFTP sessions: "
                  f"{per('sftp')}", flush=True)
            results["fanout"][n] = {"cluster": ours["cluster"], "pdsh": pdsh, "pdsh_cpu": pdsh_cpu,
                                    "pdsh_node_cpu": pdsh_nodes,
                                    "ssh_loop": loop, "launcher": facts["cluster"],
                                    "sessions": sessions,
                                    **({"before": ours["before"], "launcher_before": facts["before"]}
                                       if "before" in ROOTS else {})}


def attempt(b: Bench, n: int, code: str, failed: dict[str, list[str]]) -> tuple[float, dict] | None:
    """One fan-out launch; a launch that fails is counted, not fatal (the code before a
    change may fail where this code does not, or the other way round)."""
    try:
        return b.fanout_cluster(n, code)
    except SystemExit as exc:
        failed[code].append(str(exc).replace("\n", " "))
        return None


def node_line(n: int, code: str, facts: list[dict], pdsh_nodes: list[float]) -> None:
    ours = statistics.median(x["node_cpu_s"] for x in facts)
    theirs = statistics.median(pdsh_nodes)
    print(f"fanout {n:4d} nodes: {code} node CPU {1000 * ours / n:.0f} ms per node (pdsh's "
          f"{1000 * theirs / n:.0f} ms), with the launcher's {1000 * statistics.median(x['cpu_s'] for x in facts) / n:.0f} ms: "
          f"{1000 * (ours + statistics.median(x['cpu_s'] for x in facts)) / n:.0f} ms of CPU per node in all", flush=True)


def fanout_line(n: int, code: str, ours: dict[str, list[float]], facts: list[dict],
                pdsh: list[float], pdsh_cpu: list[float], loop: list[float]) -> None:
    ratio = statistics.median(ours[code]) / statistics.median(pdsh)
    cpu = statistics.median(x["cpu_s"] for x in facts)
    threads = max(x["threads"] for x in facts)
    f = facts[len(facts) // 2]
    versus = ""
    if code != "cluster":
        versus = f"  this code / {code} {statistics.median(ours['cluster']) / statistics.median(ours[code]):.2f}"
    print(f"fanout {n:4d} nodes: {code} {stats(ours[code])}  pdsh {stats(pdsh)}  "
          f"ssh loop {stats(loop)}  {code}/pdsh {ratio:.2f}{versus}  launcher: "
          f"{max(x['rss_mb'] for x in facts):.0f} MB peak RSS, {threads} threads "
          f"({threads / n:.2f} per node), {cpu:.1f} s CPU ({1000 * cpu / n:.1f} ms per node; pdsh "
          f"and its ssh clients: {statistics.median(pdsh_cpu):.1f} s, ratio "
          f"{cpu / statistics.median(pdsh_cpu):.2f}); phases {f['timings']}", flush=True)


def launch(sizes: list[int], repeats: int, results: dict) -> None:
    """Launch to done, cluster (its default, the static rendezvous; and c10d, which the bare
    loop uses; with --before, that code's c10d too) against bare torchrun over an ssh loop,
    interleaved; each one's phases (bench/phases.py), their medians as a table."""
    from tests.integration.fixtures import SshNodes
    for n in sizes:
        with SshNodes(n) as sn:
            b = Bench(sn, Path(tempfile.mkdtemp(prefix="cluster-bench-")))
            prog = b.tmp / "prog"
            prog.mkdir()
            (prog / "trivial.py").write_text(phases.STAMPS)
            b.launch_cluster(n, None, prog)          # warm-up, and syncs trivial.py
            kinds = ["cluster", *(f"cluster c10d ({c})" if c != "cluster" else "cluster c10d"
                                  for c in ROOTS), "bare torchrun"]
            took: dict[str, list[float]] = {k: [] for k in kinds}
            split: dict[str, list[dict]] = {k: [] for k in kinds}
            for k in range(repeats):
                for kind in kinds:
                    if kind == "bare torchrun":
                        t, ph = b.launch_bare(n, 29400 + k)
                    elif kind == "cluster":
                        t, ph = b.launch_cluster(n, None, prog)
                    else:
                        t, ph = b.launch_cluster(n, "c10d", prog,
                                                 "cluster" if kind == "cluster c10d" else "before")
                    took[kind].append(t)
                    split[kind].append(ph)
            bare = statistics.median(took["bare torchrun"])
            print(f"launch {n:2d} nodes: " + "  ".join(f"{k} {stats(v)}" for k, v in took.items())
                  + f"  cluster/bare {statistics.median(took['cluster']) / bare:.3f}"
                  + f"  cluster c10d/bare {statistics.median(took['cluster c10d']) / bare:.3f}",
                  flush=True)
            print(f"\nlaunch to done, {n} nodes, median seconds of {repeats} (bench/phases.py):\n"
                  + phases.table(split) + "\n", flush=True)
            results["launch"][n] = {"took": took, "phases": split}


def teardown(sizes: list[int], repeats: int, results: dict, kinds: set[str] | None = None) -> None:
    from tests.integration.fixtures import SshNodes
    programs = ROOT / "tests" / "integration" / "programs"
    for n in sizes:
        with SshNodes(n) as sn:
            b = Bench(sn, Path(tempfile.mkdtemp(prefix="cluster-bench-")))
            prog = b.tmp / "prog"
            shutil.copytree(programs, prog)
            (prog / "agent.py").write_text(STAND_IN_AGENT)
            b.tpl_agent = b.tmp / "tpl-agent"
            b.tpl_agent.mkdir()
            (b.tpl_agent / "node.sh.j2").write_text(
                "cd {{ host.workdir | shpath }}\nexec {{ host.python | shpath }} -u agent.py\n")
            row = {}
            for label, how, real in (("kill -9, torchrun", "kill", True),
                                     ("Ctrl-C, torchrun", "ctrl-c", True),
                                     ("kill -9, stand-in agent", "kill", False),
                                     ("Ctrl-C, stand-in agent", "ctrl-c", False)):
                if (real and n > 16) or (kinds and f"{how}-{'torchrun' if real else 'agent'}" not in kinds):
                    continue
                times: dict[str, list[float]] = {c: [] for c in ROOTS}
                exits: dict[str, list[float]] = {c: [] for c in ROOTS}
                for _ in range(repeats):
                    for code in ROOTS:
                        times[code].append(b.teardown(n, how, real, prog, code))
                        exits[code].append(b.exited)
                for code in ROOTS:
                    row[label if code == "cluster" else f"{label} ({code})"] = times[code]
                    print(f"teardown {n:2d} nodes, {label:24s}: {code} {stats(times[code])} to "
                          f"every node clean, {stats(exits[code])} to the prompt", flush=True)
            results["teardown"][n] = row


def plot(results: dict, path: str) -> None:
    """The fan-out against N (also from a --json file: python -c 'import json, bench.launch
    as b; r = json.load(open(F)); r["fanout"] = {int(k): v for k, v in r["fanout"].items()};
    b.plot(r, "out.png")')."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    data = results["fanout"]
    sizes = sorted(data)
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (("cluster", "cluster up"), ("before", "cluster up, the code before"),
                       ("pdsh", "pdsh -R ssh -f 64"), ("ssh_loop", "ssh loop (&)")):
        shown = [n for n in sizes if data[n].get(key)]
        if shown:
            ax.plot(shown, [statistics.median(data[n][key]) for n in shown], marker="o",
                    label=label, linestyle="--" if key == "before" else "-")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("nodes")
    ax.set_ylabel("seconds until every node ran its script")
    ax.set_title("Fan-out on fake nodes (2 cores, one sshd per namespace)")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def compiled(root: Path) -> None:
    """Every module of that tree compiled (__pycache__), as an installed launcher has them: a
    tree without them compiles its modules at every launch (about 0.1 s here), which is what
    a shell with PYTHONDONTWRITEBYTECODE set would measure."""
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(root / "cluster")], check=True,
                   stdout=subprocess.DEVNULL)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fanout", default="8,32,128,256")
    ap.add_argument("--launch", default="3,8")
    ap.add_argument("--teardown", default="8,64")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip", default="", help="comma-separated: fanout,launch,teardown")
    ap.add_argument("--teardown-kinds", default="", help="comma-separated, of kill-torchrun, "
                    "ctrl-c-torchrun, kill-agent, ctrl-c-agent (default: all)")
    ap.add_argument("--plot", default="bench/results/launch-fanout.png")
    ap.add_argument("--json", default="", help="write the raw results here")
    ap.add_argument("--scale", default="", help="node counts for one launch and one stop "
                    "each at the most this machine holds (e.g. 1000)")
    ap.add_argument("--before", default="", help="a checkout of the code before a change "
                    "(git worktree add DIR COMMIT), measured A B A B beside this one")
    args = ap.parse_args()
    if args.before:
        ROOTS["before"] = Path(args.before).resolve()
    if os.geteuid() != 0 or not shutil.which("pdsh"):
        print("needs root and pdsh (apt-get install pdsh)", file=sys.stderr)
        return 2
    os.environ.setdefault("CLUSTER_TEST_PYTHON", "/opt/cluster-venv/bin/python")
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))     # 256 sshds and their sockets
    skip = set(args.skip.split(","))
    for root in ROOTS.values():
        compiled(root)
    results: dict = {"fanout": {}, "launch": {}, "teardown": {}, "scale": {}}
    sizes = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    if "fanout" not in skip:
        fanout(sizes(args.fanout), args.repeats, results)
        if args.plot:
            plot(results, args.plot)
    if "launch" not in skip:
        launch(sizes(args.launch), args.repeats, results)
    if "teardown" not in skip:
        teardown(sizes(args.teardown), args.repeats, results,
                 set(filter(None, args.teardown_kinds.split(","))))
    for n in sizes(args.scale):
        scale(n, results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
