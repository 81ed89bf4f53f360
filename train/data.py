"""Datasets: sklearn digits (default, offline), CIFAR-10 (cifar10.py), synthetic on the device.

Each comes out of `build_data` as micro-batches already on the training device.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

if __package__ in (None, ""):
    import cifar10
else:
    from . import cifar10

DIGITS_VAL_FRACTION = 0.2
DIGITS_SPLIT_SEED = 0  # fixed: the held-out split never depends on --seed


class ResumableDistributedSampler(DistributedSampler):
    """DistributedSampler that can start part-way into an epoch.

    ``set_epoch(e)`` reseeds the shuffle as usual; ``set_start(n)`` skips the first
    ``n`` samples of this rank's share for the current epoch only (resume mid-epoch).
    With shuffle on or off, batch k of rank r holds global positions
    ``k*B*W + r + W*j``, so W ranks with batch B see the same samples per step as one
    process with batch B*W.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.start = 0

    def set_start(self, start: int) -> None:
        self.start = max(0, int(start))

    def __iter__(self):
        idx = list(super().__iter__())
        return iter(idx[self.start:])

    def __len__(self) -> int:
        return max(0, self.num_samples - self.start)


def _digits_arrays():
    """(images N x 8 x 8 in 0..16, labels N) of sklearn's digits.

    Reads the file that ``sklearn.datasets.load_digits`` reads (shipped inside
    scikit-learn) without importing sklearn, which costs ~2 s per process on a small
    machine; falls back to ``load_digits()`` if the file is not where we expect it.
    """
    import importlib.util

    import numpy as np
    spec = importlib.util.find_spec("sklearn")
    if spec is not None and spec.origin:
        path = os.path.join(os.path.dirname(spec.origin), "datasets", "data", "digits.csv.gz")
        if os.path.exists(path):
            raw = np.loadtxt(path, delimiter=",")
            if raw.shape == (1797, 65):
                return raw[:, :-1].reshape(-1, 8, 8), raw[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits
    d = load_digits()
    return d.images, d.target


def _stratified_split(y, fraction: float, seed: int):
    """Fixed per-class split: ``fraction`` of every class held out."""
    import numpy as np
    rs = np.random.RandomState(seed)
    tr, va = [], []
    for c in np.unique(y):
        idx = np.flatnonzero(y == c)
        rs.shuffle(idx)
        n_va = int(round(fraction * len(idx)))
        va.extend(idx[:n_va])
        tr.extend(idx[n_va:])
    return np.sort(np.array(tr)), np.sort(np.array(va))


def load_digits_split():
    """sklearn's 8x8 handwritten digits, standardised, fixed stratified 80/20 split."""
    images, target = _digits_arrays()
    x = torch.tensor(images, dtype=torch.float32).unsqueeze(1) / 16.0  # N,1,8,8
    y = torch.tensor(target, dtype=torch.long)
    idx_tr, idx_va = _stratified_split(target, DIGITS_VAL_FRACTION, DIGITS_SPLIT_SEED)
    idx_tr, idx_va = torch.from_numpy(idx_tr), torch.from_numpy(idx_va)
    mean, std = x[idx_tr].mean(), x[idx_tr].std()
    x = (x - mean) / std
    return TensorDataset(x[idx_tr], y[idx_tr]), TensorDataset(x[idx_va], y[idx_va])


def build_data(args, info, barrier) -> "Data":
    """The dataset named by --dataset, as micro-batches ready on `info.device`."""
    if args.dataset == "synthetic":
        batches = SyntheticBatches(args.batch_size, args.image_size, args.num_classes, info.device,
                                   args.seed + info.rank, args.channels_last, args.accum)
        return Data(3, args.num_classes, args.steps_per_epoch, batches, None)
    if args.dataset == "digits":
        train, val = load_digits_split()
        channels, classes, prepare = 1, 10, None
    elif args.dataset == "cifar10":
        train, val = cifar10.load(args.data_dir, info.is_main, barrier)
        channels, classes, prepare = 3, 10, cifar10.Augment(info.device)
    else:
        raise SystemExit(f"unknown --dataset {args.dataset}")
    spe = steps_per_epoch(len(train), args, info.world_size)
    if spe < 1:
        raise SystemExit("dataset too small for this --batch-size x world size x --accum")
    return Data(channels, classes, spe, LoaderBatches(train, args, info, prepare),
                LoaderBatches(val, args, info, prepare, held_out=True))


@dataclass
class Data:
    in_channels: int
    num_classes: int
    steps_per_epoch: int
    train: "LoaderBatches | SyntheticBatches"
    val: "LoaderBatches | None"


class LoaderBatches:
    """A DataLoader over this rank's shard; batches come out on the device, prepared there
    (uint8 -> normalised float, augmentation) and in the memory format the model uses."""

    def __init__(self, ds: Dataset, args, info, prepare, held_out: bool = False):
        self.device, self.prepare, self.train = info.device, prepare, not held_out
        self.samples_per_step = args.accum * args.batch_size
        self.memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
        pin = info.device.type == "cuda"
        if held_out:
            self.sampler = None
            self.loader = make_val_loader(ds, args, info.rank, info.world_size, pin)
        else:
            self.loader, self.sampler = make_train_loader(ds, args, info.rank, info.world_size, pin)

    def epoch(self, epoch: int = 0, first_step: int = 0):
        """Micro-batches of `epoch`, from optimizer step `first_step` on."""
        if self.sampler is not None:
            self.sampler.set_epoch(epoch)
            self.sampler.set_start(first_step * self.samples_per_step)
        for x, y in self.loader:
            x = x.to(self.device, non_blocking=True)
            y = y.to(self.device, non_blocking=True)
            if self.prepare is not None:
                x = self.prepare(x, self.train)
            yield x.contiguous(memory_format=self.memory_format), y


def make_train_loader(ds: Dataset, args, rank: int, world: int, pin: bool):
    sampler = ResumableDistributedSampler(
        ds, num_replicas=world, rank=rank, shuffle=not args.no_shuffle,
        seed=args.seed, drop_last=False)
    kw = {}
    if args.workers > 0:
        kw.update(persistent_workers=True, prefetch_factor=4)
    # drop_last: every step sees full, equal per-rank batches, so the averaged DDP
    # gradient equals the gradient of the global batch.
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler,
                        num_workers=args.workers, pin_memory=pin, drop_last=True, **kw)
    return loader, sampler


def steps_per_epoch(ds_len: int, args, world: int) -> int:
    per_rank = math.ceil(ds_len / world)
    return (per_rank // args.batch_size) // args.accum


def make_val_loader(ds: Dataset, args, rank: int, world: int, pin: bool):
    # Strided shard without padding: the summed counts over ranks are exact.
    shard = torch.utils.data.Subset(ds, list(range(rank, len(ds), world)))
    return DataLoader(shard, batch_size=max(args.batch_size, 256), shuffle=False,
                      num_workers=min(args.workers, 2), pin_memory=pin)


class SyntheticBatches:
    """ImageNet-shaped batches created once on the device: no loader, no H2D copies."""

    def __init__(self, batch_size: int, image_size: int, num_classes: int,
                 device: torch.device, seed: int, channels_last: bool, accum: int = 1, pool: int = 4):
        self.accum = accum
        g = torch.Generator(device=device)
        g.manual_seed(seed)
        self.batches = []
        for _ in range(pool):
            x = torch.randn(batch_size, 3, image_size, image_size, device=device, generator=g)
            if channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            y = torch.randint(0, num_classes, (batch_size,), device=device, generator=g)
            self.batches.append((x, y))

    def epoch(self, epoch: int = 0, first_step: int = 0):  # noqa: ARG002 - same as LoaderBatches
        """Endless micro-batches, rotating through the pool (the caller counts the steps)."""
        i = first_step * self.accum
        while True:
            yield self.batches[i % len(self.batches)]
            i += 1
