"""Resume: runs stopped (--max-steps), SIGKILLed mid-run, SIGKILLed in the middle of
writing a checkpoint, or stopped with SIGTERM (all ranks at once, one rank first, or with the
main thread stuck), and then relaunched, end like an uninterrupted run."""
import json
import os
import re
import signal
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_helpers import (checkpoints, final_weights, kill_tree, load_ckpt,  # noqa: E402
                           max_abs_diff, run_train, start_train, step_logged, wait_for, worker_pid)

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


def assert_same_as_uninterrupted(final, out, uninterrupted, ckpt_dir=None, loss_rel=1e-9):
    """Same steps and weights; the reported epoch losses match to `loss_rel` (a checkpoint
    written on SIGTERM lacks the loss sums of the steps since the last log line)."""
    ref_final, ref_w, ref_epochs = uninterrupted
    assert final["steps"] == ref_final["steps"] == EPOCHS * SPE
    assert final["epochs"] == ref_final["epochs"] == EPOCHS
    assert final["train_loss"] == pytest.approx(ref_final["train_loss"], rel=loss_rel, abs=1e-12)
    assert final["val_acc"] == ref_final["val_acc"]
    diff = max_abs_diff(final_weights(ckpt_dir or out), ref_w)
    assert diff <= WEIGHT_ATOL, f"final weights differ by {diff}"
    # metrics.jsonl reads like one run: one record per epoch, same numbers
    eps = epoch_records(out)
    assert [e["step"] for e in eps] == [e["step"] for e in ref_epochs]
    for a, b in zip(eps, ref_epochs):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=loss_rel)


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


STOP_LINE = re.compile(r"stop requested \(SIGTERM\): saved step (\d+) to (\S+)")
STOP_LOSS_REL = 0.05  # the loss sums of at most --log-every steps are missing from one epoch


def saved_on_stop(out_text: str, ckpt_dir) -> int:
    """The step rank 0 saved on the stop; it is the newest complete checkpoint."""
    m = STOP_LINE.search(out_text)
    assert m, f"no stop checkpoint was reported:\n{out_text[-4000:]}"
    step = int(m.group(1))
    assert 0 < step < EPOCHS * SPE and "FINAL" not in out_text
    assert load_ckpt(checkpoints(ckpt_dir)[-1])["step"] == step
    assert not list(ckpt_dir.glob(".ckpt_*")), "a temp file of a save was left behind"
    return step


def test_sigterm_saves_last_step_and_a_relaunch_finishes_the_run(uninterrupted, tmp_path):
    """SIGTERM to torchrun (it forwards it to both workers) after the step-10 checkpoint:
    rank 0 saves the step it stopped at into --checkpoint-dir; a later launch with another
    --out resumes from there. Also: the heartbeat advances, the restart count is reported."""
    ck, hb, first = tmp_path / "ckpt", tmp_path / "hb" / "beat", tmp_path / "attempt0"
    proc = start_train(2, ARGS + ["--out", str(first), "--checkpoint-dir", str(ck)],
                       env={"CLUSTER_TRAIN_TEST_STEP_SLEEP": "0.1", "CLUSTER_HEARTBEAT_FILE": str(hb),
                            "CLUSTER_RESTART_COUNT": "0"})
    try:
        wait_for(lambda: hb.exists(), 120, proc, "the heartbeat file")
        beat = hb.stat().st_mtime_ns
        wait_for(lambda: hb.stat().st_mtime_ns > beat, 60, proc, "the heartbeat to advance")
        wait_for(lambda: step_logged(first, 15), 120, proc, "step 15")
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=60)[0]
    finally:
        kill_tree(proc.pid)
    assert proc.returncode != 0
    assert "restart_count=0" in out
    step = saved_on_stop(out, ck)
    assert step >= 15
    final = run_train(2, ARGS + ["--out", str(first), "--checkpoint-dir", str(ck)],
                      env={"CLUSTER_RESTART_COUNT": "1"})
    assert final["resumed_from"].endswith(f"ckpt_step{step:08d}.pt")
    assert final["restart_count"] == 1 and "restart_count=1" in final["_stdout"]
    assert_same_as_uninterrupted(final, first, uninterrupted, ck, loss_rel=STOP_LOSS_REL)


def test_peer_stopping_first_fails_rank0s_collective_and_rank0_still_saves(uninterrupted, tmp_path):
    """SIGTERM to rank 1 alone: it leaves at its next boundary, rank 0's next collective fails
    (torchrun then stops it too), and rank 0 saves its last completed step."""
    proc = start_train(2, ARGS + ["--out", str(tmp_path)],
                       env={"CLUSTER_TRAIN_TEST_STEP_SLEEP": "0.1"})
    try:
        wait_for(lambda: step_logged(tmp_path, 15), 120, proc, "step 15")
        os.kill(worker_pid(proc.pid, rank=1), signal.SIGTERM)
        out = proc.communicate(timeout=60)[0]
    finally:
        kill_tree(proc.pid)
    assert "exitcode  : 143" in out, out[-4000:]  # torchrun's report of rank 1
    step = saved_on_stop(out, tmp_path)
    final = run_train(2, ARGS + ["--out", str(tmp_path)])
    assert final["resumed_from"].endswith(f"ckpt_step{step:08d}.pt")
    assert_same_as_uninterrupted(final, tmp_path, uninterrupted, loss_rel=STOP_LOSS_REL)


# `cuda`: this skip is allowed under CLUSTER_REQUIRE_INTEGRATION=1 (tests/require.py)
CUDA = [pytest.mark.cuda,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("stop_timeout, at_least, under", [(1, 1.0, 60.0), (30, 1.0, 10.0)])
def test_watchdog_saves_when_the_main_thread_is_stuck(tmp_path, device, stop_timeout, at_least,
                                                      under):
    """The main thread blocks after step 12 (as in a collective whose peer has left) and never
    reaches a boundary: the watchdog thread saves step 12 and the process exits with 143. It
    waits --stop-timeout at most, and no longer than a few steps' time (at least 1 s): the
    steps took milliseconds, so a boundary that has not come by then will not, and the
    launcher waits for this stop before it restarts the job (--stop-timeout 30: not 30 s)."""
    proc = start_train(1, ["--epochs", "1", "--log-every", "5", "--ckpt-every", "0", "--no-plot",
                           "--stop-timeout", str(stop_timeout), "--device", device,
                           "--out", str(tmp_path)],
                       env={"CLUSTER_TRAIN_TEST_HANG_AFTER_STEP": "12"})
    try:
        wait_for(lambda: step_logged(tmp_path, 10), 120, proc, "step 10")
        time.sleep(1.0)  # steps take milliseconds: by now the main thread is stuck after step 12
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=60)[0]
        took = time.monotonic() - t0
    finally:
        kill_tree(proc.pid)
    assert proc.returncode == 143, out[-3000:]
    assert "saving from the watchdog" in out and at_least <= took < under, (took, out[-2000:])
    assert saved_on_stop(out, tmp_path) == 12


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_sigterm_on_cuda_saves_and_a_relaunch_finishes(tmp_path):
    """One process on a GPU: SIGTERM mid-run saves the step reached (CUDA events, side-stream
    copy), exit code 143; the relaunch resumes there and runs to the end."""
    args = ["--device", "cuda", "--dataset", "synthetic", "--image-size", "32", "--num-classes", "10",
            "--steps-per-epoch", "300", "--epochs", "1", "--batch-size", "64", "--log-every", "10",
            "--ckpt-every", "0", "--no-plot", "--out", str(tmp_path)]
    proc = start_train(1, args, env={"CLUSTER_TRAIN_TEST_STEP_SLEEP": "0.01"})
    try:
        wait_for(lambda: step_logged(tmp_path, 50), 120, proc, "step 50")
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=60)[0]
    finally:
        kill_tree(proc.pid)
    assert proc.returncode == 143, out[-3000:]
    m = STOP_LINE.search(out)
    assert m and 50 <= int(m.group(1)) < 300, out[-3000:]
    assert load_ckpt(checkpoints(tmp_path)[-1])["step"] == int(m.group(1))
    final = run_train(1, args)
    assert final["steps"] == 300 and final["resumed_from"].endswith(f"ckpt_step{int(m.group(1)):08d}.pt")


def test_a_finished_run_is_not_resumed_the_next_one_trains_anew(tmp_path):
    """The newest checkpoint is the last step of a finished run: the same command again
    trains all its steps (not 0), says why, and keeps the old checkpoints where --resume
    can name them; a run stopped before its end still resumes."""
    args = ARGS + ["--out", str(tmp_path)]
    first = run_train(2, args)
    assert first["steps"] == EPOCHS * SPE and first["resumed_from"] is None
    second = run_train(2, args)
    assert second["resumed_from"] is None, second
    assert second["steps"] == EPOCHS * SPE and second["images_per_s"] > 0
    said = [ln for ln in second["_stdout"].splitlines() if ln.startswith("not resuming:")]
    assert len(said) == 1 and "training anew" in said[0] and "--resume " in said[0], said
    (kept,) = tmp_path.glob("finished-*")
    assert [p.name for p in checkpoints(kept)][-1] == f"ckpt_step{EPOCHS * SPE:08d}.pt"
    assert load_ckpt(checkpoints(tmp_path)[-1])["step"] == EPOCHS * SPE     # the new run's own
    # unfinished: stopped by --max-steps, then resumed
    third = run_train(2, ARGS + ["--out", str(tmp_path / "u"), "--max-steps", "5"])
    assert third["steps"] == 5 and third["stopped_early"]
    fourth = run_train(2, ARGS + ["--out", str(tmp_path / "u")])
    assert fourth["resumed_from"].endswith("ckpt_step00000005.pt"), fourth
    assert fourth["steps"] == EPOCHS * SPE
