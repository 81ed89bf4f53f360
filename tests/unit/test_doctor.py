"""Doctor and preflight logic on facts the nodes could have sent (no node contacted)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from cluster import inventory
from cluster.deep import Capture, deep_findings, deep_summary, measure_collective, step_lines
from cluster.doctor import PhaseLines, Report, diagnose, render_text, survey
from cluster.plan import Job, Templates, render
from cluster.recovery.gate import FAIL, PASS, WARN, Clock, clock_offset, evaluate, fingerprint

REMOTE = Path(__file__).resolve().parents[2] / "cluster" / "remote"


def plan_for(text: str):
    return render(inventory.parse_yaml(text, "x.yaml"), Job(run_id="r", script="t.py"), Templates())


def node_facts(version="2.13.0", ifname="eth0", **extra):
    f = {"python": "3.11.2", "executable": "/venv/bin/python",
         "torch": {"version": version, "cuda": "12.4", "run_py": "/x/run.py"},
         "network": {"ifname": ifname, "how": "holds this node's address 10.0.0.1"},
         "ib_devices": []}
    f.update(extra)
    return f


def by(findings, node, check):
    return [f for f in findings if f.node == node and f.check == check]


def test_a_healthy_job_passes_everything() -> None:
    plan = plan_for("hosts: [a, b]\n")
    facts = {"a": node_facts(port_free=True), "b": node_facts()}
    reach = {"a": {"ok": True, "seconds": 0.001}, "b": {"ok": True, "seconds": 0.002}}
    found = evaluate(plan, facts, reach)
    assert {f.status for f in found} == {PASS}
    assert by(found, "a", "master port") and not by(found, "b", "master port")


def test_problems_each_name_node_check_and_fix() -> None:
    plan = plan_for("defaults: {network: {ib: on}}\nhosts: [a, b, c]\n")
    facts = {"a": node_facts(port_free=False),
             "b": node_facts(version="2.12.0", network={"error": "interface ens9 does not exist here",
                                                        "interfaces": ["eth0", "lo"]}),
             "c": node_facts(torch=None)}
    reach = {"a": {"ok": True}, "b": {"ok": False, "error": "no answer within 3 s"}, "c": {"ok": True}}
    found = evaluate(plan, facts, reach)
    fails = {(f.node, f.check) for f in found if f.status == FAIL}
    assert fails == {("a", "master port"), ("b", "interface"), ("b", "reach master"),
                     ("c", "torch"), ("a", "infiniband"), ("b", "infiniband"), ("c", "infiniband"),
                     ("all", "same torch")}
    assert "eth0, lo" in by(found, "b", "interface")[0].fix
    assert "2.12.0 on b" in by(found, "all", "same torch")[0].detail
    assert all(f.fix for f in found if f.status == FAIL)


def test_fingerprint_is_one_row_per_value() -> None:
    facts = {n: node_facts() for n in ("a", "b", "c")}
    facts["c"]["torch"]["version"] = "2.12.0"
    rows = fingerprint(facts)
    assert rows["torch"] == {"2.13.0": ["a", "b"], "2.12.0": ["c"]}
    assert rows["python"] == {"3.11.2": ["a", "b", "c"]}


def test_deep_findings_gpus_shm_clock() -> None:
    plan = plan_for("defaults: {nproc_per_node: 4}\nhosts: [a]\n")
    gpu = {"index": 0, "name": "H200", "driver": "580", "memory_used_mib": 30000.0, "processes": 1}
    facts = {"a": node_facts(port_free=True, gpus=[gpu, {**gpu, "index": 1, "memory_used_mib": 0.0,
                                                          "processes": 0}],
                             shm_bytes=64 << 20, disk_free_bytes=100 << 30, nofile=1024,
                             torch_runtime={"nccl": "2.21.5", "cudnn": 90100})}
    found = evaluate(plan, facts, deep=True, clock={"a": Clock(5.0, 0.1)})
    assert by(found, "a", "gpus")[0].status == FAIL          # 4 processes, 2 GPUs
    assert by(found, "a", "gpus busy")[0].status == WARN and "GPU 0" in by(found, "a", "gpus busy")[0].detail
    assert by(found, "a", "/dev/shm")[0].status == WARN
    assert by(found, "a", "open files")[0].status == WARN
    assert by(found, "a", "clock")[0].status == WARN


def test_slow_node_is_named_from_the_pairs() -> None:
    pairs = [{"a": "n1", "b": "n2", "gbps": 10.0}, {"a": "n1", "b": "n3", "gbps": 1.0},
             {"a": "n2", "b": "n3", "gbps": 1.1}, {"a": "n1", "b": "n4", "gbps": 9.5},
             {"a": "n2", "b": "n4", "gbps": 9.8}, {"a": "n3", "b": "n4", "gbps": 0.9}]
    deep = deep_summary({"sum_ok": True, "backend": "nccl", "world_size": 4, "allreduce": [],
                         "pairs": pairs})
    assert deep["slowest"] == "node n3"
    warn = [f for f in deep_findings(deep) if f.check == "bandwidth"]
    assert warn and "node n3 is far below the others" in warn[0].detail
    even = deep_summary({"sum_ok": True, "pairs": [{**p, "gbps": 5.0} for p in pairs]})
    assert even["slowest"] is None


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
def test_pair_rounds_meet_every_pair_once() -> None:
    spec = importlib.util.spec_from_file_location("collective", REMOTE / "collective.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for n in range(2, 10):
        seen = []
        for r in mod.rounds(n):
            members = [x for p in r for x in p]
            assert len(members) == len(set(members)), "a node twice in one round"
            seen += [tuple(sorted(p)) for p in r]
        assert sorted(seen) == sorted((i, j) for i in range(n) for j in range(i + 1, n))


def test_report_text_groups_equal_nodes_and_json_is_stable() -> None:
    plan = plan_for("hosts: ['n[1-4]']\n")
    facts = {f"n{i}": node_facts(**({"port_free": True} if i == 1 else {})) for i in range(1, 5)}
    facts["n4"]["network"] = {"error": "interface x missing", "interfaces": ["eth0"]}
    rep = Report(nodes=[n.host.name for n in plan.nodes], master="n1", port=plan.master_port,
                 findings=evaluate(plan, facts), fingerprint=fingerprint(facts))
    text = render_text(rep)
    assert "n[2-3]" in text and "FAIL n4: interface: interface x missing" in text
    assert "torch: 2.13.0 on n[1-4]" in text and text.rstrip().splitlines()[-1].startswith("FAILED")
    data = json.loads(json.dumps(rep.to_json()))
    assert data["schema"] == 1 and data["ok"] is False


# --- containers -------------------------------------------------------------------------------

BOX = ("defaults:\n  container: {runtime: podman, image: 'reg.example/t:1'}\n"
       "hosts: [a, b, {name: c, container: {runtime: docker}}, d]\n")


def box_facts(gpus=None, inside=None, **container):
    c = {"runtime": "podman", "image": "reg.example/t:1", "version": "podman version 4.3.1",
         "image_id": "sha256:0123456789abcdef0123"}
    c.update(container)
    extra = {"gpus": gpus} if gpus is not None else {}
    if inside is not None:
        extra["inside"] = inside
    return node_facts(torch=None, container=c, **extra)


def test_container_nodes_need_the_runtime_and_the_image_not_torch() -> None:
    plan = plan_for(BOX)
    facts = {"a": box_facts(),
             "b": box_facts(image_id=None),
             "c": box_facts(version=None, image_id=None, error="docker: Cannot connect to the "
                            "Docker daemon at unix:///var/run/docker.sock"),
             "d": box_facts(image_id=None, pullable=False, pull_error="manifest unknown")}
    found = evaluate(plan, facts)
    assert not by(found, "a", "torch"), "torch is the image's, not the node's"
    assert by(found, "a", "container")[0].status == PASS
    b, c, d = (by(found, n, "container")[0] for n in "bcd")
    assert b.status == FAIL and "podman pull reg.example/t:1" in b.fix
    assert c.status == FAIL and "Cannot connect" in c.detail and "daemon" in c.fix
    assert d.status == FAIL and "cannot be pulled: manifest unknown" in d.detail
    pullable = evaluate(plan, {"a": box_facts(image_id=None, pullable=True)})
    assert by(pullable, "a", "container")[0].status == WARN


def test_doctor_compares_the_image_and_the_torch_inside_it() -> None:
    plan = plan_for(BOX)
    gpus = [{"index": i, "name": "H200", "driver": "550", "memory_used_mib": 0, "processes": 0}
            for i in range(2)]
    inside = {"torch": "2.13.0", "cuda": "12.4", "python": "3.11.2", "device_count": 2}
    facts = {"a": box_facts(gpus=gpus, inside=inside),
             "b": box_facts(gpus=gpus, inside={**inside, "device_count": 0}),
             "c": box_facts(image_id="sha256:ffff", gpus=gpus, inside={**inside, "torch": "2.12.0"}),
             "d": box_facts(inside={"error": "ModuleNotFoundError: No module named 'torch'"})}
    found = evaluate(plan, facts, deep=True)
    assert by(found, "a", "image torch")[0].status == PASS
    assert by(found, "a", "image gpus")[0].status == PASS
    assert by(found, "b", "image gpus")[0].status == FAIL
    assert "nvidia-ctk cdi generate" in by(found, "b", "image gpus")[0].fix
    assert by(found, "d", "image torch")[0].status == FAIL and not by(found, "d", "image gpus")
    assert not by(found, "a", "torch import"), "the node's own torch does not matter"
    same = {f.check: f for f in found if f.node == "all"}
    assert same["same torch"].status == FAIL and "2.12.0 on c" in same["same torch"].detail
    assert same["same image"].status == WARN and "sha256:ffff" in same["same image"].detail


# --- the clock: judged net of the round trip ----------------------------------------------------


class FakeClockBackend:
    """Nodes that answer the probe after `there` seconds, work `work` seconds, and are heard
    back `back` seconds later, their clocks `skew` seconds ahead of ours; time is a counter."""

    name = "fake"
    progress = None

    def __init__(self, skew: dict, there: float, work: float, back: float) -> None:
        self.now, self.skew = 1000.0, skew
        self.there, self.work, self.back = there, work, back

    def clock(self) -> float:
        return self.now

    def each(self, nodes, fn, phase=None):
        return [(n, fn(n)) for n in nodes]

    def probe_node(self, node, plan, *, deep=False, make_dir=True):
        self.now += self.there
        start = self.now + self.skew[node.host.name]
        self.now += self.work
        end = self.now + self.skew[node.host.name]
        self.now += self.back
        return {**node_facts(), "time_start": start, "time": end}


def test_clock_offset_is_ntps_estimate_and_its_bound() -> None:
    c = clock_offset(sent=100.0, received=104.0, node_start=103.0, node_end=103.5)
    assert c.offset == pytest.approx(1.25) and c.error == pytest.approx(1.75)


@pytest.mark.parametrize("there,back", [(3.5, 0.4), (0.2, 3.9), (8.0, 8.0)])
def test_a_slow_round_trip_is_no_clock_skew(there, back) -> None:
    plan = plan_for("hosts: [a, b]\n")
    fake = FakeClockBackend({"a": 0.0, "b": 0.0}, there=there, work=2.0, back=back)
    facts, clock, _ = survey(fake, plan, now=fake.clock)
    found = evaluate(plan, facts, deep=True, clock=clock)
    for node in ("a", "b"):
        [f] = by(found, node, "clock")
        assert f.status == PASS, f
        assert abs(clock[node].offset) <= clock[node].error
        assert clock[node].error == pytest.approx((there + back) / 2), "the node's work is no error"


def test_a_skewed_clock_is_named_despite_a_slow_round_trip() -> None:
    plan = plan_for("hosts: [a, b, c]\n")
    fake = FakeClockBackend({"a": 0.0, "b": -8.0, "c": 120.0}, there=3.0, work=1.0, back=0.5)
    facts, clock, _ = survey(fake, plan, now=fake.clock)
    found = {n: by(evaluate(plan, facts, deep=True, clock=clock), n, "clock")[0] for n in "abc"}
    assert found["a"].status == PASS
    assert found["b"].status == WARN and "-6.750 s from this machine" in found["b"].detail
    assert "give or take 1.750 s" in found["b"].detail and "chrony" in found["b"].fix
    assert found["c"].status == FAIL


# --- what a node without torch is told ----------------------------------------------------------


def test_no_torch_names_the_python_asked_and_another_python_first() -> None:
    plan = plan_for("defaults: {python: python3}\nhosts: [a]\n")
    facts = {"a": node_facts(torch=None, executable="/usr/bin/python3.11",
                             torch_runtime={"error": "ModuleNotFoundError: No module named 'torch'"})}
    found = evaluate(plan, facts, deep=True)
    [f] = by(found, "a", "torch")
    assert f.status == FAIL
    assert "torch is not installed for python3 (/usr/bin/python3.11)" in f.detail
    assert f.fix.startswith("name the python that has torch (`python:` in the inventory, or --python")
    assert "or else install torch into /usr/bin/python3.11" in f.fix
    assert not by(found, "a", "torch import"), "one finding for one cause; no 'reinstall torch'"
    assert "reinstall" not in " ".join(x.fix for x in found)


def test_a_torch_that_fails_to_import_names_the_interpreter() -> None:
    plan = plan_for("hosts: [a]\n")
    facts = {"a": node_facts(torch_runtime={"error": "ImportError: libcudart.so.12: cannot open"})}
    [f] = by(evaluate(plan, facts, deep=True), "a", "torch import")
    assert f.status == FAIL and "importing torch with /venv/bin/python: ImportError" in f.detail
    assert "--python" in f.fix


# --- the connection test's listener -------------------------------------------------------------


class NoListener(FakeClockBackend):
    def __init__(self) -> None:
        super().__init__({"a": 0.0, "b": 0.0}, 0.01, 0.01, 0.01)

    def probe_node(self, node, plan, *, deep=False, make_dir=True):
        return {**super().probe_node(node, plan), "port_free": True}

    def reach(self, plan):
        from cluster.errors import ClusterError
        raise ClusterError("cannot listen on port 29400: Permission denied")


def test_a_listener_that_cannot_start_is_said_as_a_sentence_with_its_fix() -> None:
    inv = inventory.parse_yaml("defaults: {master_port: 29400}\nhosts: [a, b]\n", "x.yaml")
    report = diagnose(inv, NoListener(), Templates())
    [f] = [f for f in report.findings if f.check == "reach master"]
    assert f.node == "a" and f.status == FAIL
    assert f.detail == ("could not test whether the nodes reach a:29400: no listener could be "
                        "started on a (cannot listen on port 29400: Permission denied)")
    assert "{" not in f.detail and f.fix.startswith("free port 29400 on a, or choose another port")


# --- progress -------------------------------------------------------------------------------------


class Stream:
    def __init__(self, tty: bool) -> None:
        self.text, self.tty = "", tty

    def write(self, s: str) -> None:
        self.text += s

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return self.tty


class Counter:
    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.closed = 0

    def __call__(self, phase, done, total) -> None:
        self.calls.append((phase, done, total))

    def close(self) -> None:
        self.closed += 1


def test_every_phase_gets_one_line_and_the_counts_go_to_the_live_counter() -> None:
    stream, counter = Stream(tty=False), Counter()
    lines = PhaseLines(stream, counter=counter)
    for call in [("probe", 0, 3), ("probe", 1, 3), ("probe", 3, 3), ("reach", 0, 3),
                 ("collective", 0, 3), ("check", 2, 3), ("check", 3, 3)]:
        lines.run = "doctor-20261206-120000-ab12"
        lines(*call)
    said = stream.text.splitlines()
    assert said == ["cluster: asking 3 node(s) what they have (python, torch, GPUs, disk, clock)",
                    "cluster: testing that 3 node(s) reach the master port",
                    "cluster: running a collective across 3 node(s) (all_reduce, then every "
                    "pair); it is recorded as runs/doctor-20261206-120000-ab12",
                    "cluster: checking 3 node(s) before the collective starts"]
    assert counter.calls == [("probe", 0, 3), ("probe", 1, 3), ("probe", 3, 3), ("check", 2, 3),
                             ("check", 3, 3)], "reach and the collective have no count per node"
    assert counter.closed == 3, "each new phase ends the last one's count"


def test_the_live_count_is_drawn_only_on_a_terminal() -> None:
    plain = PhaseLines(Stream(tty=False))
    assert plain.counter.enabled is False
    for i in range(4):
        plain("probe", i, 3)
    plain.close()
    assert plain.stream.text == "cluster: asking 3 node(s) what they have (python, torch, GPUs, disk, clock)\n"
    assert PhaseLines(Stream(tty=True)).counter.enabled is True


def test_diagnose_announces_its_phases_to_the_backends_progress() -> None:
    fake = NoListener()
    stream = Stream(tty=False)
    fake.progress = PhaseLines(stream, counter=Counter())
    diagnose(inventory.parse_yaml("hosts: [a, b]\n", "x.yaml"), fake, Templates())
    assert [line.split(" ")[1] for line in stream.text.splitlines()] == ["asking", "testing"]


class Healthy(NoListener):
    """Nodes that pass every check: their clocks are this machine's."""

    def probe_node(self, node, plan, *, deep=False, make_dir=True):
        import time
        return {**super().probe_node(node, plan), "time_start": time.time(), "time": time.time()}

    def reach(self, plan):
        return {n.host.name: {"ok": True, "seconds": 0.001} for n in plan.nodes}


def test_the_seconds_said_are_all_the_user_waited_for_each_part_labelled() -> None:
    """`doctor --tune-nccl` said 'in 1.8 s' of a 7.2 s run: the survey's time alone, the sweep
    after it not counted. The seconds count from the command's start to the end of the sweep,
    and each part is named with its own."""
    now = [100.0]
    clock = lambda: now[0]          # noqa: E731

    def spend(seconds: float, result: dict):
        def run(*_):
            now[0] += seconds
            return result
        return run
    fake = Healthy()
    probe = fake.probe_node
    fake.probe_node = lambda *a, **kw: spend(0.9, probe(*a, **kw))()     # 2 nodes: 1.8 s
    report = diagnose(inventory.parse_yaml("hosts: [a, b]\n", "x.yaml"), fake, Templates(),
                      run_tune=spend(5.4, {"table": [], "chosen": {}, "cache": "c"}),
                      started=100.0, timer=clock)
    assert report.ok, report.findings
    assert report.seconds == pytest.approx(7.2)
    assert report.timings == pytest.approx({"survey": 1.8, "tune-nccl": 5.4})
    assert render_text(report).endswith("in 7.2 s (the survey 1.8 s, NCCL tuning 5.4 s)")
    assert report.to_json()["seconds"] == 7.2 and report.to_json()["timings"]["tune-nccl"] == 5.4


def test_the_collectives_record_is_named_by_its_real_run_id() -> None:
    """The phase line said 'it is recorded as runs/doctor-<id>', a placeholder: it names the
    run the collective is then recorded as."""
    fake, stream, ran = Healthy(), Stream(tty=False), []
    fake.progress = PhaseLines(stream, counter=Counter())
    measured = {"sum_ok": True, "world_size": 2, "backend": "gloo", "allreduce": [], "pairs": []}
    diagnose(inventory.parse_yaml("hosts: [a, b]\n", "x.yaml"), fake, Templates(), deep=True,
             run_deep=lambda run_id: ran.append(run_id) or measured)
    [run_id] = ran
    assert run_id.startswith("doctor-") and "<" not in run_id
    assert stream.text.splitlines()[-1].endswith(f"it is recorded as runs/{run_id}"), stream.text


def test_a_listener_refused_by_the_node_is_reported_in_words_not_json(tmp_path) -> None:
    """The node-side program says why as JSON; the launcher's error is that sentence."""
    import socket
    import sys
    from cluster.backends.local import LocalTransport
    from cluster.backends.supervised import SupervisedNode
    from cluster.errors import ClusterError
    taken = socket.socket()
    taken.bind(("", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    try:
        with pytest.raises(ClusterError) as caught:
            SupervisedNode(LocalTransport(), sys.executable, str(tmp_path)).listen(port, seconds=5)
    finally:
        taken.close()
    assert str(caught.value) == f"cannot listen on port {port}: Address already in use"


# --- --deep's progress: rank 0's '@@progress' lines, counted and said as they come --------------


def collective_module():
    spec = importlib.util.spec_from_file_location("collective", REMOTE / "collective.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_capture_hands_on_each_progress_line_and_ignores_a_malformed_one() -> None:
    heard = []
    capture = Capture(lambda done, total, say: heard.append((done, total, say)))
    for text in ['[W socket] gloo: connected to 10.0.0.2',
                 '@@progress {"done": 0, "total": 7, "say": ""}',
                 '@@progress {"done": 1, "total": 7, "say": "sum right over 6 processes"}',
                 'some rank warns about @@progress without JSON',
                 '@@progress {"done": 2, "total": 7, "say": "all_red',        # cut mid-line
                 '@@progress ["done", 2]', '@@progress {"done": "2", "total": 7}',
                 'rank1 printed this in between',
                 'prefix @@progress {"done": 2, "total": 7, "say": "all_reduce 64 KiB: 0.50 GB/s"}',
                 '@@progress {"done": 3, "total": 7}',
                 '@@doctor {"sum_ok": true}']:
        capture.node_line("node1", 0, text)
    assert heard == [(0, 7, ""), (1, 7, "sum right over 6 processes"),
                     (2, 7, "all_reduce 64 KiB: 0.50 GB/s"), (3, 7, "")]
    assert len(capture.lines) == 11, "every line is still kept (a failure shows the last ones)"
    Capture().node_line("node1", 0, '@@progress {"done": 1, "total": 2, "say": ""}')  # nobody told


def test_measure_collective_tells_its_steps_and_returns_the_result() -> None:
    def launch_job(inv, job, console) -> int:
        for say in ("sum right over 2 processes", "all_reduce 1 MiB: 1.00 GB/s bus bandwidth"):
            step = {"done": 1 + say.startswith("all"), "total": 2, "say": say}
            console.node_line("node1", 0, "@@progress " + json.dumps(step))
        console.node_line("node1", 0, '@@doctor {"sum_ok": true, "pairs": []}')
        return 0
    stream, counter = Stream(tty=False), Counter()
    lines = PhaseLines(stream, counter=counter)
    got = measure_collective(inventory.parse_yaml("hosts: [a, b]\n", "x.yaml"), launch_job,
                             Job(run_id="r", script="-"), {}, steps=step_lines(lines))
    assert got == {"sum_ok": True, "pairs": []}
    assert stream.text.splitlines() == [
        "cluster: measuring in 2 steps (the sum, each message size, each round of pairs)",
        "cluster:   sum right over 2 processes",
        "cluster:   all_reduce 1 MiB: 1.00 GB/s bus bandwidth"]
    assert counter.calls == [("measure", 1, 2), ("measure", 2, 2)]
    assert step_lines(None) is None


def test_a_progress_without_say_is_only_counted() -> None:
    heard = []
    steps = step_lines(lambda phase, done, total: heard.append((phase, done, total)))
    steps(1, 3, "sum right over 2 processes")
    steps(2, 3, "")
    assert heard == [("measure", 1, 3), ("measure", 2, 3)]


def test_says_are_lines_in_a_log_and_the_count_is_the_terminals() -> None:
    """Not a terminal: the header and each say, one line each, nothing redrawn."""
    stream = Stream(tty=False)
    lines = PhaseLines(stream)
    steps = step_lines(lines)
    for done, say in [(0, ""), (1, "sum right over 6 processes"),
                      (2, "all_reduce 64 KiB: 0.12 GB/s bus bandwidth"), (3, ""),
                      (4, "pairs: 3 measured, slowest a<->b 0.80 GB/s")]:
        steps(done, 4, say)
    lines.close()
    assert stream.text.splitlines() == [
        "cluster: measuring in 4 steps (the sum, each message size, each round of pairs)",
        "cluster:   sum right over 6 processes",
        "cluster:   all_reduce 64 KiB: 0.12 GB/s bus bandwidth",
        "cluster:   pairs: 3 measured, slowest a<->b 0.80 GB/s"]


def test_on_a_terminal_the_steps_are_counted_live_and_the_says_printed_above() -> None:
    import io

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True
    stream = Terminal()
    lines = PhaseLines(stream)
    steps = step_lines(lines)
    steps(0, 7, "")
    steps(1, 7, "sum right over 6 processes")
    steps(3, 7, "")
    assert lines.counter._bar is not None
    lines.close()
    text = stream.getvalue()
    assert "cluster: measured 3/7 steps" in text, text
    assert "nodes" not in text.replace("node(s)", ""), "the collective counts steps, not nodes"
    assert "cluster:   sum right over 6 processes\n" in text, text


def test_a_say_goes_through_the_live_count_while_it_is_drawn() -> None:
    class Drawn(Counter):
        def __init__(self) -> None:
            super().__init__()
            self.above_lines: list[str] = []

        def above(self, line: str) -> bool:
            self.above_lines.append(line)
            return True
    stream, counter = Stream(tty=True), Drawn()
    lines = PhaseLines(stream, counter=counter)
    lines("measure", 1, 2)
    lines.say("sum right over 2 processes")
    assert counter.above_lines == ["cluster:   sum right over 2 processes"]
    assert "sum right" not in stream.text


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
def test_the_collective_counts_the_sum_each_size_and_each_round_of_pairs() -> None:
    mod = collective_module()
    assert [len(mod.pair_rounds(n)) for n in range(1, 7)] == [0, 1, 3, 3, 5, 5]
    assert mod.total_steps(3, len(mod.pair_rounds(6))) == 1 + 3 + 5
    assert mod.total_steps(3, len(mod.pair_rounds(1))) == 4, "one node: no pairs to measure"
    assert [mod.size_text(n) for n in (65536, 1 << 20, 16 << 20, 3 << 19, 100)] == [
        "64 KiB", "1 MiB", "16 MiB", "1.5 MiB", "100 B"]
    assert mod.pairs_text([{"a": "a", "b": "b", "gbps": 0.8}, {"a": "a", "b": "c", "gbps": 2.0},
                           {"a": "b", "b": "c", "gbps": 1.9}]) == "pairs: 3 measured, slowest a<->b 0.80 GB/s"


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
def test_the_collective_on_one_process_prints_its_steps_before_the_result(tmp_path) -> None:
    """collective.py itself, one gloo process on this machine: each step as it ends."""
    import os
    import socket
    import subprocess
    import sys
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "CLUSTER_NODE": "n1", "CLUSTER_DOCTOR_SIZES": "1024,65536",
           "CLUSTER_DOCTOR_ITERS": "2"}
    done = subprocess.run([sys.executable, str(REMOTE / "collective.py")], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    heard = []
    capture = Capture(lambda *step: heard.append(step))
    for line in done.stdout.splitlines():
        capture.node_line("n1", 0, line)
    assert [(d, t) for d, t, _ in heard] == [(0, 3), (1, 3), (2, 3), (3, 3)]
    says = [s for _, _, s in heard]
    assert says[:2] == ["", "sum right over 1 process"]
    assert says[2].startswith("all_reduce 1 KiB: ") and says[3].startswith("all_reduce 64 KiB: ")
    assert all(s.endswith(" GB/s bus bandwidth") for s in says[2:])
    assert done.stdout.splitlines()[-1].startswith("@@doctor "), "the result stays last"


def gpu_plan(nproc: int = 2, args: tuple[str, ...] = (), env: str = "", container: str = ""):
    text = f"defaults: {{nproc_per_node: {nproc}{env}}}\nhosts: [a, b]\n" + container
    return render(inventory.parse_yaml(text, "x.yaml"), Job(run_id="r", script="t.py", args=args),
                  Templates())


def test_up_refuses_more_processes_than_a_node_has_gpus() -> None:
    """The fast check (cluster up, before anything starts): a node with 1 GPU and
    nproc_per_node 2 fails, naming the node, both counts and the fix; exit code 3."""
    from cluster.recovery.check import judge
    from cluster.console import Console
    from cluster.errors import PreflightError
    facts = {"a": node_facts(nvidia_gpus=1, cuda_visible=None),
             "b": node_facts(nvidia_gpus=2, cuda_visible=None)}
    found = evaluate(gpu_plan(), facts)
    [bad] = [f for f in found if f.status == FAIL]
    assert (bad.node, bad.check) == ("a", "gpus")
    assert "nproc_per_node 2 but this node shows 1 GPU(s)" in bad.detail
    assert "--nproc-per-node 1" in bad.fix and "--device cpu" in bad.fix
    with pytest.raises(PreflightError) as err:
        judge(found, 2, Console())
    assert err.value.exit_code == 3 and err.value.nodes == ["a"]
    assert "nothing was started" in str(err.value)


@pytest.mark.parametrize("why", ["cpu job", "gpus hidden on the node", "gpus hidden by the job",
                                 "no driver", "enough gpus", "container"])
def test_more_processes_than_gpus_is_fine_where_the_job_runs_on_the_cpu(why) -> None:
    plan = {"cpu job": gpu_plan(args=("--epochs", "1", "--device", "cpu")),
            "gpus hidden by the job": gpu_plan(env=", env: {CUDA_VISIBLE_DEVICES: ''}"),
            "container": gpu_plan(env=", container: {image: 'x:1'}")}.get(why, gpu_plan())
    facts = {"nvidia_gpus": {"no driver": None, "enough gpus": 2}.get(why, 1),
             "cuda_visible": "" if why == "gpus hidden on the node" else None}
    found = evaluate(plan, {"a": node_facts(**facts)})
    assert not by(found, "a", "gpus"), found


def test_the_jobs_own_cuda_visible_devices_counts() -> None:
    plan = gpu_plan(env=", env: {CUDA_VISIBLE_DEVICES: '3'}")
    found = evaluate(plan, {"a": node_facts(nvidia_gpus=8, cuda_visible="0,1,2,3")})
    assert "shows 1 GPU(s)" in by(found, "a", "gpus")[0].detail


def test_the_probe_counts_the_drivers_gpus(tmp_path) -> None:
    import subprocess
    import sys
    for pci in ("0000:18:00.0", "0000:2a:00.0"):
        (tmp_path / pci).mkdir()
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import health; "
            "print(health.nvidia_gpus(sys.argv[2]), health.nvidia_gpus(sys.argv[2] + '/none'))")
    out = subprocess.run([sys.executable, "-c", code, str(REMOTE), str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["2", "None"], out.stderr
