"""A run's live metrics in Prometheus's text format (issue 38): a view of the timeline's
events, as goodput and alerts are; nothing is asked of a node for them.

    Metrics       a Recorder's listener (Recorder.listen): each event updates one node's state
                  (or the run's) in O(1) under a small lock of its own; it never blocks
    Collector     prometheus_client's: at each scrape that state is read into families,
                  O(nodes)
    serve()       prometheus_client's HTTP server on a daemon thread, on 127.0.0.1 unless told
                  otherwise, for as long as `cluster up` watches the run (Served.stop)
    write_textfile()  the same names for node_exporter's textfile collector, written at once
                  (a temporary file renamed over it): `cluster status RUN --metrics-textfile`,
                  the way for a detached run, which has no launcher left to serve

The families are made from plain views (RunView, NodeView), whichever source filled them: the
live events here, a detached run's node answers in cluster.observe.top.
"""
from __future__ import annotations

import ipaddress
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:   # imported where used: a launch that serves no metrics never loads it (25 ms)
    from prometheus_client import CollectorRegistry
    from prometheus_client.core import Metric

from ..errors import InputError
from ..texts import address_problem
from . import timeline as tl

# A node's state, each a sample of cluster_node_state (1 for the one it is in, 0 the others).
STARTING, RUNNING, EXITED, FAILED, STOPPED, ASIDE, UNKNOWN = (
    "starting", "running", "exited", "failed", "stopped", "set_aside", "unknown")
STATES = (STARTING, RUNNING, EXITED, FAILED, STOPPED, ASIDE, UNKNOWN)
ENDS = frozenset({EXITED, FAILED, STOPPED, ASIDE})   # a node's end stays until its next start

WINDOW = 30.0          # seconds of beats a node's step rate is measured over
DEFAULT_ADDRESS = "127.0.0.1"
PATH = "/metrics"

Event = dict[str, Any]


# --- the views: what is exported, whoever filled it -----------------------------------------


@dataclass
class NodeView:
    node: str                            # its label, as the timeline's lanes ("gpu-b 1")
    state: str = UNKNOWN
    step: int | None = None              # the furthest step its ranks reported
    step_rate: float | None = None       # steps/s
    work: float | None = None            # its slowest rank's own compute seconds per step
    data: float | None = None            # ... and data-wait seconds per step
    beat_age: float | None = None        # seconds since its last heartbeat
    slow: bool = False                   # named slow in this attempt


@dataclass
class RunView:
    run: str
    nodes: list[NodeView] = field(default_factory=list)
    attempt: int | None = None
    restarts: int | None = None
    goodput: float | None = None          # 0..1, when a reader of it is given
    checkpoint: int | None = None         # the newest checkpoint's step


def families(view: RunView) -> Iterator[Metric]:
    """The metric families of one view; a value nobody knows is left out, never made 0."""
    from prometheus_client.core import GaugeMetricFamily
    labels = ["node", "run"]
    per_node: list[tuple[str, str, str]] = [
        ("step_rate", "cluster_node_step_rate",
         f"Steps per second over the last ~{WINDOW:g} s of the node's heartbeats"),
        ("step", "cluster_node_step", "The furthest step the node's ranks reported"),
        ("work", "cluster_node_work_seconds_per_step",
         "The node's slowest rank's own compute seconds per step"),
        ("data", "cluster_node_data_seconds_per_step",
         "The node's slowest rank's data-wait seconds per step"),
        ("beat_age", "cluster_node_heartbeat_age_seconds",
         "Seconds since the node's last heartbeat")]
    for attr, name, doc in per_node:
        family = GaugeMetricFamily(name, doc, labels=labels)
        for n in view.nodes:
            value = getattr(n, attr)
            if value is not None:
                family.add_metric([n.node, view.run], float(value))
        yield family
    state = GaugeMetricFamily("cluster_node_state", "1 for the state the node is in "
                              f"({', '.join(STATES)}), 0 for the others",
                              labels=["node", "run", "state"])
    slow = GaugeMetricFamily("cluster_node_slow", "1 when the node was named slow in this "
                             "attempt", labels=labels)
    for n in view.nodes:
        for s in STATES:
            state.add_metric([n.node, view.run, s], 1.0 if n.state == s else 0.0)
        slow.add_metric([n.node, view.run], 1.0 if n.slow else 0.0)
    yield state
    yield slow
    yield from _run_families(view)


def _run_families(view: RunView) -> Iterator[Metric]:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    running = sum(n.state == RUNNING for n in view.nodes)
    values: list[tuple[str, str, float | None]] = [
        ("cluster_run_nodes_running", "Nodes in the running state", running),
        ("cluster_run_slow_nodes", "Nodes named slow in this attempt",
         sum(n.slow for n in view.nodes)),
        ("cluster_run_attempt", "The attempt running (0: the first start)", view.attempt),
        ("cluster_run_restarts", "Whole-job restarts so far", view.restarts),
        ("cluster_run_goodput_ratio", "Goodput so far: the share of the run's time spent "
         "making progress (0..1)", view.goodput),
        ("cluster_run_checkpoint_step", "The newest checkpoint's step", view.checkpoint)]
    for name, doc, value in values:
        if value is not None:
            kind = CounterMetricFamily if name == "cluster_run_restarts" else GaugeMetricFamily
            family = kind(name, doc, labels=["run"])
            family.add_metric([view.run], float(value))
            yield family


class Collector:
    """prometheus_client's collector: the families of whatever view `view` makes at scrape."""

    def __init__(self, view: Callable[[], RunView]) -> None:
        self.view = view

    def collect(self) -> Iterator[Metric]:
        return families(self.view())

    def describe(self) -> list[Metric]:
        return []           # the names vary with what is known: nothing to check at register


def registry_of(view: Callable[[], RunView]) -> CollectorRegistry:
    """A registry of its own (never prometheus_client's global one): only the run's families."""
    from prometheus_client import CollectorRegistry
    registry = CollectorRegistry(auto_describe=False)
    registry.register(Collector(view))
    return registry


# --- the live view: the timeline's events -----------------------------------------------------


class _Node:
    __slots__ = ("state", "attempt", "beats", "step", "work", "data", "beat_m", "slow")

    def __init__(self, attempt: int, state: str = STARTING) -> None:
        self.state, self.attempt = state, attempt
        self.beats: deque[tuple[float, int]] = deque()    # (m, step), the last WINDOW s
        self.step: int | None = None
        self.work: float | None = None
        self.data: float | None = None
        self.beat_m: float | None = None
        self.slow = False


class Metrics:
    """A Recorder's listener: every event as it is recorded (beats before thinning), under the
    recorder's lock, so each takes O(1) here and does no I/O. view() reads it, O(nodes).

    clock: the launcher's monotonic clock, the one the events' `m` is read from (a fake in
    tests). goodput_of: the run's goodput so far (0..1) or None, asked at each scrape."""

    def __init__(self, run_id: str, clock: Callable[[], float] = time.monotonic,
                 goodput_of: Callable[[], float | None] = lambda: None,
                 window: float = WINDOW) -> None:
        self.run_id, self.clock, self.goodput_of, self.window = run_id, clock, goodput_of, window
        self.lock = threading.Lock()
        self.nodes: dict[str, _Node] = {}
        self.attempt = 0
        self.restarts = 0
        self.checkpoint: int | None = None
        self.took = 0            # events taken: what a test counts work by
        self.handlers: dict[str, Callable[[Event], None]] = {
            tl.STARTED: self._started, tl.JOINED: self._joined, tl.BEAT: self._beat,
            tl.FAILED: self._failed, tl.EXIT: self._exit, tl.STOP: self._stop,
            tl.SLOW: self._slow, tl.RESTART: self._restart, tl.ASIDE: self._aside,
            tl.CHECKPOINT: self._checkpoint}

    def __call__(self, ev: Event) -> None:
        handler = self.handlers.get(str(ev.get("kind")))
        with self.lock:
            self.took += 1
            attempt = ev.get("attempt")
            if isinstance(attempt, int) and attempt > self.attempt:
                self.attempt = attempt
            if handler is not None:
                handler(ev)

    def _node(self, ev: Event) -> _Node | None:
        """The event's node, made when first named; None for an earlier attempt's news."""
        label = ev.get("node")
        if not isinstance(label, str):
            return None
        node = self.nodes.get(label)
        if node is None:
            node = self.nodes[label] = _Node(self.attempt)
        return node if ev.get("attempt", self.attempt) >= node.attempt else None

    def _started(self, ev: Event) -> None:
        """A new attempt's nodes: each starting afresh (once an attempt, O(its nodes))."""
        for label in ev.get("nodes") or ():
            if isinstance(label, str):
                self.nodes[label] = _Node(self.attempt)

    def _joined(self, ev: Event) -> None:
        node = self._node(ev)
        if node is not None and node.state == STARTING:
            node.state = RUNNING

    def _beat(self, ev: Event) -> None:
        node, m = self._node(ev), ev.get("m")
        if node is None or not isinstance(m, (int, float)):
            return
        if node.state == STARTING:
            node.state = RUNNING
        node.beat_m = float(m)
        work, data = ev.get("work"), ev.get("data")
        if isinstance(work, (int, float)) and isinstance(data, (int, float)):
            node.work, node.data = float(work), float(data)
        step = ev.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            return
        beats = node.beats
        if beats and step < beats[-1][1]:                # counting again (a resume): afresh
            beats.clear()
        beats.append((float(m), step))
        node.step = step
        # keep one beat at or before the window's start: the rate spans the whole window
        while len(beats) > 2 and beats[1][0] <= m - self.window:
            beats.popleft()

    def _failed(self, ev: Event) -> None:
        node = self._node(ev)
        if node is not None:
            node.state = FAILED

    def _exit(self, ev: Event) -> None:
        node = self._node(ev)
        if node is None:
            return
        if ev.get("ok"):
            node.state = EXITED
        elif node.state not in ENDS:           # a stopped node's exit is its stop
            node.state = FAILED

    def _stop(self, ev: Event) -> None:
        for label in ev.get("nodes") or ():
            node = self.nodes.get(label) if isinstance(label, str) else None
            if node is not None and node.state not in ENDS:
                node.state = STOPPED

    def _slow(self, ev: Event) -> None:
        node = self._node(ev)
        if node is not None:
            node.slow = True

    def _restart(self, ev: Event) -> None:
        self.restarts += 1

    def _aside(self, ev: Event) -> None:
        """A host set aside (a job's event, rare): its nodes, labelled 'host rank'."""
        host = ev.get("host")
        for label, node in self.nodes.items():
            if label.rsplit(" ", 1)[0] == host:
                node.state = ASIDE

    def _checkpoint(self, ev: Event) -> None:
        step = ev.get("step")
        if isinstance(step, int) and (self.checkpoint is None or step > self.checkpoint):
            self.checkpoint = step

    def view(self) -> RunView:
        now = self.clock()
        with self.lock:
            nodes = [NodeView(label, n.state, n.step, _rate(n.beats, now), n.work, n.data,
                              None if n.beat_m is None else max(0.0, now - n.beat_m),
                              n.slow and n.attempt == self.attempt)
                     for label, n in self.nodes.items()]
            view = RunView(self.run_id, nodes, self.attempt, self.restarts, None,
                           self.checkpoint)
        view.goodput = _goodput(self.goodput_of)
        return view


def _rate(beats: deque[tuple[float, int]], now: float) -> float | None:
    """Steps per second from the oldest beat kept up to now: the window's rate while beats
    come, falling toward 0 once they stop (the heartbeat's age says so at once)."""
    if len(beats) < 2:
        return None
    (m0, s0), (m1, s1) = beats[0], beats[-1]
    span = max(now, m1) - m0
    return (s1 - s0) / span if span > 0 else None


def _goodput(goodput_of: Callable[[], float | None]) -> float | None:
    """The injected reader's answer, when it is a number (its failure leaves the gauge out:
    a scrape never fails for it)."""
    try:
        value = goodput_of()
    except Exception:  # a view's fault: the other metrics still answer
        return None
    return float(value) if isinstance(value, (int, float)) else None


# --- where they are served ------------------------------------------------------------------


Endpoint = tuple[str, int]          # (address, port); port 0: any free one


def endpoint(text: str | int, what: str = "--metrics-port") -> Endpoint:
    """'9400' -> 127.0.0.1:9400; 'HOST:PORT' (an IPv6 address in brackets, [::]:9400) binds
    HOST. Raises InputError naming `what`."""
    raw = str(text).strip()
    address, sep, port_text = raw.rpartition(":")
    if not sep:
        address = DEFAULT_ADDRESS
    bracketed = address.startswith("[") and address.endswith("]")
    address = address[1:-1] if bracketed else address
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise InputError(f"Invalid value for {what}: {raw!r} is not PORT or HOST:PORT with a "
                         f"port from 0 to 65535 (0: any free port), e.g. 9400 or 0.0.0.0:9400")
    if not address or (":" in address and not (bracketed and _ip(address))):
        raise InputError(f"Invalid value for {what}: {raw!r} has no address before its port, "
                         f"or an IPv6 one out of brackets ([::1]:9400)")
    why = address_problem(address)
    if why:
        raise InputError(f"Invalid value for {what}: {why}")
    return address, int(port_text)


def _ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def url(address: str, port: int) -> str:
    host = f"[{address}]" if ":" in address else address
    return f"http://{host}:{port}{PATH}"


class Served:
    """The metrics' HTTP server while the run is watched; stop() ends it (and frees the port).
    Served() serves nothing: the run asked for no metrics."""

    def __init__(self, server: Any = None, thread: threading.Thread | None = None,
                 url: str = "") -> None:
        self.server, self.thread, self.url = server, thread, url

    def stop(self) -> None:
        if self.server is None:
            return
        self.server.shutdown()
        self.server.server_close()
        if self.thread is not None:
            self.thread.join(timeout=5)
        self.server = None


def serve(view: Callable[[], RunView], where: Endpoint) -> Served:
    """Serve the view's families at http://ADDRESS:PORT/metrics from a daemon thread
    (prometheus_client's server: any path answers, /metrics is the one to scrape). An address
    in use, or one this machine does not have, is an InputError: nothing is contacted yet."""
    address, port = where
    try:
        from prometheus_client import start_http_server
        server, thread = start_http_server(port, addr=address, registry=registry_of(view))
    except OSError as exc:
        why = exc.strerror or str(exc)
        raise InputError(f"the metrics cannot be served at {address}:{port}: {why}; choose "
                         f"another port with --metrics-port (0: any free one) or the "
                         f"inventory's metrics.port. Nothing was contacted") from None
    return Served(server, thread, url(address, server.server_address[1]))


def serve_run(where: Endpoint | None, recorder: tl.Recorder, run_id: str,
              say: Callable[[str], None],
              goodput_of: Callable[[], float | None] = lambda: None) -> Served:
    """What `cluster up` calls before its first event: the run's events listened to and
    served at `where` (the URL said once bound); None: nothing served."""
    if where is None:
        return Served()
    live = Metrics(run_id, clock=recorder.clock, goodput_of=goodput_of)
    served = serve(live.view, where)
    recorder.listen(live)
    say(f"metrics: {served.url}")
    return served


def write_textfile(path: str, view: RunView) -> None:
    """The view's families in the text format, for node_exporter's textfile collector: written
    beside `path` and renamed over it (a reader sees the old file or the new one, whole)."""
    from prometheus_client import write_to_textfile
    write_to_textfile(path, registry_of(lambda: view))
