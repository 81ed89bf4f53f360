"""The default run (sklearn digits, small CNN, 2 gloo processes, no flags but --out)
learns: held-out accuracy >= 0.90, parsed from the FINAL line."""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_helpers import checkpoints, load_ckpt, run_train  # noqa: E402

MIN_VAL_ACC = 0.90


def test_default_run_reaches_held_out_accuracy(tmp_path):
    final = run_train(2, ["--out", str(tmp_path)], timeout=300)
    assert final["world_size"] == 2 and final["dataset"] == "digits"
    assert "restart_count" not in final  # only when the launcher sets CLUSTER_RESTART_COUNT
    assert final["epochs"] == 10 and final["steps"] == 220 and not final["stopped_early"]
    assert final["val_acc"] >= MIN_VAL_ACC, final
    assert final["images_per_s"] > 0
    # artefacts: JSONL with step and per-epoch records, the plot, atomic checkpoints
    recs = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    epochs = [r for r in recs if r["type"] == "epoch"]
    assert len(epochs) == 10 and all(0.0 <= r["val_acc"] <= 1.0 for r in epochs)
    assert epochs[-1]["val_acc"] == final["val_acc"]
    assert epochs[-1]["train_loss"] < epochs[0]["train_loss"]
    steps = [r for r in recs if r["type"] == "step"]
    assert steps and {"loss", "acc", "images_per_s", "step_time_s", "lr"} <= steps[0].keys()
    assert (tmp_path / "metrics.png").stat().st_size > 0
    ck = checkpoints(tmp_path)
    assert 1 <= len(ck) <= 3  # --keep-ckpts 3
    assert load_ckpt(ck[-1])["step"] == 220
    # rank 0 alone logs: one FINAL line (checked by run_train) and one banner line
    assert final["_stdout"].count("world_size=2 backend=gloo") == 1
