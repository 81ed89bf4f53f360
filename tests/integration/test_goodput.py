"""Goodput, for real: three SSH test nodes run the reference trainer, whose rank 0 fails at a
step of the first attempt (the trainer's test hook); `--max-restarts 1` restarts the job from
its newest checkpoint. The goodput the launcher says, records and draws adds up to the run's
wall time, measured here with this test's own clock, within 1%."""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

TRAIN = ["--", "cluster-train/train.py", "--epochs", "4",
         "--ckpt-every", "10", "--log-every", "20", "--no-plot", "--no-resume", "--out", "out"]
LINE = re.compile(r"cluster: goodput (\d+\.\d)% of (\d+\.\d) s: (.*)$")


def test_a_run_with_one_restart_adds_up_to_its_wall_time(ssh_nodes4, cli):
    inv = Path(ssh_nodes4.write_inventory(
        cli.home / "inv.yaml", nodes=[1, 2, 3],
        setup=["export CLUSTER_TRAIN_TEST_STEP_SLEEP=0.2",
               "export CLUSTER_TRAIN_TEST_FAIL_AT_STEP=35"]))
    began = time.time()                       # before the launcher's process exists
    proc = cli.start("up", "-i", str(inv), "--max-restarts", "1", *TRAIN)
    assert proc.wait(600) == 0, proc.dump()
    said = [m for line in proc.err if (m := LINE.match(line))]
    assert len(said) == 1, proc.dump()
    run = cli.cwd / "runs" / proc.run_id()
    recorded = json.loads((run / "run.json").read_text())["goodput"]
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    outcome = events[-1]
    assert outcome["kind"] == "outcome" and outcome["goodput"]["fraction"] == recorded["fraction"]

    # the parts add up to the wall time; the wall time is the run's, by this test's clock
    # (from before the launcher started to its last event: the interpreter's own start, a
    # few tens of ms, is the only time outside goodput's)
    wall = outcome["t"] - began
    assert sum(recorded["parts"].values()) == pytest.approx(recorded["wall"], rel=1e-3)
    assert recorded["wall"] == pytest.approx(wall, rel=0.01), (recorded["wall"], wall)
    assert float(said[0].group(2)) == pytest.approx(recorded["wall"], abs=0.05)

    parts = recorded["parts"]
    first, second = recorded["attempts"]
    print(json.dumps(recorded, indent=1))
    # the failure at step 35 after a checkpoint at step 30: 5 steps (1 s and more) redone
    assert first["parts"]["redone"] > 0.9 and second["parts"]["redone"] == 0
    assert first["parts"]["restart"] > 0 and second["parts"]["restart"] > 0
    assert parts["checkpoint"] > 0 and parts["startup"] > 0 and parts["rendezvous"] > 0
    assert 0.3 < recorded["fraction"] < 1 and recorded["measured"] == "steps"
    # an outside measure of the training: 60 steps kept (4 epochs of 15), each at least its
    # 0.2 s sleep; the first of each attempt is the start's (its beat ends it)
    assert recorded["productive"] >= (60 - 2) * 0.2, recorded["productive"]
    deadline = time.monotonic() + 60          # drawn beside the prompt, by a process of its own
    while not (run / "timeline.json").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    timeline = json.loads((run / "timeline.json").read_text())
    assert {s[2] for s in timeline["goodput"]["segments"]} >= {"startup", "rendezvous", "training",
                                                               "redone", "restart", "ending"}
