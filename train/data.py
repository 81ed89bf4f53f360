"""Datasets: sklearn digits (default, offline), CIFAR-10 (torchvision), synthetic on-device."""
from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

DIGITS_VAL_FRACTION = 0.2
DIGITS_SPLIT_SEED = 0  # fixed: the held-out split never depends on --seed


@dataclass
class DataSpec:
    in_channels: int
    num_classes: int
    image_size: int
    train: Dataset | None  # None for synthetic
    val: Dataset | None


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


def load_cifar10(data_dir: str, is_main: bool, barrier) -> tuple[Dataset, Dataset]:
    try:
        import torchvision  # noqa: F401
        import torchvision.transforms as T
        from torchvision.datasets import CIFAR10
    except ImportError as e:  # pragma: no cover - depends on the host
        raise SystemExit(f"--dataset cifar10 needs torchvision, which is not importable: {e}")
    mean, std = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
    tr = T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(),
                    T.ToTensor(), T.Normalize(mean, std)])
    te = T.Compose([T.ToTensor(), T.Normalize(mean, std)])

    def present() -> bool:
        try:
            CIFAR10(data_dir, train=True, download=False)
            CIFAR10(data_dir, train=False, download=False)
            return True
        except RuntimeError:
            return False

    if not present():
        # Only rank 0 downloads; the others wait and then read what it wrote.
        err = None
        if is_main:
            print(f"CIFAR-10 not found in {data_dir!r}; downloading it", file=sys.stderr, flush=True)
            try:
                os.makedirs(data_dir, exist_ok=True)
                CIFAR10(data_dir, train=True, download=True)
                CIFAR10(data_dir, train=False, download=True)
            except Exception as e:  # no network, disk full, ...
                err = e
        barrier()
        if not present():
            raise SystemExit(
                f"CIFAR-10 is not in --data-dir {data_dir!r} and could not be downloaded"
                f" ({err or 'see rank 0'}). Put cifar-10-batches-py/ there, or use"
                " --dataset digits (offline) or --dataset synthetic.")
    return (CIFAR10(data_dir, train=True, download=False, transform=tr),
            CIFAR10(data_dir, train=False, download=False, transform=te))


def build_data(args, is_main: bool, barrier) -> DataSpec:
    if args.dataset == "digits":
        tr, va = load_digits_split()
        return DataSpec(1, 10, 8, tr, va)
    if args.dataset == "cifar10":
        tr, va = load_cifar10(args.data_dir, is_main, barrier)
        return DataSpec(3, 10, 32, tr, va)
    if args.dataset == "synthetic":
        return DataSpec(3, args.num_classes, args.image_size, None, None)
    raise SystemExit(f"unknown --dataset {args.dataset}")


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
                 device: torch.device, seed: int, channels_last: bool, pool: int = 4):
        g = torch.Generator(device=device)
        g.manual_seed(seed)
        self.batches = []
        for _ in range(pool):
            x = torch.randn(batch_size, 3, image_size, image_size, device=device, generator=g)
            if channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            y = torch.randint(0, num_classes, (batch_size,), device=device, generator=g)
            self.batches.append((x, y))

    def get(self, i: int):
        return self.batches[i % len(self.batches)]
