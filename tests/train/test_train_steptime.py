"""train/steptime.py's step reports, in process on CPU: each line's `seconds` is the wall-clock
time its steps took (the first line: from its first step's start), so steps / seconds is the
rank's step rate."""
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_helpers import load_train_module  # noqa: E402

steptime = load_train_module("steptime")

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
    assert second["steps"] >= 2
    assert 0.3 <= second["seconds"] <= took, (second, took)
    rate = second["steps"] / second["seconds"]
    assert rate <= 1 / PAUSE, "a step takes at least its pause"
    assert second["compute"] < PAUSE, "the pause is not compute"
    assert not (tmp_path / "heartbeat.steps.3.tmp").exists()
