"""One supervised node (local or SSH): its transport, its python and its run directory, and
the node's supervisor once started (SupervisedProcess, a backends.NodeProcess).

Every program reaches the node the same way (backends/shipping.py): the bootloader on the
command line, a bundle on its input. A launch's check and start are one process and one round
trip per node: stage() runs the probe, which answers and waits; start() sends the run's files
and the supervisor on the same input, or release() ends it.
"""
from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from ..errors import ClusterError
from ..nodes import Demux, NodeExit, read_answer
from ..plan import LaunchPlan, NodePlan, python_command
from ..torchrun_options import restarts_its_workers
from . import shipping
from .transport import Channel, Result, Transport

PGID_HEADER = b"@@cluster pgid="
TOOLS_DIR = ".cluster/tools"      # under the workdir: the files a job runs that cluster brings


def reach_budget(nodes: int) -> float:
    """Seconds each node keeps trying to open a connection to the master port. 8 s finds a
    dropping firewall fast; with hundreds of nodes connecting during the same storm of
    process starts, a SYN lost in the crowd must not fail the launch (two of 256 test nodes
    missed a flat 8 s on 2 cores), so a little more per node."""
    return 8.0 + nodes / 16


class SupervisedNode:
    """One node of a run: its transport, its python and its run directory on that node."""

    def __init__(self, transport: Transport, python: str, run_dir: str,
                 setup: tuple[str, ...] = ()) -> None:
        self.transport = transport
        self.python = python
        self.exe = python_command(python, setup)   # after the host's setup lines, if any
        self.dir = run_dir               # made absolute by the check
        self.staged: Channel | None = None

    def run(self, bundle: shipping.Bundle, timeout: float | None = None) -> Result:
        """A program that answers and ends: one round trip."""
        return self.transport.run(shipping.boot_command(self.exe, bundle), timeout=timeout,
                                  input=bundle.data)

    def spawn(self, bundle: shipping.Bundle) -> Channel:
        """A program that streams; the channel is then the program's own."""
        ch = self.transport.spawn(shipping.boot_command(self.exe, bundle))
        try:
            ch.write(bundle.data)
        except ClusterError:
            pass     # it ended before reading (no such python): its output and status say why
        return ch

    def facts_args(self, node: NodePlan, plan: LaunchPlan, *, port: bool, deep: bool,
                   make_dir: bool, connect: tuple[str, int] | None,
                   on_word: bool = False) -> list[str]:
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
        if deep or plan.gate.level != "off":       # the health gate's facts (remote/health.py)
            args.append("--health")
            if plan.gate.checkpoint_dir:
                args += ["--health-dir", plan.gate.checkpoint_dir]
        if connect:
            args += ["--connect", f"{connect[0]}:{connect[1]}",
                     "--connect-timeout", f"{reach_budget(len(plan.nodes)):g}"]
            args += ["--connect-on-word"] if on_word else []
        return args

    def probe(self, node: NodePlan, plan: LaunchPlan, *, port: bool = False,
              deep: bool = False, make_dir: bool = True,
              connect: tuple[str, int] | None = None) -> dict[str, Any]:
        """One round trip, nothing left running: make the workdir and the run directory
        (0700), and say what this node has (python, torch, the interface that reaches the
        master; the master port when `port`; doctor's findings when `deep`)."""
        args = self.facts_args(node, plan, port=port, deep=deep, make_dir=make_dir, connect=connect)
        probed = self.run(shipping.program("probe", "facts", *args), timeout=120)
        if probed.code != 0:
            raise self._python_error(probed.code, probed.text())
        facts = read_answer(probed.stdout)
        if facts is None:
            raise self._python_error(probed.code, probed.text())
        return self._facts(facts)

    def stage(self, node: NodePlan, plan: LaunchPlan, *, port: bool = False,
              connect: tuple[str, int] | None = None,
              tools: Mapping[str, bytes] | None = None,
              word: Callable[[], str] | None = None,
              listen: tuple[int, float] | None = None,
              heard: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
        """The probe, by the process that will become this node's supervisor when start()
        gives the word: one process and one round trip per node for the check and the start
        together. release() lets it go without starting. tools: files a job runs that
        cluster brings, written into <workdir>/.cluster/tools first (doctor's collective),
        so that the script check finds them. word: with connect, the probe starts at once
        and holds its connect until word() says ('connect' or 'skip'), which may wait for
        the master's listener. listen: (port, seconds) on the master, whose probe listens on
        the port first thing and says so, to heard(), before its word; its listener ends
        when its start comes (probe.handover)."""
        args = self.facts_args(node, plan, port=port, deep=False, make_dir=True, connect=connect,
                               on_word=word is not None)
        if node.script_file:             # is the job's script there, before anything starts
            args += ["--script", node.script_file]
        if listen is not None:
            args += ["--listen", str(listen[0]), "--listen-seconds", f"{listen[1]:g}"]
        files = [(f"{TOOLS_DIR}/{name}", data, 0o600) for name, data in (tools or {}).items()]
        probe = shipping.program("probe", "facts", *args, dir=node.host.workdir, files=files)
        sent = time.time()
        ch = self.transport.spawn(shipping.boot_command(self.exe, probe))
        ch.write(probe.data)
        lines = self._answers(ch)
        if listen is not None:
            said = next(lines)           # {"listening": ...}, before the facts
            if heard is not None:
                heard(said)
        if connect is not None and word is not None:
            try:
                ch.write((word() + "\n").encode())
            except ClusterError:
                pass      # it ended before reading (no such python): its output says why
        facts = next(lines)
        # When this machine asked and had the answer, by its clock: the gate's clock estimate
        # (recovery.gate.clock_offset) from these and the node's own two readings.
        facts["asked"] = {"sent": sent, "received": time.time()}
        self.staged = ch
        return self._facts(facts)

    def _answers(self, ch: Channel) -> Iterator[dict[str, Any]]:
        """The program's answers as they come (framed: nodes.Demux, as the supervisor's
        records); what else it prints, and what comes before them (a shell's greeting, a setup
        line's output, even a line that is a JSON object) is noise, and the end of the output
        raises, with it."""
        demux, noise = Demux(), b""
        while True:
            data = ch.read()
            if not data:
                code = ch.wait()
                raise self._python_error(code, (noise + demux.flush()).decode(errors="replace"))
            for piece in demux.feed(data):
                if isinstance(piece, dict):
                    yield piece
                else:
                    noise += piece

    def release(self) -> None:
        """A staged node that will not start: its process sees the input end and exits."""
        ch, self.staged = self.staged, None
        if ch is not None:
            ch.close()

    def discard(self) -> None:
        """A staged node whose launch failed its check: its process removes the run folder
        the check made (when still empty), then ends; waited for, so that it is gone when
        the launcher says the launch failed."""
        ch, self.staged = self.staged, None
        if ch is None:
            return
        try:
            ch.write(shipping.program("probe", "forget", "--dir", self.dir).data)
        except ClusterError:
            pass                       # it ended already: nothing to wait for
        ch.close()
        ch.wait()

    def _facts(self, facts: dict[str, Any]) -> dict[str, Any]:
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
        listen = shipping.program("probe", "listen", "--port", str(port), "--seconds", f"{seconds:g}")
        ch = self.transport.spawn(shipping.boot_command(self.exe, listen))
        ch.write(listen.data)
        try:
            said = next(self._answers(ch))     # {"listening": true}, or false with the error
        except ClusterError:
            ch.close()
            raise
        if said.get("listening") is not True:
            ch.close()
            raise ClusterError(said.get("error") or f"cannot listen on port {port}: {said}")
        return ch

    def connect(self, addr: str, port: int, timeout: float) -> dict[str, Any]:
        res = self.run(shipping.program("probe", "connect", "--addr", addr, "--port", str(port),
                                        "--timeout", f"{timeout:g}"), timeout=timeout + 60)
        return json_or_error(res)

    def start(self, node: NodePlan, detach: bool, secrets: Mapping[str, str], grace: float,
              keepalive: float) -> "SupervisedProcess | int":
        """The word to the staged process: the run's files and the supervisor, then the secret
        environment (so no value reaches a file or a command line), on the channel the check
        opened."""
        ch, self.staged = self.staged, None
        if ch is None:
            raise ClusterError("the node was not checked in this launch")
        args = ["--run-id", _run_id(node), "--node", node.host.name, "--grace", f"{grace:g}"]
        args += ["--detach"] if detach else ["--keepalive", f"{keepalive:g}"]
        if restarts_its_workers(node.host.torchrun_args):
            args.append("--own-restarts")      # a worker's death is torchrun's to handle
        config = (json.dumps({"env": dict(secrets)}) + "\n").encode()
        ch.write(shipping.start(self.dir, args, node.script.encode(), container_record(node)).data
                 + config)
        if not detach:
            return SupervisedProcess(node, self, ch, grace)
        said = b""
        while data := ch.read():
            said += data
        code = ch.wait()
        text = said.decode(errors="replace").strip()
        lines = text.splitlines()
        if code != 0 or not (lines and lines[-1].isdigit()):
            # no process group: its job never started, whatever the exit status said
            raise ClusterError(f"start failed: {text[-500:] or f'exit code {code}, nothing said'}")
        return int(lines[-1])

    def stop(self, grace: float) -> dict[str, Any]:
        res = self.run(shipping.on_disk(self.dir, "stop", self.dir, "--grace", f"{grace:g}"),
                       timeout=grace + 60)
        if res.code is not None and read_answer(res.stdout) is None:
            older = _bare_json(res.stdout)
            if older is not None:
                return older
        return json_or_error(res)

    def status(self) -> dict[str, Any]:
        """The supervisor's word; {"state": "gone"} when the run's folder is no longer there
        (cluster clean removed it: nothing of the run can be running from it)."""
        said = json_or_error(self.run(shipping.program("status", "--dir", self.dir), timeout=60))
        status = said.get("status", said)
        if status.get("state") == "gone":
            status.setdefault("reason", f"{self.dir} was removed")
        return status

    def logs(self, follow: bool) -> Channel:
        return self.spawn(shipping.on_disk(self.dir, "logs", self.dir, *(["--follow"] if follow else [])))


def container_record(node: NodePlan) -> bytes | None:
    """What the node's supervisor stops its container by: the runtime and the name."""
    if not (node.container and node.host.container):
        return None
    return json.dumps({"runtime": node.host.container.runtime, "name": node.container}).encode()


def _run_id(node: NodePlan) -> str:
    return dict(node.env)["CLUSTER_RUN_ID"]


def _bare_json(stdout: bytes) -> dict[str, Any] | None:
    """The answer of a supervisor that a run's start by an earlier cluster left in the run's
    folder (stop runs it from there): its last line, a bare JSON object."""
    lines = stdout.strip().splitlines()
    try:
        said = json.loads(lines[-1]) if lines else None
    except ValueError:
        return None
    return said if isinstance(said, dict) else None


def json_or_error(res: Result) -> dict[str, Any]:
    if res.code is None:
        return {"error": "connection lost"}
    said = read_answer(res.stdout)
    return said if said is not None else {"error": res.text()[-500:] or f"exit code {res.code}"}


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
        self._first, self._demux = True, Demux()
        self.stop_asked: float | None = None        # when the word `stop` was sent

    def output(self) -> Iterator[bytes | dict[str, Any]]:
        """Its output until it ends, read here (read_ready() is the same for a caller that
        selects over many)."""
        try:
            while (pieces := self.read_ready()) is not None:
                yield from pieces
        finally:
            self.closed.set()

    def fileno(self) -> int:
        return self.channel.fileno()

    def read_ready(self) -> list[bytes | dict[str, Any]] | None:
        """What one read of its channel brings (output bytes and records), or None once it
        has ended; does not block when fileno() is readable."""
        data = self.channel.read()
        if not data:
            if held := self._demux.flush():     # a record cut short by the end: output
                return [held]
            self.closed.set()
            return None
        if self._first and data.startswith(PGID_HEADER):
            head, _, data = data.partition(b"\n")
            self.pgid = int(head[len(PGID_HEADER):] or 0) or None
        self._first = False
        pieces: list[bytes | dict[str, Any]] = []
        for piece in self._demux.feed(data):
            if isinstance(piece, dict) and isinstance(piece.get("final"), dict):
                self.final = piece["final"]
            else:
                pieces.append(piece)
        return pieces

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

    def request_finish(self) -> None:
        """The word `finish`: every worker of every node has exited 0 (supervisor.py). A
        supervisor whose own workers have not all exited 0 passes it over."""
        if not (self.ended or self.closed.is_set()):
            try:
                self.channel.write(b"finish\n")
            except ClusterError:
                pass          # gone already: its exit is on its way

    def request_stop(self) -> bool:
        """The word `stop` on the supervisor's own channel, once: no new process or round
        trip on the node. False when the channel is gone."""
        if self.ended or self.closed.is_set():
            return False
        if self.stop_asked is None:
            try:
                self.channel.write(b"stop\n")
            except ClusterError:
                return False
            self.stop_asked = time.monotonic()
        return True

    def stop(self) -> dict[str, Any]:
        """Asks it to stop (request_stop); its answer is its last record (what was left after
        TERM, the grace and KILL, verified). A channel that is gone or silent gets a stop
        command of its own instead. A node that already reported and ended (its turn in the
        launcher's few stop threads came after its end: at 1,000 nodes most of them) is
        answered by that report, with no new command."""
        if self.closed.is_set() and self.final is not None:
            return dict(self.final)
        if self.request_stop():
            asked = self.stop_asked or time.monotonic()     # the answer is due from then on
            left = asked + self.grace + 15 - time.monotonic()
            if self.closed.wait(max(0.0, left)) and self.final is not None:
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
