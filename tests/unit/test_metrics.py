"""The live metrics (cluster/observe/metrics.py): events fed through a real Recorder on a fake
clock, each scrape made by prometheus_client and read back with its own parser; a real HTTP
server on a free port; the inventory's key and --metrics-port; the textfile's atomic write."""
from __future__ import annotations

import os
import socket
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cluster import api, inventory
from cluster.console import Console
from cluster.errors import InputError, InventoryError
from cluster.observe import metrics as mx
from cluster.observe import timeline as tl
from cluster.observe import top

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
RUN = "20260101-000000-abcd"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def live(goodput_of=lambda: None) -> tuple[tl.Recorder, mx.Metrics, Clock]:
    """A recorder (its events kept in a list) whose every event the Metrics hear."""
    clock = Clock()
    rec = tl.Recorder([].append, clock=clock)
    metrics = mx.Metrics(RUN, clock=clock, goodput_of=goodput_of)
    rec.listen(metrics)
    return rec, metrics, clock


def parse(text: str) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def scrape(metrics: mx.Metrics) -> Samples:
    return parse(generate_latest(mx.registry_of(metrics.view)).decode())


def node(samples: Samples, name: str, label: str, **more: str) -> float | None:
    return samples.get((name, frozenset({"node": label, "run": RUN, **more}.items())))


def run_value(samples: Samples, name: str) -> float | None:
    return samples.get((name, frozenset({"run": RUN}.items())))


def state(samples: Samples, label: str) -> str:
    """The one state whose sample is 1 (every state has a sample)."""
    values = {s: node(samples, "cluster_node_state", label, state=s) for s in mx.STATES}
    assert None not in values.values(), values
    on = [s for s, v in values.items() if v == 1.0]
    assert len(on) == 1, values
    return on[0]


def start(rec: tl.Recorder, *labels: str, attempt: int = 0) -> None:
    rec.attempt = attempt
    rec.event(tl.CHECK)
    rec.event(tl.STARTED, nodes=list(labels))


def beats(rec: tl.Recorder, clock: Clock, label: str, steps: range, every: float = 1.0,
          **detail: float) -> None:
    for step in steps:
        clock.now += every
        rec.beat(label, step=step, **detail)


# --- what each metric says --------------------------------------------------------------------


def test_step_rate_work_data_and_heartbeat_age_come_from_the_beats() -> None:
    rec, metrics, clock = live()
    start(rec, "a 0", "b 1")
    beats(rec, clock, "a 0", range(0, 120, 2), work=0.4, data=0.05)   # 2 steps/s for 60 s
    rec.beat("b 1", step=10)                                          # one beat: no rate yet
    s = scrape(metrics)
    assert node(s, "cluster_node_step_rate", "a 0") == pytest.approx(2.0)
    assert node(s, "cluster_node_step_rate", "b 1") is None
    assert node(s, "cluster_node_step", "a 0") == 118
    assert node(s, "cluster_node_work_seconds_per_step", "a 0") == pytest.approx(0.4)
    assert node(s, "cluster_node_data_seconds_per_step", "a 0") == pytest.approx(0.05)
    assert node(s, "cluster_node_work_seconds_per_step", "b 1") is None     # never said
    assert node(s, "cluster_node_heartbeat_age_seconds", "a 0") == pytest.approx(0.0)
    clock.now += 7.5
    s = scrape(metrics)
    assert node(s, "cluster_node_heartbeat_age_seconds", "a 0") == pytest.approx(7.5)
    # beats stopped: the rate falls toward 0 (60 steps over the 30 s window, now 37.5 s)
    assert node(s, "cluster_node_step_rate", "a 0") == pytest.approx(60 / 37.5)


def test_the_rate_is_the_recent_windows_not_the_runs() -> None:
    rec, metrics, clock = live()
    start(rec, "a 0")
    beats(rec, clock, "a 0", range(0, 100))                 # 1 step/s for 100 s
    beats(rec, clock, "a 0", range(100, 400, 5))            # then 5 steps/s
    assert node(scrape(metrics), "cluster_node_step_rate", "a 0") == pytest.approx(5.0)


def test_slow_beats_still_give_a_rate_between_the_last_two() -> None:
    rec, metrics, clock = live()
    start(rec, "a 0")
    beats(rec, clock, "a 0", range(3), every=60.0)          # a step a minute, window 30 s
    assert node(scrape(metrics), "cluster_node_step_rate", "a 0") == pytest.approx(1 / 60)


def test_a_step_count_that_goes_back_starts_the_rate_afresh() -> None:
    rec, metrics, clock = live()
    start(rec, "a 0")
    beats(rec, clock, "a 0", range(500, 510))
    beats(rec, clock, "a 0", range(0, 1))                   # resumed from an older checkpoint
    s = scrape(metrics)
    assert node(s, "cluster_node_step_rate", "a 0") is None
    assert node(s, "cluster_node_step", "a 0") == 0


def test_states_follow_the_events() -> None:
    rec, metrics, clock = live()
    start(rec, "a 0", "b 1", "c 2", "d 3")
    assert {state(scrape(metrics), n) for n in ("a 0", "b 1", "c 2")} == {"starting"}
    rec.event(tl.JOINED, "a 0", group_rank=0)
    rec.beat("b 1", step=1)                                 # a beat is a node at work too
    s = scrape(metrics)
    assert state(s, "a 0") == state(s, "b 1") == "running" and state(s, "c 2") == "starting"
    assert run_value(s, "cluster_run_nodes_running") == 2
    rec.event(tl.EXIT, "d 3", ok=True, how="exit code 0")
    rec.event(tl.FAILED, "c 2", what="RuntimeError: boom")
    rec.event(tl.STOP, nodes=["a 0", "b 1", "c 2"])
    rec.event(tl.EXIT, "c 2", ok=False, how="exit code 1")
    rec.event(tl.EXIT, "a 0", ok=False, how="exit code 143")    # its stop's, not a failure
    s = scrape(metrics)
    assert [state(s, n) for n in ("a 0", "b 1", "c 2", "d 3")] == \
        ["stopped", "stopped", "failed", "exited"]
    assert run_value(s, "cluster_run_nodes_running") == 0


def test_an_exit_not_asked_for_is_a_failure() -> None:
    rec, metrics, _ = live()
    start(rec, "a 0")
    rec.event(tl.JOINED, "a 0")
    rec.event(tl.EXIT, "a 0", ok=False, how="lost: no heartbeat")
    assert state(scrape(metrics), "a 0") == "failed"


def test_slow_restart_aside_and_the_next_attempt() -> None:
    rec, metrics, clock = live()
    start(rec, "a 0", "b 1")
    rec.event(tl.SLOW, "b 1", ratio=1.6, part="compute")
    s = scrape(metrics)
    assert node(s, "cluster_node_slow", "b 1") == 1 and node(s, "cluster_node_slow", "a 0") == 0
    assert run_value(s, "cluster_run_slow_nodes") == 1
    assert run_value(s, "cluster_run_attempt") == 0
    assert run_value(s, "cluster_run_restarts_total") == 0
    rec.event(tl.FAILED, "b 1", what="lost")
    rec.event(tl.RESTART, why="node [b 1] failed", cause="lost")
    rec.event(tl.ASIDE, host="b", why="lost", spare="c")
    assert state(scrape(metrics), "b 1") == "set_aside"
    start(rec, "a 0", "c 1", attempt=1)
    rec.beat("a 0", step=3)
    s = scrape(metrics)
    assert run_value(s, "cluster_run_attempt") == 1
    assert run_value(s, "cluster_run_restarts_total") == 1
    assert [state(s, n) for n in ("a 0", "c 1", "b 1")] == ["running", "starting", "set_aside"]
    assert run_value(s, "cluster_run_slow_nodes") == 0       # named in the attempt before
    rec.attempt = 0                                          # a late word of attempt 0
    rec.event(tl.EXIT, "a 0", ok=False, how="exit code 143")
    assert state(scrape(metrics), "a 0") == "running"


def test_checkpoint_step() -> None:
    rec, metrics, _ = live()
    start(rec, "a 0")
    assert run_value(scrape(metrics), "cluster_run_checkpoint_step") is None
    rec.checkpoint(200, saving=1.5)
    assert run_value(scrape(metrics), "cluster_run_checkpoint_step") == 200


def test_goodput_only_when_its_reader_gives_a_number() -> None:
    _, metrics, _ = live()
    assert run_value(scrape(metrics), "cluster_run_goodput_ratio") is None
    _, metrics, _ = live(goodput_of=lambda: 0.75)
    assert run_value(scrape(metrics), "cluster_run_goodput_ratio") == 0.75

    def broken() -> float:
        raise OSError("events.jsonl: gone")
    _, metrics, _ = live(goodput_of=broken)
    s = scrape(metrics)                                      # the scrape still answers
    assert run_value(s, "cluster_run_goodput_ratio") is None
    assert run_value(s, "cluster_run_attempt") == 0


def test_every_family_has_help_and_the_cluster_prefix() -> None:
    rec, metrics, clock = live(goodput_of=lambda: 0.5)
    start(rec, "a 0")
    beats(rec, clock, "a 0", range(5), work=0.1, data=0.0)
    rec.checkpoint(4)
    names = set()
    for family in text_string_to_metric_families(generate_latest(
            mx.registry_of(metrics.view)).decode()):
        assert family.name.startswith("cluster_") and family.documentation, family
        names.add(family.name)
    assert names == {"cluster_node_step_rate", "cluster_node_step",
                     "cluster_node_work_seconds_per_step", "cluster_node_data_seconds_per_step",
                     "cluster_node_heartbeat_age_seconds", "cluster_node_state",
                     "cluster_node_slow", "cluster_run_nodes_running", "cluster_run_slow_nodes",
                     "cluster_run_attempt", "cluster_run_restarts", "cluster_run_goodput_ratio",
                     "cluster_run_checkpoint_step"}


def test_a_thousand_nodes_keep_a_windows_worth_of_beats_each() -> None:
    """The listener's work is O(1) an event: each node keeps the beats of one window (plus
    one), however long the run; a scrape reads every node once."""
    rec, metrics, clock = live()
    labels = [f"n{i} {i}" for i in range(1000)]
    start(rec, *labels)
    for step in range(120):                       # 2 minutes of a beat a second, every node
        clock.now += 1.0
        for label in labels:
            rec.beat(label, step=step)
    assert metrics.took == 2 + 120 * 1000             # CHECK, STARTED, then every beat heard
    assert max(len(n.beats) for n in metrics.nodes.values()) <= mx.WINDOW + 2
    s = scrape(metrics)
    rates = [node(s, "cluster_node_step_rate", label) for label in labels]
    assert rates == [pytest.approx(1.0)] * 1000
    assert run_value(s, "cluster_run_nodes_running") == 1000


# --- served over HTTP -------------------------------------------------------------------------


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


def test_served_on_a_free_port_of_127_0_0_1_and_closed_by_stop() -> None:
    rec, metrics, clock = live()
    start(rec, "a 0")
    beats(rec, clock, "a 0", range(0, 20, 2))
    served = mx.serve(metrics.view, mx.endpoint("0"))
    try:
        address, port = served.server.server_address[:2]
        assert address == "127.0.0.1" and port > 0
        assert served.url == f"http://127.0.0.1:{port}/metrics"
        assert served.thread is not None and served.thread.daemon
        s = parse(get(served.url))
        assert node(s, "cluster_node_step_rate", "a 0") == pytest.approx(2.0)
        rec.beat("a 0", step=20)                           # each scrape reads the state now
        assert node(parse(get(served.url)), "cluster_node_step", "a 0") == 20
    finally:
        served.stop()
    with pytest.raises(urllib.error.URLError):
        get(served.url)
    assert not served.thread.is_alive()
    served.stop()                                          # twice is harmless


def test_a_port_in_use_is_an_input_error() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(InputError, match=rf"127.0.0.1:{port}: .*in use.*--metrics-port"):
            mx.serve(lambda: mx.RunView(RUN), ("127.0.0.1", port))


def test_serve_run_says_its_url_and_listens() -> None:
    rec = tl.Recorder([].append)
    said: list[str] = []
    served = mx.serve_run(("127.0.0.1", 0), rec, RUN, said.append)
    try:
        assert said == [f"metrics: {served.url}"]
        rec.event(tl.STARTED, nodes=["a 0"])
        assert state(parse(get(served.url)), "a 0") == "starting"
    finally:
        served.stop()
    assert mx.serve_run(None, rec, RUN, said.append).server is None and len(said) == 1


@pytest.mark.parametrize("given, where", [
    ("9400", ("127.0.0.1", 9400)), (9400, ("127.0.0.1", 9400)), ("0", ("127.0.0.1", 0)),
    ("0.0.0.0:9400", ("0.0.0.0", 9400)), ("localhost:1", ("localhost", 1)),
    ("[::1]:9400", ("::1", 9400))])
def test_endpoint(given: str | int, where: mx.Endpoint) -> None:
    assert mx.endpoint(given) == where


@pytest.mark.parametrize("given", ["", "x", "70000", "-1", "host:", ":9400", "::1:9400"])
def test_a_bad_endpoint_is_refused(given: str) -> None:
    with pytest.raises(InputError, match="Invalid value for --metrics-port"):
        mx.endpoint(given)


# --- where cluster up takes it from -----------------------------------------------------------


def test_the_inventory_key() -> None:
    assert inventory.parse_yaml("hosts: [a]\n", "inv.yaml").metrics.port is None
    inv = inventory.parse_yaml("hosts: [a]\nmetrics: 9400\n", "inv.yaml")
    assert (inv.metrics.address, inv.metrics.port) == ("127.0.0.1", 9400)
    inv = inventory.parse_yaml("hosts: [a]\nmetrics: {port: 0, address: 0.0.0.0}\n", "inv.yaml")
    assert (inv.metrics.address, inv.metrics.port) == ("0.0.0.0", 0)
    with pytest.raises(InventoryError, match=r"inv.yaml:3: port: must be a port number from 0"):
        inventory.parse_yaml("hosts: [a]\nmetrics:\n  port: 70000\n", "inv.yaml")
    with pytest.raises(InventoryError, match=r"inv.yaml:2: address: 'a b' is neither"):
        inventory.parse_yaml("hosts: [a]\nmetrics: {address: 'a b'}\n", "inv.yaml")
    with pytest.raises(InventoryError, match=r"metrics.adress.*did you mean 'address'"):
        inventory.parse_yaml("hosts: [a]\nmetrics: {adress: x}\n", "inv.yaml")


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "t.py").write_text("print(1)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.delenv("CLUSTER_RUNS_DIR", raising=False)
    return tmp_path


def test_the_command_line_over_the_inventory(project: Path) -> None:
    (project / "inv.yaml").write_text("backend: local\nhosts: [a]\nmetrics: {port: 9400}\n")
    request = api.Request(inventory_path="inv.yaml", command=("t.py",))
    assert api.prepare(request).options.metrics == ("127.0.0.1", 9400)
    request = api.Request(inventory_path="inv.yaml", command=("t.py",), metrics_port="0.0.0.0:0")
    assert api.prepare(request).options.metrics == ("0.0.0.0", 0)
    prepared = api.prepare(api.Request(inventory_path="inv.yaml", command=("t.py",), detach=True))
    assert prepared.options.metrics is None
    assert any("metrics: not served" in note for note in prepared.notes)
    assert api.prepare(api.Request(command=("t.py",))).options.metrics is None


def test_detach_with_metrics_port_is_refused(project: Path) -> None:
    with pytest.raises(InputError, match="--metrics-port .* --detach.*--metrics-textfile"):
        api.prepare(api.Request(command=("t.py",), detach=True, metrics_port="0"))


def test_a_port_in_use_stops_up_before_any_node_starts(project: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        prepared = api.prepare(api.Request(command=("t.py",), nodes=2, force_local=True,
                                           metrics_port=str(port)))
        with pytest.raises(InputError, match="in use"):
            prepared.run(Console(), ["cluster", "up"])
    run = next((project / "runs").iterdir())
    events = list(tl.read_events(run / tl.EVENTS))
    assert [e["kind"] for e in events] == [tl.LAUNCH, tl.OUTCOME]      # no check, no start
    assert not (run / "logs").exists() or not os.listdir(run / "logs")


def test_the_textfile_is_written_whole(tmp_path: Path) -> None:
    path = tmp_path / "cluster.prom"
    path.write_text("old\n")
    view = mx.RunView(RUN, [mx.NodeView("a 0", "running", 7, 1.5, 0.2, 0.01, 3.0)], attempt=0,
                      restarts=0)
    mx.write_textfile(str(path), view)
    s = parse(path.read_text())
    assert node(s, "cluster_node_step_rate", "a 0") == 1.5
    assert state(s, "a 0") == "running"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cluster.prom"]   # no temp left


def test_a_detached_runs_rows_as_the_same_metrics(tmp_path: Path) -> None:
    """`cluster status --metrics-textfile`: what the nodes say now (cluster top's rows) under
    the live view's names; what only the launcher's events know is left out."""
    rows = [top.Row(1, "b", "exited", code=1), top.Row(2, "c", "exited", code=0),
            top.Row(0, "a", "running", metrics=top.Metrics(step=40),
                    pace=top.Pace(2.0, 0.3, 1.5, 1.0, 0.25, 0.05)),
            top.Row(3, "d", "unreachable"), top.Row(4, "e", "cancelled")]
    meta = {"attempts": [{"attempt": 0}, {"attempt": 1}], "slow_nodes": [{"node": "a 0"}]}
    path = tmp_path / "run.prom"
    mx.write_textfile(str(path), top.metrics_view(RUN, rows, meta))
    s = parse(path.read_text())
    assert [state(s, n) for n in ("a 0", "b 1", "c 2", "d 3", "e 4")] == \
        ["running", "failed", "exited", "unknown", "stopped"]
    assert node(s, "cluster_node_step_rate", "a 0") == 2.0
    assert node(s, "cluster_node_step", "a 0") == 40
    assert node(s, "cluster_node_work_seconds_per_step", "a 0") == 0.25
    assert node(s, "cluster_node_data_seconds_per_step", "a 0") == 0.05
    assert node(s, "cluster_node_heartbeat_age_seconds", "a 0") == 1.5
    assert node(s, "cluster_node_step_rate", "b 1") is None
    assert node(s, "cluster_node_slow", "a 0") == 1 and run_value(s, "cluster_run_slow_nodes") == 1
    assert run_value(s, "cluster_run_attempt") == 1 == run_value(s, "cluster_run_restarts_total")
    assert run_value(s, "cluster_run_nodes_running") == 1
    assert run_value(s, "cluster_run_goodput_ratio") is None


def test_the_command_lines_address_follows_the_inventorys_rule() -> None:
    """--metrics-port HOST:PORT and `metrics: {address}` refuse the same addresses."""
    from cluster.observe.metrics import endpoint
    assert endpoint("localhost:9400") == ("localhost", 9400)
    assert endpoint("0.0.0.0:0") == ("0.0.0.0", 0)
    with pytest.raises(InputError, match="neither an IP address nor a host name"):
        endpoint("bad host:9400")
