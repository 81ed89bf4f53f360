"""DDP semantics on CPU (gloo): splitting the global batch over ranks, or over
accumulation micro-steps, gives the same weights as one process with the whole batch."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_helpers import final_weights, max_abs_diff, run_train  # noqa: E402

ATOL = 1e-5  # fp32; observed differences are ~1e-7 (summation order only)
STEPS = 6
COMMON = ["--epochs", "1", "--max-steps", str(STEPS), "--warmup-steps", "2", "--log-every", "3",
          "--ckpt-every", "0", "--no-plot", "--no-resume", "--seed", "3"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One plain process (no DDP) with global batch 32."""
    out = tmp_path_factory.mktemp("ref")
    final = run_train(1, COMMON + ["--batch-size", "32", "--out", str(out)])
    return final, final_weights(out)


def _check_same(final, weights, reference):
    ref_final, ref_w = reference
    assert final["steps"] == ref_final["steps"] == STEPS
    assert final["global_batch"] == ref_final["global_batch"] == 32
    diff = max_abs_diff(weights, ref_w)
    assert diff < ATOL, f"weights differ from the 1-process run by {diff}"
    assert final["train_loss"] == pytest.approx(ref_final["train_loss"], abs=ATOL)


def test_two_ranks_half_batch_equal_one_process_full_batch(reference, tmp_path):
    final = run_train(2, COMMON + ["--batch-size", "16", "--out", str(tmp_path)])
    assert final["world_size"] == 2
    _check_same(final, final_weights(tmp_path), reference)


def test_accumulation_equals_full_batch_two_ranks(reference, tmp_path):
    # 2 ranks x batch 8 x accum 2 (no_sync on the first micro-step) == 1 x 32
    final = run_train(2, COMMON + ["--batch-size", "8", "--accum", "2", "--out", str(tmp_path)])
    _check_same(final, final_weights(tmp_path), reference)


def test_accumulation_equals_full_batch_one_process(reference, tmp_path):
    final = run_train(1, COMMON + ["--batch-size", "16", "--accum", "2", "--out", str(tmp_path)])
    _check_same(final, final_weights(tmp_path), reference)


def test_control_a_different_batch_gives_different_weights(reference, tmp_path):
    """The comparison above can fail: half the batch without accumulation moves the
    weights far more than the tolerance."""
    run_train(1, COMMON + ["--batch-size", "16", "--out", str(tmp_path)])
    assert max_abs_diff(final_weights(tmp_path), reference[1]) > 100 * ATOL


def test_step_times_reported_and_training_unchanged(reference, tmp_path):
    """With a heartbeat file, each rank writes its own compute and data time per step beside
    it (train/steptime.py); the hooks that measure only read the clock: same weights."""
    import json
    beat = tmp_path / "run" / "heartbeat"
    final = run_train(2, COMMON + ["--batch-size", "16", "--out", str(tmp_path / "out")],
                      env={"CLUSTER_HEARTBEAT_FILE": str(beat)})
    _check_same(final, final_weights(tmp_path / "out"), reference)
    for rank in (0, 1):
        line = json.loads((tmp_path / "run" / f"heartbeat.steps.{rank}").read_text())
        assert line["rank"] == rank and line["steps"] >= 1
        assert line["compute"] > 0 and line["data"] >= 0
        assert line["seconds"] >= line["compute"] * line["steps"], "wall clock, waits included"
