"""Resume: runs stopped (--max-steps), SIGKILLed mid-run, or SIGKILLed in the middle of
writing a checkpoint, and then resumed, end exactly like an uninterrupted run."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_helpers import (checkpoints, final_weights, kill_tree, load_ckpt,  # noqa: E402
                           max_abs_diff, run_train, start_train, wait_for)

EPOCHS, SPE = 2, 22  # digits: 1438 train images, 2 ranks x batch 32 -> 22 steps/epoch
ARGS = ["--epochs", str(EPOCHS), "--ckpt-every", "10", "--log-every", "5", "--no-plot", "--seed", "1"]
WEIGHT_ATOL = 1e-6  # same computation replayed: observed difference is 0


def epoch_records(out):
    recs = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    return [r for r in recs if r["type"] == "epoch"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("full")
    final = run_train(2, ARGS + ["--out", str(out), "--no-resume"])
    assert final["steps"] == EPOCHS * SPE and not final["stopped_early"]
    return final, final_weights(out), epoch_records(out)


def assert_same_as_uninterrupted(final, out, uninterrupted):
    ref_final, ref_w, ref_epochs = uninterrupted
    assert final["steps"] == ref_final["steps"] == EPOCHS * SPE
    assert final["epochs"] == ref_final["epochs"] == EPOCHS
    assert final["train_loss"] == pytest.approx(ref_final["train_loss"], rel=1e-9, abs=1e-12)
    assert final["val_acc"] == ref_final["val_acc"]
    diff = max_abs_diff(final_weights(out), ref_w)
    assert diff <= WEIGHT_ATOL, f"final weights differ by {diff}"
    # metrics.jsonl reads like one run: one record per epoch, same numbers
    eps = epoch_records(out)
    assert [e["step"] for e in eps] == [e["step"] for e in ref_epochs]
    for a, b in zip(eps, ref_epochs):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-9)


def test_resume_after_max_steps(uninterrupted, tmp_path):
    first = run_train(2, ARGS + ["--out", str(tmp_path), "--max-steps", "27"])
    assert first["steps"] == 27 and first["stopped_early"]
    st = load_ckpt(checkpoints(tmp_path)[-1])
    assert (st["step"], st["epoch"], st["step_in_epoch"]) == (27, 1, 27 - SPE)  # mid-epoch
    final = run_train(2, ARGS + ["--out", str(tmp_path)])  # default: resume from --out
    assert final["resumed_from"].endswith("ckpt_step00000027.pt")
    assert_same_as_uninterrupted(final, tmp_path, uninterrupted)


def test_no_resume_starts_fresh(tmp_path):
    # An unloadable "newest checkpoint": resume would have to warn about it.
    (tmp_path / "ckpt_step00000099.pt").write_bytes(b"not a checkpoint")
    final = run_train(1, ["--epochs", "1", "--max-steps", "2", "--no-plot", "--out", str(tmp_path),
                          "--no-resume"])
    assert final["resumed_from"] is None and final["steps"] == 2
    assert "cannot load" not in final["_stdout"]


def test_resume_after_sigkill_mid_run(uninterrupted, tmp_path):
    proc = start_train(2, ARGS + ["--out", str(tmp_path)],
                       env={"CLUSTER_TRAIN_TEST_STEP_SLEEP": "0.1"})
    try:
        wait_for(lambda: checkpoints(tmp_path), 120, proc, "the first checkpoint")
    finally:
        kill_tree(proc.pid)
    out = proc.communicate(timeout=30)[0]
    assert "FINAL" not in out, "the run finished before it was killed"
    last = load_ckpt(checkpoints(tmp_path)[-1])
    assert 0 < last["step"] < EPOCHS * SPE
    final = run_train(2, ARGS + ["--out", str(tmp_path)])
    assert final["resumed_from"] and final["resumed_from"].endswith(f"ckpt_step{last['step']:08d}.pt")
    assert_same_as_uninterrupted(final, tmp_path, uninterrupted)


def test_sigkill_during_checkpoint_write(uninterrupted, tmp_path):
    """Kill while the step-20 checkpoint sits in its temp file (written, not renamed):
    every visible checkpoint loads, the temp is never used, and resume is exact."""
    proc = start_train(2, ARGS + ["--out", str(tmp_path)],
                       env={"CLUSTER_TRAIN_TEST_SAVE_SLEEP": "20:120"})
    try:
        tmps = wait_for(lambda: list(tmp_path.glob(".ckpt_step00000020.pt.tmp.*")), 120, proc,
                        "the step-20 checkpoint's temp file")
    finally:
        kill_tree(proc.pid)
    proc.communicate(timeout=30)
    visible = checkpoints(tmp_path)
    assert [p.name for p in visible] == ["ckpt_step00000010.pt"]
    for p in visible:
        assert load_ckpt(p)["step"] == 10
    # make the stray temp file truly half-written: resume must neither load nor keep it
    tmp = tmps[0]
    tmp.write_bytes(tmp.read_bytes()[: tmp.stat().st_size // 2])
    final = run_train(2, ARGS + ["--out", str(tmp_path)])
    assert final["resumed_from"].endswith("ckpt_step00000010.pt")
    assert not list(tmp_path.glob(".ckpt_*.tmp.*"))
    assert_same_as_uninterrupted(final, tmp_path, uninterrupted)
