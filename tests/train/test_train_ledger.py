"""StepLedger: a stop saves the newest optimizer step whose update has finished on the device,
also while later work is stuck on the GPU's stream (the CUDA case runs where a GPU is)."""
import os
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_helpers import load_train_module  # noqa: E402

lifecycle = load_train_module("lifecycle")
NEEDS_CUDA = [pytest.mark.cuda,   # a skip allowed under CLUSTER_REQUIRE_INTEGRATION=1
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DEVICES = ["cpu", pytest.param("cuda", marks=NEEDS_CUDA)]


class Trainee:
    def __init__(self, device: str):
        torch.manual_seed(0)
        self.device = torch.device(device)
        self.model = torch.nn.Linear(256, 256).to(self.device)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        self.step = 0
        self.ledger = lifecycle.StepLedger(self.device, {"step": 0})

    def train_step(self, fail_in_update: bool = False) -> None:
        self.model(torch.randn(64, 256, device=self.device)).square().mean().backward()
        with self.ledger.update(lambda: {"step": self.step}):
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            if fail_in_update:
                raise RuntimeError("half-done update")
            self.step += 1

    def state(self) -> dict:
        return lifecycle.to_cpu({"model": self.model.state_dict(), "optimizer": self.opt.state_dict()})


def same(a: dict, b: dict) -> bool:
    return all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


@pytest.mark.parametrize("device", DEVICES)
def test_capture_returns_the_newest_finished_step(device):
    t = Trainee(device)
    assert t.ledger.capture(t.state, wait_s=1.0)[0] == {"step": 0}  # nothing done yet: the start
    for _ in range(3):
        t.train_step()
    point, state = t.ledger.capture(t.state, wait_s=5.0)
    assert point == {"step": 3} and same(state, t.state())


def test_a_half_done_update_is_never_saved():
    t = Trainee("cpu")
    t.train_step()
    with pytest.raises(RuntimeError):
        t.train_step(fail_in_update=True)
    assert t.ledger.capture(t.state, wait_s=0.1) is None


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_capture_skips_an_update_stuck_behind_other_work():
    """Step 4 is queued behind a 3-second kernel (as behind a collective whose peer left):
    capture does not wait for it and returns step 3's state, read on a side stream."""
    t = Trainee("cuda")
    for _ in range(3):
        t.train_step()
    torch.cuda.synchronize()
    after3 = t.state()
    torch.cuda._sleep(6_000_000_000)  # cycles: 3 s or more at an H100/H200's top clock
    t.train_step()  # queued behind the sleep
    t0 = time.monotonic()
    point, state = t.ledger.capture(t.state, wait_s=0.3)
    took = time.monotonic() - t0
    assert point == {"step": 3} and same(state, after3)
    assert took < 2.0, f"capture waited {took:.1f} s for the stuck stream"
    torch.cuda.synchronize()
    point, state = t.ledger.capture(t.state, wait_s=1.0)
    assert point == {"step": 4} and not same(state, after3)


FORK_CHECK = """
import os, signal, sys, time
sys.path.insert(0, sys.argv[1])
import lifecycle
stop = lifecycle.GracefulStop(timeout_s=60)
stop.install()
pid = os.fork()
if pid == 0:  # a DataLoader worker, say
    time.sleep(30)
    os._exit(0)
time.sleep(0.2)
os.kill(pid, signal.SIGTERM)
_, status = os.waitpid(pid, 0)
time.sleep(0.3)
print(os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM, stop.requested.is_set())
"""


def test_forked_children_keep_the_default_sigterm_and_cannot_fake_a_stop():
    """A SIGTERM to a forked worker ends it (default action) and is not taken, through the
    inherited wakeup fd, for a stop request of the trainer."""
    import subprocess
    from train_helpers import REPO
    out = subprocess.run([sys.executable, "-c", FORK_CHECK, str(REPO / "train")], text=True,
                         capture_output=True, timeout=60)
    assert out.stdout.split() == ["True", "False"], out.stdout + out.stderr


def test_the_stop_waits_a_few_steps_time_for_a_boundary_and_longer_while_a_save_runs():
    """StepPace: 3x the slowest of the last steps, at least 1 s; unknown (the whole
    --stop-timeout) before three boundaries and while a checkpoint or an evaluation runs,
    whose gap is not a step's."""
    now = [0.0]
    pace = lifecycle.StepPace(clock=lambda: now[0])
    for t in (0.0, 0.5):
        now[0] = t
        pace.boundary()
    assert pace.patience() is None
    for t in (1.2, 1.4):
        now[0] = t
        pace.boundary()
    assert pace.patience() == pytest.approx(3 * 0.7)
    with pace.long():
        now[0] = 60.0
        assert pace.patience() is None
    now[0] = 60.1
    pace.boundary()
    assert pace.patience() is None            # the save's minute is no step: counted anew
    now[0] = 60.2
    pace.boundary()
    assert pace.patience() == pytest.approx(1.0)     # 3 x 0.1 s, at least 1 s
