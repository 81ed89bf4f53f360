"""What the local and SSH backends share: each node runs cluster/remote/supervisor.py, reached
through a Transport (a subprocess here, an SSH connection there), like Fabric's Connection and
Invoke's Context reading the same.

Per node, check() makes the run directory, pushes launch.sh and supervisor.py and probes the
python; start() runs the supervisor and streams its output; stop() asks it to stop the run.
"""
from __future__ import annotations

import json
import queue
import shlex
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from ..errors import BackendError, ClusterError, PreflightError
from ..plan import LaunchPlan, NodePlan, python_command, render, shpath
from ..spec import DEFAULT_STOP_GRACE
from ..nodes import Demux, NodeExit, NodeStatus, end_detail

SUPERVISOR = Path(__file__).resolve().parent.parent / "remote" / "supervisor.py"
WORKERS = SUPERVISOR.with_name("workers.py")      # imported by the supervisor, beside it
FAMILY = SUPERVISOR.with_name("family.py")        # likewise
PROBE = SUPERVISOR.with_name("probe.py")
STAGE = SUPERVISOR.with_name("stage.py")
PGID_HEADER = b"@@cluster pgid="


@dataclass
class Result:
    code: int | None                 # None: the connection broke before an exit status came
    stdout: bytes
    stderr: bytes

    def text(self) -> str:
        return (self.stdout + self.stderr).decode(errors="replace").strip()


class Channel(Protocol):
    def read(self) -> bytes:
        """The next chunk of output; b'' once it has ended."""

    def write(self, data: bytes) -> None:
        """Send bytes to the command's standard input (the supervisor's control channel)."""

    def wait(self) -> int | None:
        """The exit status, or None when the connection was lost."""

    def close(self) -> None: ...


class Transport(Protocol):
    """One node: run a shell command, start a streaming one, write a file, copy files both
    ways (--sync's SyncTarget and `cluster pull`'s PullSource are parts of this)."""
    label: str

    def open(self) -> None:
        """Connect now (otherwise the first use does); raises ClusterError."""

    def run(self, command: str, *, timeout: float | None = None, input: bytes = b"") -> Result: ...

    def spawn(self, command: str) -> Channel: ...

    def put(self, data: bytes, path: str, mode: int) -> None: ...

    def upload(self, local: Path, path: str, mode: int, mtime: int) -> None: ...

    def download(self, path: str, into: BinaryIO) -> int: ...

    def close(self) -> None: ...


class SupervisedNode:
    """One node of a run: its transport, its python and its run directory on that node."""

    def __init__(self, transport: Transport, python: str, run_dir: str,
                 setup: tuple[str, ...] = ()) -> None:
        self.transport = transport
        self.python = python
        self.exe = python_command(python, setup)   # after the host's setup lines, if any
        self.dir = run_dir               # made absolute by the check
        self.staged: Channel | None = None

    def supervisor(self, *args: str) -> str:
        cmd = [self.exe, shlex.quote(f"{self.dir}/supervisor.py")]
        return " ".join(cmd + [shlex.quote(a) for a in args])

    def facts_args(self, node: NodePlan, plan: LaunchPlan, *, port: bool, deep: bool,
                   make_dir: bool, connect: tuple[str, int] | None) -> list[str]:
        args = ["--workdir", node.host.workdir, "--own", node.host.address, "--master", plan.master_addr]
        if make_dir:
            args += ["--dir", self.dir]
        if node.host.network.ifname:
            args += ["--ifname", node.host.network.ifname]
        if port:
            args += ["--port", str(plan.master_port)]
        if node.host.container:
            args += ["--container-runtime", node.host.container.runtime,
                     "--container-image", node.host.container.image]
        if deep:
            args.append("--deep")
        if connect:
            args += ["--connect", f"{connect[0]}:{connect[1]}",
                     "--connect-timeout", f"{reach_budget(len(plan.nodes)):g}"]
        return args

    def probe(self, node: NodePlan, plan: LaunchPlan, *, port: bool = False,
              deep: bool = False, make_dir: bool = True,
              connect: tuple[str, int] | None = None) -> dict[str, Any]:
        """One round trip, nothing left running: make the workdir and the run directory
        (0700), and say what this node has (python, torch, the interface that reaches the
        master; the master port when `port`; doctor's findings when `deep`)."""
        args = self.facts_args(node, plan, port=port, deep=deep, make_dir=make_dir, connect=connect)
        probed = self.transport.run(probe_command(self.exe, "facts", *args), timeout=120,
                                    input=probe_input())
        if probed.code != 0:
            raise self._python_error(probed.code, probed.text())
        return self._facts(probed.stdout.decode().strip().splitlines()[-1])

    def stage(self, node: NodePlan, plan: LaunchPlan, *, port: bool = False,
              connect: tuple[str, int] | None = None) -> dict[str, Any]:
        """The probe, by the process that will become this node's supervisor when start()
        gives the word (cluster/remote/stage.py): one process and one round trip per node for
        the check and the start together. release() lets it go without starting."""
        args = self.facts_args(node, plan, port=port, deep=False, make_dir=True, connect=connect)
        if node.script_file:             # is the job's script there, before anything starts
            args += ["--script", node.script_file]
        ch = self.transport.spawn(stage_command(self.exe, *args))
        ch.write(stage_input())
        said, noise = b"", b""
        while not said.endswith(b"\n"):
            data = ch.read()
            if not data:
                code = ch.wait()
                raise self._python_error(code, (noise + said).decode(errors="replace"))
            said += data
            while b"\n" in said and not said.lstrip().startswith(b"{"):
                line, said = said.split(b"\n", 1)    # a shell's greeting, a setup line's output
                noise += line + b"\n"
        self.staged = ch
        return self._facts(said.decode().strip())

    def release(self) -> None:
        """A staged node that will not start: its process sees the input end and exits."""
        ch, self.staged = self.staged, None
        if ch is not None:
            ch.close()

    def _facts(self, line: str) -> dict[str, Any]:
        facts = json.loads(line)
        for key in ("workdir", "dir"):
            if isinstance(facts.get(key), dict):
                raise ClusterError(facts[key]["error"])
        self.dir = facts.get("dir", self.dir)
        return facts

    def _python_error(self, code: int | None, text: str) -> ClusterError:
        said = [ln for ln in text.splitlines() if ln.startswith("cluster: setup line")]
        if said:
            return ClusterError(said[-1].removeprefix("cluster: "))
        if code == 127 or "No such file" in text:
            return ClusterError(f"python {self.python!r} not found (set 'python:' in the inventory)")
        return ClusterError(f"python {self.python!r} failed: {text.strip()[-500:]}")

    def listen(self, port: int, seconds: float) -> Channel:
        """A short-lived listener on port (as torchrun's store will listen), until the
        returned channel is closed; raises if it cannot listen."""
        ch = self.transport.spawn(probe_command(self.exe, "listen", "--port", str(port),
                                                "--seconds", f"{seconds:g}"))
        ch.write(probe_input())
        said = b""
        while b"listening" not in said and (data := ch.read()):
            said += data                   # the setup lines' output may come first; it ends on error
        if b"listening" not in said:
            ch.close()
            text = said.decode(errors="replace")
            if "cluster: setup line" in text:
                raise self._python_error(None, text)
            last = (text.strip().splitlines() or [""])[-1]     # the program's {"error": ...}
            raise ClusterError(json.loads(last)["error"] if last.startswith('{"error"')
                               else f"cannot listen on port {port}: {text.strip()}")
        return ch

    def connect(self, addr: str, port: int, timeout: float) -> dict[str, Any]:
        res = self.transport.run(probe_command(self.exe, "connect", "--addr", addr, "--port",
                                               str(port), "--timeout", f"{timeout:g}"),
                                 timeout=timeout + 60, input=probe_input())
        return _json_or_error(res)

    def start(self, node: NodePlan, detach: bool, secrets: Mapping[str, str], grace: float,
              keepalive: float) -> "SupervisedProcess | int | None":
        """The word to the staged process: the supervisor, its helper and the node's script,
        then the secret environment (so no value reaches a file or a command line), on the
        channel the check opened."""
        ch, self.staged = self.staged, None
        if ch is None:
            raise ClusterError("the node was not checked in this launch")
        args = ["--run-id", _run_id(node), "--node", node.host.name, "--grace", f"{grace:g}"]
        args += ["--detach"] if detach else ["--keepalive", f"{keepalive:g}"]
        config = (json.dumps({"env": dict(secrets)}) + "\n").encode()
        ch.write(go_input(self.dir, args, node.script.encode(), container_record(node)) + config)
        if not detach:
            return SupervisedProcess(node, self, ch, grace)
        said = b""
        while data := ch.read():
            said += data
        if ch.wait() != 0:
            raise ClusterError(f"start failed: {said.decode(errors='replace').strip()[-500:]}")
        lines = said.decode(errors="replace").strip().splitlines()
        return int(lines[-1]) if lines and lines[-1].isdigit() else None

    def stop(self, grace: float) -> dict[str, Any]:
        res = self.transport.run(self.supervisor("stop", self.dir, "--grace", f"{grace:g}"),
                                 timeout=grace + 60)
        return _json_or_error(res)

    def status(self) -> dict[str, Any]:
        """The supervisor's word; {"state": "gone"} when the run's folder is no longer there
        (cluster clean removed it: nothing of the run can be running from it)."""
        gone = json.dumps({"state": "gone", "reason": f"{self.dir} was removed"})
        command = (f"if [ -d {shpath(self.dir)} ]; then {self.supervisor('status', self.dir)}; "
                   f"else echo {shlex.quote(gone)}; fi")
        return _json_or_error(self.transport.run(command, timeout=60))

    def logs(self, follow: bool) -> Channel:
        return self.transport.spawn(self.supervisor("logs", self.dir, *(["--follow"] if follow else [])))


# The probe's source travels on standard input (its length first, so the input stays open for
# a listener to watch): nothing has to be copied to a node before it is checked.
BOOTSTRAP = ("import sys;n=int(sys.stdin.buffer.readline());"
             "exec(compile(sys.stdin.buffer.read(n),'probe.py','exec'))")


# A node's one process for the check and the start (cluster/remote/stage.py): its source and
# the probe's travel on standard input behind their lengths, read to the byte with os.read.
STAGE_BOOT = ("import os\n"
              "def t(n):\n b=b''\n while len(b)<n:\n  c=os.read(0,n-len(b))\n"
              "  if not c:raise SystemExit(1)\n  b+=c\n return b\n"
              "l=b''\nwhile not l.endswith(b'\\n'):l+=t(1)\n"
              "exec(compile(t(int(l)),'stage.py','exec'))")


def reach_budget(nodes: int) -> float:
    """Seconds each node keeps trying to open a connection to the master port. 8 s finds a
    dropping firewall fast; with hundreds of nodes connecting during the same storm of
    process starts, a SYN lost in the crowd must not fail the launch (two of 256 test nodes
    missed a flat 8 s on 2 cores), so a little more per node."""
    return 8.0 + nodes / 16


# A node-side program and the modules it imports, all on standard input (a JSON line naming
# each module and its length, then their sources, read to the byte): loaded in order, then
# the last one's main(argv) runs. The rest of the input is the program's own (its control).
BUNDLE_BOOT = ("import os,sys,json,types\n"
               "def t(n):\n b=b''\n while len(b)<n:\n  c=os.read(0,n-len(b))\n"
               "  if not c:raise SystemExit(1)\n  b+=c\n return b\n"
               "l=b''\nwhile not l.endswith(b'\\n'):l+=t(1)\n"
               "for n,k in json.loads(l):\n"
               " m=types.ModuleType(n);m.__file__=n+'.py';sys.modules[n]=m\n"
               " exec(compile(t(k),n+'.py','exec'),m.__dict__)\n"
               "sys.exit(m.main(sys.argv[1:]))")
# Each node-side program bundled with what it imports (cluster/remote/).
PROGRAMS = {"execute": ("family", "workers", "supervisor", "execute"),
            "clean": ("family", "workers", "supervisor", "clean")}


def bundle_command(exe: str, program: str, *args: str) -> str:
    """exe: the shell words that run the node's python (plan.python_command)."""
    if program not in PROGRAMS:
        raise ValueError(f"no node-side program {program!r}")
    return " ".join([exe, "-c", shlex.quote(BUNDLE_BOOT), *(shlex.quote(a) for a in args)])


def bundle_input(program: str) -> bytes:
    sources = [(name, (SUPERVISOR.parent / f"{name}.py").read_bytes()) for name in PROGRAMS[program]]
    head = json.dumps([[name, len(src)] for name, src in sources]) + "\n"
    return head.encode() + b"".join(src for _, src in sources)


def stage_command(exe: str, *args: str) -> str:
    return " ".join([exe, "-c", shlex.quote(STAGE_BOOT), *(shlex.quote(a) for a in args)])


def stage_input() -> bytes:
    stage, probe = STAGE.read_bytes(), PROBE.read_bytes()
    return f"{len(stage)}\n".encode() + stage + f"{len(probe)}\n".encode() + probe


def go_input(run_dir: str, args: list[str], script: bytes, box: bytes | None = None) -> bytes:
    """The launcher's word to a staged node: where, the supervisor's arguments, its files
    (with the name of its container, if it runs in one: written before the supervisor runs,
    so that any stop, even one racing the start, finds it)."""
    files = [("supervisor.py", SUPERVISOR.read_bytes(), 0o600),
             ("workers.py", WORKERS.read_bytes(), 0o600), ("family.py", FAMILY.read_bytes(), 0o600),
             ("launch.sh", script, 0o700)]
    if box is not None:
        files.insert(0, ("container.json", box, 0o600))
    head = {"dir": run_dir, "args": args, "files": [[n, len(d), m] for n, d, m in files]}
    return (json.dumps(head) + "\n").encode() + b"".join(d for _, d, _ in files)


def probe_input() -> bytes:
    source = PROBE.read_bytes()
    return f"{len(source)}\n".encode() + source


def probe_command(exe: str, *args: str) -> str:
    """exe: the shell words that run the node's python (plan.python_command)."""
    return " ".join([exe, "-c", shlex.quote(BOOTSTRAP), *(shlex.quote(a) for a in args)])


def container_record(node: NodePlan) -> bytes | None:
    """What the node's supervisor stops its container by: the runtime and the name."""
    if not (node.container and node.host.container):
        return None
    return json.dumps({"runtime": node.host.container.runtime, "name": node.container}).encode()


def _run_id(node: NodePlan) -> str:
    return dict(node.env)["CLUSTER_RUN_ID"]


def _json_or_error(res: Result) -> dict[str, Any]:
    if res.code is None:
        return {"error": "connection lost"}
    try:
        return json.loads(res.stdout.decode().strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"error": res.text()[-500:] or f"exit code {res.code}"}


class SupervisedProcess:
    """A node's supervisor, running and streaming; implements backends.NodeProcess."""

    def __init__(self, node: NodePlan, remote: SupervisedNode, channel: Channel,
                 grace: float) -> None:
        self.node = node
        self.remote = remote
        self.channel = channel
        self.grace = grace
        self.pgid: int | None = None
        self.ended = False
        self.final: dict[str, Any] | None = None     # the supervisor's last word: what was left
        self.closed = threading.Event()               # its stream has ended

    def output(self) -> Iterator[bytes | dict[str, Any]]:
        first, demux = True, Demux()
        try:
            while True:
                data = self.channel.read()
                if not data:
                    return
                if first and data.startswith(PGID_HEADER):
                    head, _, data = data.partition(b"\n")
                    self.pgid = int(head[len(PGID_HEADER):] or 0) or None
                first = False
                for piece in demux.feed(data):
                    if isinstance(piece, dict) and isinstance(piece.get("final"), dict):
                        self.final = piece["final"]
                    else:
                        yield piece
        finally:
            self.closed.set()

    def request_stacks(self) -> None:
        if not self.ended:
            self.channel.write(b"dump\n")

    def wait(self) -> NodeExit:
        code = self.channel.wait()
        self.ended = True
        if code is None:
            return NodeExit(lost=True, reason=f"no exit status from {self.remote.transport.label}")
        if code > 128 and code - 128 < 65:
            return NodeExit(code=code, signal=code - 128)
        return NodeExit(code=code)

    def stop(self) -> dict[str, Any]:
        """The word `stop` on the supervisor's own channel: no new process or round trip on
        the node; its answer is its last record (what was left after TERM, the grace and KILL,
        verified). A channel that is gone or silent gets a stop command of its own instead."""
        if not self.ended and not self.closed.is_set():
            try:
                self.channel.write(b"stop\n")
            except ClusterError:
                pass
            else:
                if self.closed.wait(self.grace + 15) and self.final is not None:
                    return dict(self.final)
        try:
            return self.remote.stop(self.grace)
        except ClusterError as exc:
            return {"error": str(exc)}

    def heartbeat(self) -> None:
        """One beat to the node's supervisor, which stops the node when they cease."""
        if not self.ended:
            try:
                self.channel.write(b"\n")
            except Exception:  # a broken channel shows up in wait(); a beat is best effort
                self.ended = True


# --- the shared backend flow for supervised nodes ---------------------------------------------


# progress(phase, done, total): a phase that waits on every node ("check", "sync") has
# `done` of its `total` nodes finished. Called from the pool's threads as each node finishes.
Progress = Callable[[str, int, int], None]


class SupervisedBackend:
    """Check all, then start all, over one Transport per node (made by `connect`).

    keepalive: seconds a started node's supervisor waits for the launcher's heartbeat before
    it stops the node by itself (0: it waits for its connection to close instead).
    progress: told as each node finishes the check (and the sync), for a progress line
    (console.NodeProgress); may also be set as an attribute after construction."""

    name = "supervised"
    checks_nodes = True      # every node is probed, reached and pushed to before the start

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

    def transport(self, host: Any) -> Transport:
        if host.name not in self._transports:
            self._transports[host.name] = self._connect(host)
        return self._transports[host.name]

    def check(self, plan: LaunchPlan, *, reach: bool = False) -> dict[str, dict[str, Any]]:
        """Phase one on every node at once: connect, make the run directory, say what the
        node has, by the process that start() will make the node's supervisor
        (SupervisedNode.stage). With reach, the same process opens a TCP connection to the
        master port, where a short-lived listener waits meanwhile; the listener's binding is
        the master's port check. Raises PreflightError naming every node that could not be
        reached or checked, and lets every staged process go: nothing starts."""
        self.release()
        self._nodes = {n.host.name: SupervisedNode(self.transport(n.host), n.host.python,
                                                   n.run_dir, n.host.setup)
                       for n in plan.nodes}
        listening = threading.Event()
        state: dict[str, Any] = {}

        def one(node: NodePlan) -> dict[str, Any]:
            remote = self._nodes[node.host.name]
            if not reach:
                return remote.stage(node, plan, port=node is plan.master)
            if node is plan.master:
                try:
                    state["listener"] = remote.listen(plan.master_port, seconds=90)
                except ClusterError as exc:
                    state["busy"] = str(exc)
                finally:
                    listening.set()
            else:
                self.transport(node.host).open()    # the handshake while the listener starts
                listening.wait(120)
            target = None if "busy" in state else (plan.master_addr, plan.master_port)
            facts = remote.stage(node, plan, connect=target)
            if node is plan.master:
                facts["port_free"] = "busy" not in state
            return facts
        try:
            results = self.each_or_fail(plan.nodes, one, phase="check")
        except ClusterError:
            self.release()
            raise
        finally:
            if "listener" in state:
                state["listener"].close()
        return {n.host.name: r for n, r in results}

    def spawn_program(self, host: Any, program: str, *args: str) -> Channel:
        """A node-side program of cluster/remote (PROGRAMS) started on host with its python,
        its source sent first on the channel; the channel is then the program's own."""
        ch = self.transport(host).spawn(bundle_command(python_command(host.python, host.setup), program, *args))
        try:
            ch.write(bundle_input(program))
        except ClusterError:
            pass     # it ended before reading (no such python): its output and status say why
        return ch

    def run_program(self, host: Any, program: str, *args: str, timeout: float = 120) -> Result:
        """The same, for a program that answers and ends: one round trip."""
        return self.transport(host).run(bundle_command(python_command(host.python, host.setup), program, *args),
                                        timeout=timeout, input=bundle_input(program))

    def release(self) -> None:
        """Every staged node that will not start lets go (prepare failed, or is trying again)."""
        for remote in self._nodes.values():
            remote.release()

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

    def push(self, plan: LaunchPlan) -> None:
        """Nothing: each node's files travel with its start, in the same round trip."""

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

    def plan(self, inventory: Any, job: Any, templates: Any,
             ifnames: Mapping[str, str] | None = None) -> LaunchPlan:
        return render(inventory, job, templates, ifnames)

    def started(self, plan: LaunchPlan, procs: list[Any], run: Any) -> dict[str, Any]:
        """What run.json keeps of the start: each node's process group (known once a
        detached start returns, or once an attached supervisor's first line arrived)."""
        return {"pgids": {n.host.name: getattr(p, "pgid", p) for n, p in zip(plan.nodes, procs)}}

    def ended(self, plan: LaunchPlan, procs: list[Any], result: Any) -> dict[str, Any]:
        """The start's record, and how each stopped node's stop went, in its supervisor's
        last word: "term" (every process ended within the grace) or "kill" (after it)."""
        stops = {n.host.name: p.final["how"] for n, p in zip(plan.nodes, procs)
                 if isinstance(p, SupervisedProcess) and p.final and p.final.get("how")}
        return {**self.started(plan, procs, None), **({"stops": stops} if stops else {})}

    def start_note(self, procs: list[Any], plan: LaunchPlan) -> str:
        return (f"run {plan.run_id}: starting {len(plan.nodes)} node(s), master "
                f"{plan.master_addr}:{plan.master_port}")

    def start(self, plan: LaunchPlan, *, detach: bool = False,
              secrets: Mapping[str, Mapping[str, str]] | None = None,
              run: Any = None) -> list[Any]:
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

    def stop_run(self, run: Any) -> dict[str, dict[str, Any]]:
        grace = float(run.meta().get("stop_grace", DEFAULT_STOP_GRACE))
        nodes = self._recorded_safe(run)
        results = self.each(nodes, lambda rn: rn[1].stop(grace) if rn[1] else {"error": rn[2]})
        return {rn[0]["name"]: (r if not isinstance(r, Exception) else {"error": str(r)})
                for rn, r in results}

    def status(self, run: Any) -> list[NodeStatus]:
        nodes = self._recorded_safe(run)
        results = self.each(nodes, lambda rn: rn[1].status() if rn[1] else {"error": rn[2]})
        rows = []
        for (rec, _remote, _err), info in results:
            if isinstance(info, Exception):
                info = {"error": str(info)}
            if "error" in info:
                rows.append(NodeStatus(rec["rank"], rec["name"], "unreachable", detail=info["error"]))
                continue
            detail = end_detail(info)
            rows.append(NodeStatus(rec["rank"], rec["name"], info.get("state", "unknown"),
                                   code=info.get("code"), pid=info.get("pgid"),
                                   uptime=info.get("uptime"), detail=detail))
        return rows

    def logs(self, run: Any, *, node: str | None = None,
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
        chunks: queue.Queue[tuple[str, bytes] | None] = queue.Queue()

        def read(rec: dict[str, Any], remote: SupervisedNode) -> None:
            label = f"{rec['name']} {rec['rank']}"
            try:
                ch = remote.logs(follow)
                while data := ch.read():
                    chunks.put((label, data))
                ch.wait()
            finally:
                chunks.put(None)
        for rec, remote in chosen:
            threading.Thread(target=read, args=(rec, remote), daemon=True).start()
        running = len(chosen)
        while running:
            item = chunks.get()
            if item is None:
                running -= 1
            else:
                yield item

    def pull(self, run: Any, paths: Sequence[str], into: Path,
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
