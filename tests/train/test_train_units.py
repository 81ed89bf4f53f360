"""Fast in-process checks of the pieces of train/: atomic checkpoints, LR schedule,
the resumable sampler's data order."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_helpers import load_train_module  # noqa: E402

ckpt = load_train_module("checkpoint")
data = load_train_module("data")


def test_atomic_save_leaves_no_temp_on_failure(tmp_path):
    class Boom:
        def __reduce__(self):
            raise RuntimeError("cannot pickle")

    with pytest.raises(Exception):
        ckpt.atomic_save({"step": 1, "x": Boom()}, str(tmp_path / ckpt.ckpt_name(1)))
    assert os.listdir(tmp_path) == []


def test_latest_skips_temp_and_corrupt_files_and_prunes(tmp_path):
    for s in (1, 2, 3, 4):
        ckpt.save_checkpoint({"step": s, "w": torch.full((3,), float(s))}, str(tmp_path), keep=3)
    assert [s for s, _ in ckpt.list_checkpoints(str(tmp_path))] == [2, 3, 4]
    # a stray temp file with a higher step, and a truncated "newest" checkpoint
    (tmp_path / ".ckpt_step00000009.pt.tmp.123").write_bytes(b"garbage")
    good = (tmp_path / ckpt.ckpt_name(4)).read_bytes()
    (tmp_path / ckpt.ckpt_name(5)).write_bytes(good[: len(good) // 2])
    path, st = ckpt.load_latest(str(tmp_path))
    assert path.endswith(ckpt.ckpt_name(4)) and st["step"] == 4
    assert ckpt.remove_stale_temps(str(tmp_path)) == [".ckpt_step00000009.pt.tmp.123"]


def test_rng_state_roundtrip():
    st = ckpt.rng_state()
    a = torch.rand(5)
    ckpt.set_rng_state(st)
    assert torch.equal(a, torch.rand(5))


def test_lr_schedule_warmup_then_cosine():
    tr = load_train_module("schedule")
    f = [tr.lr_factor(s, warmup=10, total=110, min_ratio=0.0) for s in range(111)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)
    assert all(b > a for a, b in zip(f[:9], f[1:10]))            # linear ramp up
    assert all(b <= a for a, b in zip(f[10:], f[11:]))          # then monotone decay
    assert f[60] == pytest.approx(0.5) and f[110] == pytest.approx(0.0, abs=1e-12)
    assert tr.lr_factor(60, 10, 110, 0.1) == pytest.approx(0.1 + 0.9 * 0.5)


@pytest.mark.parametrize("shuffle", [True, False])
def test_sampler_shards_are_the_global_batch(shuffle):
    """World W with per-rank batch b sees, step by step, the samples one process
    with batch W*b sees; set_start resumes mid-epoch."""
    n, W, b = 103, 2, 4
    ds = list(range(n))

    def batches(world, rank, bs, start=0):
        s = data.ResumableDistributedSampler(ds, num_replicas=world, rank=rank, shuffle=shuffle, seed=7)
        s.set_epoch(3)
        s.set_start(start)
        idx = list(s)
        assert len(idx) == len(s)
        return [idx[i:i + bs] for i in range(0, len(idx) - bs + 1, bs)]

    one = batches(1, 0, W * b)
    per_rank = [batches(W, r, b) for r in range(W)]
    for k, big in enumerate(one[: len(per_rank[0])]):
        assert sorted(big) == sorted(sum((pr[k] for pr in per_rank), []))
    resumed = batches(W, 1, b, start=3 * b)
    assert resumed == per_rank[1][3:]
    if shuffle:
        s = data.ResumableDistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=7)
        s.set_epoch(4)
        assert [i for bt in one for i in bt] != list(s)[: len(one) * W * b]


def test_the_trainer_started_by_a_test_sees_a_gpu_only_when_its_arguments_ask_for_cuda():
    """A test meant for gloo on CPU must not find a GPU: on a machine with one, --device auto
    picked CUDA and two ranks shared a single GPU (rank 1: invalid device ordinal)."""
    from train_helpers import asks_for_cuda, train_env
    for args in ([], ["--device", "cpu"], ["--device", "auto"], ["--device", "cuda", "--device", "cpu"]):
        assert not asks_for_cuda(args)
        assert train_env(gpus=asks_for_cuda(args))["CUDA_VISIBLE_DEVICES"] == ""
    for args in (["--device", "cuda"], ["--epochs", "1", "--device=cuda"]):
        assert asks_for_cuda(args)
        assert train_env({"CUDA_VISIBLE_DEVICES": "0"}, gpus=True)["CUDA_VISIBLE_DEVICES"] == "0"


du = load_train_module("dist_utils")


def test_one_process_per_gpu_or_a_clear_error():
    """More processes on a node than it has GPUs: every process learns what to do (not
    torch's 'invalid device ordinal'), and one of them says it."""
    assert du.pick_device("auto", 0, 1, gpus=1) == torch.device("cuda", 0)
    assert du.pick_device("cuda", 3, 8, gpus=8) == torch.device("cuda", 3)
    assert du.pick_device("auto", 1, 2, gpus=0) == torch.device("cpu")
    assert du.pick_device("cpu", 1, 2, gpus=1) == torch.device("cpu")
    for rank in (0, 1):
        with pytest.raises(du.DeviceError) as err:
            du.pick_device("auto", rank, 2, gpus=1)
        assert "this node shows 1 GPU(s)" in str(err.value)
        assert "--nproc-per-node 1" in str(err.value) and "--device cpu" in str(err.value)
        assert err.value.tell == (rank == 0)
    with pytest.raises(du.DeviceError, match=r"^LOCAL_RANK 1, but this node shows 1 GPU") as err:
        du.pick_device("cuda", 1, None, gpus=1)     # no LOCAL_WORLD_SIZE: the rank past the GPUs
    assert err.value.tell
    with pytest.raises(du.DeviceError, match="sees no CUDA GPU.*or --device cpu"):
        du.pick_device("cuda", 0, 1, gpus=0)


def test_the_trainer_without_the_gpu_it_asks_for_says_so_and_exits_2():
    """--device cuda where no GPU is visible: one line saying what to do, exit code 2, no
    traceback (before: torch's own error from set_device, with its traceback)."""
    import subprocess
    from train_helpers import REPO, train_cmd, train_env
    p = subprocess.run(train_cmd(1, ["--device", "cuda", "--no-plot", "--no-resume", "--out", "/nonexistent"]),
                       cwd=REPO, env=train_env({"CUDA_VISIBLE_DEVICES": ""}), text=True,
                       capture_output=True, timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stderr.startswith("train.py: error: --device cuda, but this process sees no CUDA GPU")
    assert "Traceback" not in p.stderr and "FINAL" not in p.stdout


def test_what_the_trainer_writes_is_private(tmp_path):
    """Folders 0700 and files 0600 (as the rest of runs/<id>/), whatever umask it came with:
    metrics, plot, checkpoints, the heartbeat and step times."""
    import stat
    from train_helpers import run_train
    old = os.umask(0o022)
    try:
        run_train(1, ["--epochs", "1", "--max-steps", "2", "--no-resume", "--ckpt-every", "1",
                      "--out", str(tmp_path / "out"), "--checkpoint-dir", str(tmp_path / "ck")],
                  env={"CLUSTER_HEARTBEAT_FILE": str(tmp_path / "run" / "heartbeat")})
    finally:
        os.umask(old)
    made = [p for d in ("out", "ck", "run") for p in [tmp_path / d, *(tmp_path / d).rglob("*")]]
    assert {p.name for p in made} >= {"metrics.jsonl", "metrics.png", "ckpt_step00000002.pt",
                                      "heartbeat", "heartbeat.steps.0"}
    modes = {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in made}
    assert modes == {p.name: "0o700" if p.is_dir() else "0o600" for p in made}
