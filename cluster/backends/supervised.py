"""What the local and SSH backends share: each node runs cluster/remote/supervisor.py, reached
through a Transport (backends/transport.py: a subprocess here, an SSH connection there) by one
way onto a node (backends/shipping.py).

Per node, check() probes the node and makes its run directory, by the process that start()
then makes the node's supervisor (backends/node.py); stop() asks it to stop the run.
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import BackendError, ClusterError, PreflightError
from ..plan import LaunchPlan, NodePlan, render
from ..runs import RunDir
from ..spec import DEFAULT_STOP_GRACE, Host, Inventory
from ..nodes import NodeStatus, node_row, unreachable_error
from . import shipping
from .node import SupervisedNode, SupervisedProcess
# The transport contract (transports, --sync and pull import it from .transport itself).
from .transport import Channel, Result, Transport

if TYPE_CHECKING:
    from ..plan import Job, Templates
    from . import NodeProcess

__all__ = ["Channel", "Result", "SupervisedBackend", "SupervisedNode", "SupervisedProcess",
           "Transport"]


# progress(phase, done, total): a phase that waits on every node ("check", "sync") has
# `done` of its `total` nodes finished. Called from the pool's threads as each node finishes.
Progress = Callable[[str, int, int], None]


def listen_seconds(nodes: int) -> float:
    """How long the master port's listener may stay, at most, while every node's probe
    connects (the launcher closes it as soon as the check ends): 90 s, and a second more per
    8 nodes, since at 1,000 nodes the check of this test bed's 2 cores took 112 s and a flat
    90 s refused the last 124 nodes."""
    return 90.0 + nodes / 8


# Seconds a lost node's `true` may take once it takes a login again.
ANSWER_TIMEOUT = 10.0


class SupervisedBackend:
    """Check all, then start all, over one Transport per node (made by `connect`).

    keepalive: seconds a started node's supervisor waits for the launcher's heartbeat before
    it stops the node by itself (0: it waits for its connection to close instead).
    progress: told as each node finishes the check (and the sync), for a progress line
    (console.NodeProgress); may also be set as an attribute after construction."""

    name = "supervised"

    def __init__(self, connect: Callable[[Any], Transport], max_workers: int = 64,
                 keepalive: float = 0.0, progress: Progress | None = None) -> None:
        self._connect = connect
        self.progress = progress
        self._transports: dict[str, Transport] = {}
        self._nodes: dict[str, SupervisedNode] = {}
        self._pool = ThreadPoolExecutor(max_workers=max_workers)
        self.keepalive = keepalive
        self._beating: list[SupervisedProcess] = []
        self._closed = threading.Event()
        # Files a job runs that each node's check brings into <workdir>/.cluster/tools, by
        # name (cluster doctor's collective program).
        self.tools: dict[str, bytes] = {}

    def transport(self, host: Host) -> Transport:
        if host.name not in self._transports:
            self._transports[host.name] = self._connect(host)
        return self._transports[host.name]

    def answers(self, host: Host) -> bool:
        """Whether `host` takes a login now, on a connection of its own (the kept one may have
        died with the node): the look at a lost node (cluster.recovery.grow). One that answers
        replaces the kept connection, for the next check."""
        fresh = self._connect(host)
        try:
            fresh.open()
            ok = fresh.run("true", timeout=ANSWER_TIMEOUT).code == 0
        except Exception:  # whatever the login raises: the node is not back
            ok = False
        if not ok or self._closed.is_set():        # closed meanwhile: the run is over
            _quietly(fresh.close)
            return False
        old = self._transports.pop(host.name, None)
        self._transports[host.name] = fresh
        if old is not None:
            self._pool.submit(_quietly, old.close)   # may wait on a dead link: not here
        return True

    def open_all(self, hosts: Sequence[Host]) -> None:
        """Connect to every host now, in the background (the pool), while the launcher renders
        and records the plan: the nodes' side of each login (sshd's fork, key exchange,
        authentication) runs beside the launcher's own work instead of after it. A failure is
        kept by its transport and raised, unchanged, where the check first uses it."""
        for host in hosts:
            self._pool.submit(_quietly, self.transport(host).open)

    def check(self, plan: LaunchPlan, *, reach: bool = False,
              ready: Callable[[NodePlan], None] | None = None) -> dict[str, dict[str, Any]]:
        """Phase one on every node at once: connect, make the run directory, say what the
        node has, by the process that start() will make the node's supervisor
        (SupervisedNode.stage). With reach, the same process opens a TCP connection to the
        master port, where the master's own probe listens from its first moment until its
        start; that listener's binding is the master's port check. Raises PreflightError naming every node that could not be
        reached or checked, and lets every staged process go: nothing starts.
        ready(node), with reach: work of the node's own done on its thread while its probe
        runs, before the probe's word (after which it looks for the job's script): the SSH
        backend's --sync. Its ClusterError is that node's failure."""
        self.release()
        self._nodes = {n.host.name: SupervisedNode(self.transport(n.host), n.host.python,
                                                   n.run_dir, n.host.setup)
                       for n in plan.nodes}
        listening = threading.Event()
        state: dict[str, Any] = {}

        def heard(said: dict[str, Any]) -> None:
            state.update(said)
            listening.set()

        failed: dict[str, ClusterError] = {}

        def word_of(node: NodePlan) -> Callable[[], str]:
            def word() -> str:
                if ready is not None:
                    try:
                        ready(node)
                    except ClusterError as exc:
                        failed[node.host.name] = exc
                listening.wait(120)
                ok = state.get("listening") and node.host.name not in failed
                return "connect" if ok else "skip"
            return word

        def one(node: NodePlan) -> dict[str, Any]:
            remote = self._nodes[node.host.name]
            if not reach:
                return remote.stage(node, plan, port=node is plan.master, tools=self.tools)
            if node is not plan.master:
                facts = remote.stage(node, plan, connect=(plan.master_addr, plan.master_port),
                                     tools=self.tools, word=word_of(node))
            else:
                try:          # the master's own probe listens on the port, first thing
                    facts = remote.stage(node, plan, connect=(plan.master_addr, plan.master_port),
                                         tools=self.tools, word=word_of(node), heard=heard,
                                         listen=(plan.master_port, listen_seconds(len(plan.nodes))))
                finally:
                    listening.set()      # a master that failed first lets no node wait for it
                facts["port_free"] = bool(state.get("listening"))
            if node.host.name in failed:
                raise failed[node.host.name]
            return facts
        try:
            results = self.each_or_fail(plan.nodes, one, phase="check")
        except ClusterError:
            self.discard()
            raise
        return {n.host.name: r for n, r in results}

    def spawn_program(self, host: Host, program: str, *args: str) -> Channel:
        """A node-side program of cluster/remote (shipping.PROGRAMS) started on host with its
        python, its bundle sent first on the channel; the channel is then the program's own."""
        return self._node_of(host).spawn(shipping.program(program, *args))

    def run_program(self, host: Host, program: str, *args: str, timeout: float = 120) -> Result:
        """The same, for a program that answers and ends: one round trip."""
        return self._node_of(host).run(shipping.program(program, *args), timeout=timeout)

    def _node_of(self, host: Host) -> SupervisedNode:
        """host as a node that runs programs (its run directory is not needed for them)."""
        return SupervisedNode(self.transport(host), host.python, "", host.setup)

    def release(self) -> None:
        """Every staged node that will not start lets go (prepare failed, or is trying again)."""
        for remote in self._nodes.values():
            remote.release()

    def discard(self) -> None:
        """Every staged node lets go and removes the run folder its check made (the launch
        failed its check: nothing of it stays on the nodes), all at once."""
        staged = [remote for remote in self._nodes.values() if remote.staged is not None]
        self.each(staged, lambda remote: remote.discard())

    def probe_node(self, node: NodePlan, plan: LaunchPlan, *, deep: bool = False,
                   make_dir: bool = True) -> dict[str, Any]:
        """One node's facts, nothing left running (cluster doctor); raises ClusterError."""
        remote = SupervisedNode(self.transport(node.host), node.host.python, node.run_dir,
                                node.host.setup)
        self._nodes[node.host.name] = remote
        return remote.probe(node, plan, deep=deep, make_dir=make_dir, port=node is plan.master)

    def reach(self, plan: LaunchPlan, timeout: float = 8.0) -> dict[str, dict[str, Any]]:
        """Whether every node can open a TCP connection to the master port: a listener there
        for the moment of the check, a connect from each node (after check())."""
        master = self._nodes[plan.master.host.name]
        listener = master.listen(plan.master_port, seconds=timeout + 60)
        try:
            results = self.each(plan.nodes, lambda n: self._nodes[n.host.name].connect(
                plan.master_addr, plan.master_port, timeout))
        finally:
            listener.close()
        return {n.host.name: (r if not isinstance(r, Exception) else {"ok": False, "error": str(r)})
                for n, r in results}

    def each_or_fail(self, nodes: Any, fn: Callable[[Any], Any],
                     phase: str | None = None) -> list[tuple[Any, Any]]:
        """A check on every node at once; if any fails, one PreflightError listing each."""
        results = self.each(nodes, fn, phase=phase)
        failures = {n.label: str(r) for n, r in results if isinstance(r, Exception)}
        if failures:
            lines = "\n".join(f"  {label}: {why}" for label, why in failures.items())
            ok = len(nodes) - len(failures)
            error = PreflightError(f"{len(failures)} of {len(nodes)} node(s) failed the checks; "
                                   f"nothing was started ({ok} ready)", details=lines)
            error.nodes = [n.host.name for n, r in results if isinstance(r, Exception)]
            raise error
        return results

    def plan(self, inventory: Inventory, job: Job, templates: Templates,
             ifnames: Mapping[str, str] | None = None) -> LaunchPlan:
        return render(inventory, job, templates, ifnames)

    def started(self, plan: LaunchPlan, procs: list[NodeProcess], run: RunDir | None) -> dict[str, Any]:
        """What run.json keeps of the start: each node's process group (known once a
        detached start returns, or once an attached supervisor's first line arrived)."""
        return {"pgids": {n.host.name: getattr(p, "pgid", p) for n, p in zip(plan.nodes, procs)}}

    def ended(self, plan: LaunchPlan, procs: list[NodeProcess], result: object) -> dict[str, Any]:
        """The start's record, and how each stopped node's stop went, in its supervisor's
        last word: "term" (every process ended within the grace) or "kill" (after it)."""
        stops = {n.host.name: p.final["how"] for n, p in zip(plan.nodes, procs)
                 if isinstance(p, SupervisedProcess) and p.final and p.final.get("how")}
        return {**self.started(plan, procs, None), **({"stops": stops} if stops else {})}

    def start_note(self, procs: list[NodeProcess], plan: LaunchPlan) -> str:
        return (f"run {plan.run_id}: starting {len(plan.nodes)} node(s), master "
                f"{plan.master_addr}:{plan.master_port}")

    def start(self, plan: LaunchPlan, *, detach: bool = False,
              secrets: Mapping[str, Mapping[str, str]] | None = None,
              run: RunDir | None = None) -> list[NodeProcess]:
        """Start every node; if one cannot be started, stop the ones that were (attached or
        detached alike) and raise, naming each failure."""
        secrets = secrets or {}

        def one(n: NodePlan) -> Any:
            return self._nodes[n.host.name].start(n, detach, secrets.get(n.host.name, {}),
                                                  plan.stop_grace, self.keepalive)
        results = self.each(plan.nodes, one)
        failed = [(n, r) for n, r in results if isinstance(r, Exception)]
        if failed:
            started = [n for n, r in results if not isinstance(r, Exception)]
            reports = self.each(started, lambda n: self._nodes[n.host.name].stop(plan.stop_grace))
            for proc in (r for _, r in results if isinstance(r, SupervisedProcess)):
                proc.channel.close()       # and EOF: a supervisor still starting stops itself
            left = {n.label: r for n, r in reports
                    if isinstance(r, Exception) or r.get("error") or r.get("left")}
            lines = [f"  {n.label}: {r}" for n, r in failed]
            lines += [f"  {label}: NOT stopped: {r}" for label, r in left.items()]
            outcome = ("the started ones were stopped" if not left
                       else f"{len(left)} started node(s) could NOT be stopped")
            raise BackendError(f"could not start every node; {outcome}", details="\n".join(lines))
        procs = [r for _, r in results]
        if not detach and self.keepalive > 0:
            self._beat(procs)
        return procs

    def _beat(self, procs: list[Any]) -> None:
        """One thread for the whole run sends each node's supervisor a heartbeat a few times per
        keepalive period; a node cut off from it stops itself when they cease."""
        self._beating = [p for p in procs if isinstance(p, SupervisedProcess)]
        interval = max(0.2, self.keepalive / 4)

        def loop() -> None:
            while not self._closed.wait(interval):
                for proc in self._beating:
                    proc.heartbeat()
        threading.Thread(target=loop, daemon=True, name="cluster-heartbeat").start()

    def each(self, nodes: Any, fn: Callable[[Any], Any],
             phase: str | None = None) -> list[tuple[Any, Any]]:
        """fn on every node at once; every node reports (a result or its exception). With a
        phase, self.progress hears of each node as it finishes, failed or not."""
        nodes = list(nodes)
        tick = self._ticker(phase, len(nodes))

        def guard(n: Any) -> Any:
            try:
                return fn(n)
            except ClusterError as exc:
                return exc
            except Exception as exc:  # a node's unexpected failure is still that node's report
                return ClusterError(f"{type(exc).__name__}: {exc}")
            finally:
                tick()
        futures = [(n, self._pool.submit(guard, n)) for n in nodes]
        return [(n, f.result()) for n, f in futures]

    def _ticker(self, phase: str | None, total: int) -> Callable[[], None]:
        """One call per finished node -> progress(phase, done, total); a progress display
        that fails never fails the phase it shows."""
        progress = self.progress
        if progress is None or phase is None:
            return lambda: None
        lock, done = threading.Lock(), [0]

        def tick() -> None:
            with lock:
                done[0] += 1
                try:
                    progress(phase, done[0], total)
                except Exception:  # noqa: BLE001 - a display, never the work
                    pass
        return tick

    # -- recorded runs --

    def stop_run(self, run: RunDir) -> dict[str, dict[str, Any]]:
        grace = float(run.meta().get("stop_grace", DEFAULT_STOP_GRACE))
        nodes = self._recorded_safe(run)
        results = self.each(nodes, lambda rn: rn[1].stop(grace) if rn[1] else {"error": rn[2]})
        return {rn[0]["name"]: (r if not isinstance(r, Exception) else {"error": str(r)})
                for rn, r in results}

    def status(self, run: RunDir) -> list[NodeStatus]:
        nodes = self._recorded_safe(run)
        results = self.each(nodes, lambda rn: rn[1].status() if rn[1] else {"error": rn[2]})
        rows = []
        for (rec, _remote, _err), info in results:
            if isinstance(info, Exception):
                info = {"error": str(info)}
            if "error" in info:
                rows.append(NodeStatus(rec["rank"], rec["name"], "unreachable", detail=info["error"]))
                continue
            rows.append(node_row(rec["rank"], rec["name"], info))
        return rows

    def logs(self, run: RunDir, *, node: str | None = None,
             follow: bool = False) -> Iterator[tuple[str, bytes]]:
        """Saved output node by node; following, every node at once, interleaved as lines
        arrive (one reader per node)."""
        chosen: list[tuple[dict[str, Any], SupervisedNode]] = []
        for rec, remote, err in self._recorded_safe(run):
            if node and rec["name"] != node:
                continue
            if remote is None:
                raise ClusterError(f"{rec['name']} {rec['rank']}: {err}")
            chosen.append((rec, remote))
        if not follow:
            for rec, remote in chosen:
                ch = remote.logs(False)
                while data := ch.read():
                    yield f"{rec['name']} {rec['rank']}", data
                ch.wait()
            return
        # (label, bytes): output; (label, None): that node's end; (label, str): it was lost
        chunks: queue.Queue[tuple[str, bytes | str | None]] = queue.Queue()

        def read(rec: dict[str, Any], remote: SupervisedNode) -> None:
            label = f"{rec['name']} {rec['rank']}"
            end: str | None = "the connection to it was lost"
            try:
                ch = remote.logs(follow)
                while data := ch.read():
                    chunks.put((label, data))
                if ch.wait() is not None:
                    end = None
            except ClusterError as exc:
                end = exc.message
            finally:
                chunks.put((label, end))
        for rec, remote in chosen:
            threading.Thread(target=read, args=(rec, remote), daemon=True).start()
        running = len(chosen)
        while running:
            label, item = chunks.get()
            if isinstance(item, bytes):
                yield label, item
            elif item is None:
                running -= 1
            else:        # the run goes on there or not: nobody can say, so the follow ends
                raise unreachable_error(run.run_id, [label], item)

    def pull(self, run: RunDir, paths: Sequence[str], into: Path,
             node: str | None = None) -> dict[str, Any]:
        """`cluster pull`: PATHs under each recorded node's workdir copied into into/<node>/,
        every node at once; per node its PullResult or its error."""
        from .pull import fetch
        hosts = {h.name: h for h in run.hosts()}
        chosen = [hosts[rec["name"]] for rec in run.meta()["nodes"] if node in (None, rec["name"])]
        results = self.each(chosen, lambda h: fetch(self.transport(h), h.workdir, paths,
                                                    into / h.name))
        return {h.name: r for h, r in results}

    def _recorded_safe(self, run: Any) -> list[tuple[dict[str, Any], SupervisedNode | None, str]]:
        hosts = {h.name: h for h in run.hosts()}
        out: list[tuple[dict[str, Any], SupervisedNode | None, str]] = []
        for rec in run.meta().get("nodes") or []:     # none yet while the run is checked
            host = hosts[rec["name"]]
            try:
                remote = SupervisedNode(self.transport(host), host.python,
                                        rec.get("dir") or rec["run_dir"], host.setup)
                out.append((rec, remote, ""))
            except ClusterError as exc:
                out.append((rec, None, str(exc)))
        return out

    def close(self) -> None:
        self._closed.set()
        self.release()
        for t in self._transports.values():
            try:
                t.close()
            except Exception:
                pass
        self._transports.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)


def _quietly(fn: Callable[[], object]) -> None:
    """fn's failure is its transport's to raise again at the next use (open_all)."""
    try:
        fn()
    except Exception:  # noqa: BLE001 - kept by the transport, reported by the check
        pass
