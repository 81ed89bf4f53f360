"""CIFAR-10 from the python-version archive, without torchvision.

Reads the layout that https://www.cs.toronto.edu/~kriz/cifar.html publishes: either the
extracted folder ``DIR/cifar-10-batches-py/`` (``data_batch_1`` .. ``data_batch_5``,
``test_batch``: pickled dicts with ``b'data'``, a 10000 x 3072 uint8 array of CHW images, and
``b'labels'``) or the archive ``DIR/cifar-10-python.tar.gz`` itself, read in place. When
neither is there, rank 0 downloads the archive (the others wait at a barrier).

Images stay uint8 in memory (150 MB for the training set) and travel to the device as uint8;
`Augment` turns them into normalised floats there, with the standard training augmentation
(4-pixel zero-padded random crop, horizontal flip) done for the whole batch at once. Drawing
the random numbers from the device's generator in the training process, not in DataLoader
workers, makes a resumed run replay them exactly (the checkpoint holds the RNG states).
"""
from __future__ import annotations

import hashlib
import os
import pickle
import sys
import tarfile
import urllib.request

import numpy as np
import torch
from torch.utils.data import Dataset

FOLDER = "cifar-10-batches-py"
ARCHIVE = "cifar-10-python.tar.gz"
URL = "https://www.cs.toronto.edu/~kriz/" + ARCHIVE
ARCHIVE_MD5 = "c58f30108f718f92721af3b95e74349a"
TRAIN_FILES = [f"data_batch_{i}" for i in range(1, 6)]
TEST_FILES = ["test_batch"]
MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)


class ImageArray(Dataset):
    """uint8 images (N, 3, 32, 32) and int64 labels, fetched a batch at a time."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor):
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        return self.images[i], self.labels[i]

    def __getitems__(self, idx: list[int]):
        # One indexing op per batch instead of one per image; the DataLoader's default
        # collate stacks the (image, label) pairs this returns.
        t = torch.as_tensor(idx)
        return list(zip(self.images[t], self.labels[t]))


def _decode(blobs: list[bytes]) -> ImageArray:
    images, labels = [], []
    for blob in blobs:
        d = pickle.loads(blob, encoding="bytes")  # b'data' is a numpy uint8 array (N, 3072)
        data = np.ascontiguousarray(d[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32)
        images.append(torch.from_numpy(data))
        labels.append(torch.tensor(d[b"labels"], dtype=torch.int64))
    return ImageArray(torch.cat(images), torch.cat(labels))


def _read_folder(folder: str, names: list[str]) -> list[bytes]:
    out = []
    for n in names:
        with open(os.path.join(folder, n), "rb") as f:
            out.append(f.read())
    return out


def _read_archive(path: str, names: list[str]) -> list[bytes]:
    with tarfile.open(path, "r:gz") as tar:
        members = {os.path.basename(m.name): m for m in tar.getmembers() if m.isfile()}
        missing = [n for n in names if n not in members]
        if missing:
            raise SystemExit(f"{path}: not a CIFAR-10 python archive (no {', '.join(missing)})")
        return [tar.extractfile(members[n]).read() for n in names]


def find(data_dir: str) -> tuple[str, str] | None:
    """('folder' | 'archive', path) of what `data_dir` holds, or None."""
    folder = os.path.join(data_dir, FOLDER)
    if all(os.path.isfile(os.path.join(folder, n)) for n in TRAIN_FILES + TEST_FILES):
        return "folder", folder
    if os.path.isfile(os.path.join(data_dir, ARCHIVE)):
        return "archive", os.path.join(data_dir, ARCHIVE)
    return None


def download(data_dir: str) -> None:
    os.makedirs(data_dir, exist_ok=True)
    dest = os.path.join(data_dir, ARCHIVE)
    tmp = dest + f".part.{os.getpid()}"
    print(f"CIFAR-10 not found in {data_dir!r}; downloading {URL}", file=sys.stderr, flush=True)
    try:
        with urllib.request.urlopen(URL, timeout=30) as r, open(tmp, "wb") as f:
            while chunk := r.read(1 << 20):
                f.write(chunk)
        with open(tmp, "rb") as f:
            if hashlib.md5(f.read()).hexdigest() != ARCHIVE_MD5:
                raise OSError("checksum mismatch")
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def load(data_dir: str, is_main: bool, barrier) -> tuple[ImageArray, ImageArray]:
    """(train, test) from `data_dir`; rank 0 downloads first if nothing is there."""
    if find(data_dir) is None:
        err = None
        if is_main:
            try:
                download(data_dir)
            except Exception as e:  # no network, disk full, bad checksum
                err = e
        barrier()
        if find(data_dir) is None:
            raise SystemExit(
                f"CIFAR-10 is not in --data-dir {data_dir!r} ({FOLDER}/ or {ARCHIVE}) and could"
                f" not be downloaded ({err or 'see rank 0'}). Use --dataset digits (offline) or"
                " --dataset synthetic.")
    kind, path = find(data_dir)
    read = _read_folder if kind == "folder" else _read_archive
    return _decode(read(path, TRAIN_FILES)), _decode(read(path, TEST_FILES))


class Augment:
    """uint8 batch on the device -> normalised float batch; crop and flip when training."""

    def __init__(self, device: torch.device, pad: int = 4):
        self.mean = torch.tensor(MEAN, device=device).view(1, 3, 1, 1) * 255
        self.std = torch.tensor(STD, device=device).view(1, 3, 1, 1) * 255
        self.pad = pad

    def __call__(self, x: torch.Tensor, train: bool) -> torch.Tensor:
        x = x.float()
        if train:
            x = self._crop_and_flip(x)
        return (x - self.mean) / self.std

    def _crop_and_flip(self, x: torch.Tensor) -> torch.Tensor:
        n, _, h, w = x.shape
        p = self.pad
        padded = torch.nn.functional.pad(x, (p, p, p, p))  # zeros: black, as torchvision pads
        dy = torch.randint(0, 2 * p + 1, (n, 1, 1), device=x.device)
        dx = torch.randint(0, 2 * p + 1, (n, 1, 1), device=x.device)
        flip = torch.rand(n, 1, 1, device=x.device) < 0.5
        rows = dy + torch.arange(h, device=x.device).view(1, h, 1)
        cols = torch.arange(w, device=x.device).view(1, 1, w)
        cols = dx + torch.where(flip, w - 1 - cols, cols)
        b = torch.arange(n, device=x.device).view(n, 1, 1)
        # (n, h, w, c) from advanced indexing over batch, rows, cols; back to (n, c, h, w)
        return padded.permute(0, 2, 3, 1)[b, rows, cols].permute(0, 3, 1, 2)
