"""CIFAR-10 from the python-version archive layout, without torchvision: a tiny fake archive
in that format (pickled dicts of uint8 CHW rows), extracted and as .tar.gz."""
import os
import pickle
import sys
import tarfile

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_helpers import load_train_module, run_train  # noqa: E402

cifar10 = load_train_module("cifar10")
PER_BATCH, N_TEST = 40, 30


def batch_dict(n: int, seed: int) -> dict:
    rs = np.random.RandomState(seed)
    return {b"batch_label": f"batch {seed}".encode(), b"labels": rs.randint(0, 10, n).tolist(),
            b"data": rs.randint(0, 256, (n, 3072)).astype(np.uint8),
            b"filenames": [f"img{i}.png".encode() for i in range(n)]}


def write_fake_cifar10(root, archive: bool) -> dict:
    """The layout of cifar-10-python.tar.gz, small; returns the dicts written, by file name."""
    folder = root / cifar10.FOLDER
    folder.mkdir(parents=True)
    batches = {f"data_batch_{i}": batch_dict(PER_BATCH, i) for i in range(1, 6)}
    batches["test_batch"] = batch_dict(N_TEST, 99)
    for name, d in batches.items():
        (folder / name).write_bytes(pickle.dumps(d, protocol=2))
    (folder / "batches.meta").write_bytes(pickle.dumps({b"label_names": [b"x"] * 10}))
    if archive:
        with tarfile.open(root / cifar10.ARCHIVE, "w:gz") as tar:
            tar.add(folder, arcname=cifar10.FOLDER)
        for p in folder.iterdir():
            p.unlink()
        folder.rmdir()
    return batches


@pytest.mark.parametrize("archive", [False, True], ids=["folder", "tar.gz"])
def test_loader_reads_the_python_archive_layout(tmp_path, archive):
    written = write_fake_cifar10(tmp_path, archive)
    assert cifar10.find(str(tmp_path))[0] == ("archive" if archive else "folder")
    train, test = cifar10.load(str(tmp_path), is_main=True, barrier=lambda: None)
    assert len(train) == 5 * PER_BATCH and len(test) == N_TEST
    assert train.images.dtype == torch.uint8 and train.images.shape == (5 * PER_BATCH, 3, 32, 32)
    # image k of data_batch_2: row k of its b'data', channel-major (1024 R, 1024 G, 1024 B)
    d, k = written["data_batch_2"], 7
    x, y = train[PER_BATCH + k]
    assert torch.equal(x, torch.from_numpy(d[b"data"][k].reshape(3, 32, 32)))
    assert y.item() == d[b"labels"][k]
    assert test.labels.tolist() == written["test_batch"][b"labels"]
    batch = train.__getitems__([3, PER_BATCH + k])
    assert torch.equal(batch[1][0], x)


def test_missing_data_is_a_clear_error(tmp_path, monkeypatch):
    def no_network(data_dir):
        raise OSError("no network here")

    monkeypatch.setattr(cifar10, "download", no_network)
    with pytest.raises(SystemExit, match="not in --data-dir"):
        cifar10.load(str(tmp_path), is_main=True, barrier=lambda: None)


def test_augment_normalises_and_crops_a_padded_window():
    aug = cifar10.Augment(torch.device("cpu"))
    x = torch.randint(0, 256, (16, 3, 32, 32), dtype=torch.uint8)
    mean = torch.tensor(cifar10.MEAN).view(1, 3, 1, 1) * 255
    std = torch.tensor(cifar10.STD).view(1, 3, 1, 1) * 255
    assert torch.allclose(aug(x, train=False), (x.float() - mean) / std)
    torch.manual_seed(0)
    out = aug(x, train=True) * std + mean  # back to pixel values
    padded = torch.nn.functional.pad(x.float(), (4, 4, 4, 4))
    shifts = set()
    for i in range(len(x)):
        windows = {(dy, dx, f) for dy in range(9) for dx in range(9) for f in (False, True)
                   if torch.allclose(out[i], (lambda w: w.flip(-1) if f else w)(
                       padded[i, :, dy:dy + 32, dx:dx + 32]), atol=1e-3)}
        assert windows, f"sample {i} is not a (flipped) 32x32 window of the padded image"
        shifts |= windows
    assert len(shifts) > 4  # the crops and flips vary from sample to sample


def test_trainer_runs_cifar10_without_torchvision(tmp_path):
    """Both layouts, end to end, with any torchvision import made to fail."""
    blocker = tmp_path / "block"
    (blocker / "torchvision").mkdir(parents=True)
    (blocker / "torchvision" / "__init__.py").write_text("raise ImportError('torchvision blocked')\n")
    for archive in (False, True):
        data = tmp_path / ("tgz" if archive else "dir")
        write_fake_cifar10(data, archive)
        final = run_train(1, ["--dataset", "cifar10", "--data-dir", str(data), "--batch-size", "16",
                              "--epochs", "2", "--width", "8", "--workers", "1", "--no-plot",
                              "--out", str(tmp_path / f"out-{archive}")],
                          env={"PYTHONPATH": str(blocker)})
        assert final["dataset"] == "cifar10" and final["steps"] == 2 * (5 * PER_BATCH // 16)
        assert final["val_acc"] is not None and 0.0 <= final["val_acc"] <= 1.0
