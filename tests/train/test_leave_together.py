"""train/dist_utils.leave_together under real torchrun (gloo, 2 ranks): no rank leaves before
every rank has torn its process group down (a peer exiting while another was still tearing
down aborted it: SIGABRT after FINAL), and a rank that never arrives holds the others only for
the timeout."""
from __future__ import annotations

import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_helpers import REPO, free_port, train_env  # noqa: E402

PROGRAM = r"""
import json, os, sys, time
sys.path.insert(0, os.path.join(sys.argv[1], "train"))
import dist_utils as du
info = du.init_distributed("cpu")
du.barrier(info)
t0 = time.time()
if info.rank == 1:
    time.sleep(float(sys.argv[2]))         # this rank is slow to tear down
du.leave_together(info, timeout=float(sys.argv[3]))
print("LEFT " + json.dumps({"rank": info.rank, "waited": time.time() - t0}), flush=True)
"""


def run(tmp_path, slow: float, timeout: float) -> dict[int, float]:
    prog = tmp_path / "leave.py"
    prog.write_text(PROGRAM)
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                        "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
                        str(prog), str(REPO), str(slow), str(timeout)],
                       env=train_env(), text=True, capture_output=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    left = [json.loads(line.split("LEFT ", 1)[1]) for line in p.stdout.splitlines() if "LEFT " in line]
    return {r["rank"]: r["waited"] for r in left}


def test_no_rank_leaves_before_every_rank_has_torn_down(tmp_path) -> None:
    waited = run(tmp_path, slow=2.0, timeout=30.0)
    assert sorted(waited) == [0, 1]
    assert waited[0] >= 1.9          # rank 0 waited for the slow rank 1's tear-down


def test_a_rank_that_does_not_arrive_holds_the_others_only_for_the_timeout(tmp_path) -> None:
    waited = run(tmp_path, slow=6.0, timeout=1.0)
    assert 0.9 <= waited[0] < 4.0
