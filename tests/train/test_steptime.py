"""train/steptime.py in process: what a rank reports as its own compute per step.

On CUDA the kernels run after the Python that queued them has returned, so a clock read in
the hooks would count the launch, not the work: the compute is read from CUDA events recorded
in those hooks. The check queues GPU work that takes a known time (torch.cuda._sleep) inside
the forward and asserts that it is counted, while the CPU spent next to nothing there; each
step's end comes right after its work was queued, when its events have not completed (reading
one then raises), as in the trainer, which never waits for the GPU per step. Each line's `seconds`
is the wall-clock time its steps took (the first line: from its first step's start), so steps /
seconds is the rank's step rate (cluster top's step/s)."""
import json
import os
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_helpers import load_train_module  # noqa: E402

steptime = load_train_module("steptime")

# `cuda`: this skip is allowed under CLUSTER_REQUIRE_INTEGRATION=1 (tests/require.py)
CUDA = [pytest.mark.cuda,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


class Busy(torch.nn.Module):
    """A linear layer whose forward first queues `cycles` of GPU sleep (none on the CPU)."""

    def __init__(self, cycles: int = 0):
        super().__init__()
        self.cycles = cycles
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        if self.cycles:
            torch.cuda._sleep(self.cycles)
        return self.linear(x)


def steps(device: torch.device, model: torch.nn.Module, path: str, n: int = 3) -> float:
    """Run n steps through StepTimes, each step's end right after its work was queued (no
    synchronisation), then wait for the device and write what was counted; the CPU seconds
    spent in the forward calls."""
    times = steptime.StepTimes(path, 0, device, every_s=0.0)
    times.watch(model)
    batches = iter([torch.ones(4, 8, device=device)] * n)
    in_forward = 0.0
    for _ in range(n):
        times.begin()
        x = times.next(batches)
        t = time.perf_counter()
        out = model(x)
        in_forward += time.perf_counter() - t
        out.sum().backward()
        times.end()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    times.flush()
    return in_forward


def report(path) -> dict:
    return json.loads(open(f"{path}.steps.0").read())


def test_cpu_compute_is_the_forward_and_backward(tmp_path):
    path = str(tmp_path / "heartbeat")
    steps(torch.device("cpu"), Busy(), path)
    line = report(path)
    assert line["rank"] == 0 and line["steps"] >= 1
    assert 0 < line["compute"] < 1.0 and line["data"] >= 0


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=CUDA)])
def test_cuda_compute_counts_the_gpu_work_not_its_launch(tmp_path, device):
    dev = torch.device(device)
    # ~0.25 s at an H100/H200's top clock (about 2 GHz); longer at a lower clock
    model = Busy(cycles=500_000_000).to(dev)
    steps(dev, Busy().to(dev), str(tmp_path / "warm"), n=2)     # CUDA's start-up, not counted
    path = str(tmp_path / "heartbeat")
    in_forward = steps(dev, model, path)
    line = report(path)
    assert in_forward / 3 < 0.05, "the forward waited for the GPU: the check shows nothing"
    assert line["steps"] == 3, line               # every step counted, once its events completed
    assert line["compute"] >= 0.15, line          # the GPU's sleep, counted by the events


class FakeEvent:
    """A CUDA event's stand-in: completes when the test says; read before that, it raises
    as CUDA's does ("device not ready")."""
    made: list = []

    def __init__(self, at: float):
        self.at, self.done, self.waited = at, False, False
        FakeEvent.made.append(self)

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited = self.done = True

    def elapsed_time(self, end: "FakeEvent") -> float:
        if not (self.done and end.done):
            raise RuntimeError("CUDA error: device not ready")
        return (end.at - self.at) * 1e3


def fake_steps(tmp_path, n: int, complete: bool = False):
    """n steps of a CPU model through StepTimes' CUDA path, its events fakes 10 ms apart."""
    FakeEvent.made = []
    clock = iter(range(10_000))
    times = steptime.StepTimes(str(tmp_path / "heartbeat"), 0, torch.device("cuda"), every_s=0.0,
                               new_event=lambda: FakeEvent(next(clock) * 0.01))
    model = torch.nn.Linear(4, 1, bias=False)   # one parameter: two events a step
    times.watch(model)
    batches = iter([torch.ones(2, 4)] * n)
    for _ in range(n):
        times.begin()
        model(times.next(batches)).sum().backward()
        if complete:
            for ev in FakeEvent.made:
                ev.done = True
        times.end()
    return times


def test_events_are_read_only_once_they_have_completed(tmp_path):
    """A step's end finds its events not yet completed (the GPU runs behind): it waits for
    nothing and reads them at a later step's end, once they have completed."""
    line = tmp_path / "heartbeat.steps.0"
    times = fake_steps(tmp_path, 3)                 # before: elapsed_time raised at once
    assert not line.exists() and times.steps == 0
    assert not any(ev.waited for ev in FakeEvent.made)
    for ev in FakeEvent.made[:4]:                  # the GPU has done the first two steps
        ev.done = True
    times.end()
    got = json.loads(line.read_text())
    assert got["steps"] == 2 and got["compute"] == pytest.approx(0.01), got
    for ev in FakeEvent.made:
        ev.done = True
    times.flush()
    assert json.loads(line.read_text())["steps"] == 1
    assert not any(ev.waited for ev in FakeEvent.made)


def test_a_cpu_far_ahead_waits_only_for_the_oldest_step(tmp_path):
    times = fake_steps(tmp_path, steptime.MAX_PENDING + 3)
    waited = [ev.waited for ev in FakeEvent.made]
    assert waited == [True] * 6 + [False] * (len(waited) - 6)    # 3 steps x 2 events
    line = json.loads((tmp_path / "heartbeat.steps.0").read_text())    # one a step (every_s 0)
    assert line["steps"] == 1 and line["compute"] == pytest.approx(0.01)
    assert len(times._pending) == steptime.MAX_PENDING


def test_completed_events_are_read_at_the_step_s_end(tmp_path):
    fake_steps(tmp_path, 2, complete=True)
    assert json.loads((tmp_path / "heartbeat.steps.0").read_text())["steps"] == 1   # the 2nd's


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=CUDA)])
def test_the_trainer_reports_its_step_times_on_cuda(tmp_path, device):
    """The whole trainer on the GPU: every event it records is read once it has completed (a
    read of an event not yet done would raise), and each step's compute is reported."""
    from train_helpers import run_train
    beat = tmp_path / "run" / "heartbeat"
    beat.parent.mkdir()
    run_train(1, ["--device", device, "--epochs", "1", "--max-steps", "30", "--ckpt-every", "0",
                  "--no-plot", "--no-resume", "--out", str(tmp_path / "out")],
              env={"CLUSTER_HEARTBEAT_FILE": str(beat)})
    line = json.loads((tmp_path / "run" / "heartbeat.steps.0").read_text())
    assert line["steps"] >= 1 and 0 < line["compute"] < 5.0, line


PAUSE = 0.05


def one_step(st, model, batches) -> None:
    st.begin()
    x = st.next(batches)
    model(x).sum().backward()
    time.sleep(PAUSE)               # wall-clock time that is neither compute nor data
    st.end()


def test_each_line_says_the_seconds_its_steps_took(tmp_path):
    model = torch.nn.Linear(4, 1)
    beat = tmp_path / "heartbeat"
    st = steptime.StepTimes(str(beat), 3, torch.device("cpu"), every_s=0.3)
    st.watch(model)
    batches = iter([torch.ones(2, 4)] * 100)
    one_step(st, model, batches)                     # the first step is written at once
    first = json.loads((tmp_path / "heartbeat.steps.3").read_text())
    assert first["rank"] == 3 and first["steps"] == 1
    assert PAUSE <= first["seconds"] < PAUSE + 1.0
    t0 = time.monotonic()
    while json.loads((tmp_path / "heartbeat.steps.3").read_text()) == first:
        one_step(st, model, batches)
    took = time.monotonic() - t0
    second = json.loads((tmp_path / "heartbeat.steps.3").read_text())
    # windows start at whole wall-clock periods now: the second line may hold one step
    assert second["steps"] >= 1
    assert 0 < second["seconds"] <= took + 0.02, (second, took)
    rate = second["steps"] / second["seconds"]
    assert rate <= 1 / PAUSE, "a step takes at least its pause"
    assert second["compute"] < PAUSE, "the pause is not compute"
    assert not (tmp_path / "heartbeat.steps.3.tmp").exists()


class Clock:
    """A wall clock the test sets: the moment a rank's step ends."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def node_reader():
    """cluster/remote/status.py, which reads a rank's line on its node for `cluster top`."""
    import importlib.util
    remote = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "cluster", "remote")
    sys.path.insert(0, os.path.abspath(remote))        # status.py imports options beside it
    spec = importlib.util.spec_from_file_location("node_status", os.path.join(remote, "status.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_ranks_of_a_synchronous_job_report_the_same_rate(tmp_path):
    """Three nodes' ranks end each step together, each leaving it a moment apart (up to 60 ms:
    the optimizer step and the metrics after the all-reduce, on a busy machine), steps of
    uneven length (an evaluation, a slow batch now and then). Each node's file is read after
    every step, as `cluster top` may at any moment: the ranks' rates agree, after the first
    few seconds, within 20% at worst (3x before: 1 s windows of their own)."""
    import random
    status = node_reader()
    rnd = random.Random(7)
    ends, t = [], 1000.3
    for _ in range(400):
        t += rnd.expovariate(1 / 0.14) if rnd.random() < 0.9 else 0.6
        ends.append(t)
    model = torch.nn.Linear(4, 1)
    clocks = [Clock() for _ in range(3)]
    beats = [str(tmp_path / f"node{r}" / "heartbeat") for r in range(3)]
    ranks = [steptime.StepTimes(beats[r], r, torch.device("cpu"), clock=clocks[r]) for r in range(3)]
    for r, st in enumerate(ranks):
        (tmp_path / f"node{r}").mkdir()
        st.watch(model)
    batches = iter([torch.ones(2, 4)] * 2000)
    worst = 1.0
    for k, end in enumerate(ends):
        for r, st in enumerate(ranks):
            clocks[r].now = (ends[k - 1] if k else 1000.0) + 0.001 * r
            st.begin()
            model(st.next(batches)).sum().backward()
            clocks[r].now = end + 0.06 * rnd.random()       # this rank's way out of the step
            st.end()
        if end > 1000.0 + 2 * steptime.RATE_S:
            rates = [status.steps(beat)[0]["rate"] for beat in beats]
            worst = max(worst, max(rates) / min(rates))
    assert worst < 1.2, f"the ranks' rates differed by {worst:.2f}x"


def test_the_heartbeat_says_its_section_while_a_checkpoint_is_written(tmp_path):
    """train/lifecycle.py's Heartbeat.section: the file holds `section NAME` while it lasts
    (cluster's --hang-timeout auto allows for it) and nothing after; each change is a beat."""
    lifecycle = load_train_module("lifecycle")
    path = tmp_path / "heartbeat"
    hb = lifecycle.Heartbeat(str(path))
    assert path.read_text() == ""
    os.utime(path, (0, 0))
    with hb.section("checkpoint"):
        assert path.read_text() == "section checkpoint\n"
        assert path.stat().st_mtime > 0                    # the move is a beat
        os.utime(path, (0, 0))
        hb.beat()                                          # another rank's beat meanwhile
    assert path.read_text() == "" and path.stat().st_mtime > 0
    assert [p.name for p in tmp_path.iterdir()] == ["heartbeat"]


def test_each_line_names_the_training_step_and_a_checkpoint_is_said_at_once(tmp_path):
    """CPU. The step the program counts (a resumed run's, not this process's) goes with each
    line; a checkpoint written is a line of its own at once, and mark() writes the step
    reached (on the way out of a failed step); with no step counted since, the last line's
    times stay in it (`cluster top` reads them: a stopped rank reads as stalled, not as
    never reported)."""
    path = str(tmp_path / "heartbeat")
    times = steptime.StepTimes(path, 0, torch.device("cpu"), every_s=3600.0)
    model = Busy()
    times.watch(model)
    batches = iter([torch.ones(4, 8)] * 3)
    for step in (41, 42):                      # resumed at step 40
        times.begin()
        model(times.next(batches)).sum().backward()
        times.end(step)
    assert report(path)["step"] == 41 and "checkpoint" not in report(path)   # the first only
    times.saved(42, 0.75)
    line = report(path)
    assert (line["step"], line["checkpoint"], line["steps"], line["saving"]) == (42, 42, 1, 0.75)
    times.begin()
    model(times.next(batches)).sum().backward()
    times.end(43)
    os.remove(f"{path}.steps.0")
    times.mark()
    line = report(path)
    assert (line["steps"], line["step"], line["checkpoint"]) == (1, 43, 42) and line["compute"] > 0
    os.remove(f"{path}.steps.0")
    times.saved(43, 0.5)                       # nothing counted since: the last times stay
    assert report(path) == {**line, "checkpoint": 43, "saving": 1.25}   # the saves add up
    fresh = steptime.StepTimes(str(tmp_path / "other"), 1, torch.device("cpu"))
    fresh.saved(7)                             # no line yet: the counts alone
    assert json.loads(open(f"{tmp_path}/other.steps.1").read()) == {"rank": 1, "checkpoint": 7}
