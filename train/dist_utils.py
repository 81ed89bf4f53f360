"""Process-group set-up and tear-down from torchrun's environment.

Works with torchrun (RANK / LOCAL_RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set)
and without it (plain ``python train/train.py``: one process, no process group).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    backend: str | None = None  # None: no process group (single plain process)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.backend is not None

    @property
    def peers(self) -> bool:
        """Other processes to talk to: a process group with more than one rank."""
        return self.backend is not None and self.world_size > 1


class DeviceError(Exception):
    """The device asked for is not there for this process; the message says what to do.
    `tell`: this process is the one of its node that says it (not every rank repeats it)."""

    def __init__(self, message: str, tell: bool = True):
        super().__init__(message)
        self.tell = tell


def visible_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pick_device(device_arg: str, local_rank: int, local_world: int | None, gpus: int) -> torch.device:
    """This process's device: GPU `local_rank` on CUDA (one process per GPU), else the CPU.
    `local_world`: the node's process count (torchrun's LOCAL_WORLD_SIZE), when known, so
    that every process of a node with too few GPUs fails alike, not only the ones past the
    last GPU (rank 0 would otherwise wait at the rendezvous for the others)."""
    use_cuda = gpus > 0 if device_arg == "auto" else device_arg == "cuda"
    if not use_cuda:
        return torch.device("cpu")
    if gpus == 0:
        raise DeviceError("--device cuda, but this process sees no CUDA GPU (torch.cuda."
                          f"is_available() is False; CUDA_VISIBLE_DEVICES="
                          f"{os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')!r}): run where a "
                          "GPU is, or --device cpu", tell=local_rank == 0 or local_world is None)
    needed = max(local_rank + 1, local_world or 0)
    if needed > gpus:
        who = (f"this node runs {local_world} processes (LOCAL_RANK {local_rank} of "
               f"LOCAL_WORLD_SIZE {local_world})" if local_world else f"LOCAL_RANK {local_rank}")
        raise DeviceError(f"{who}, but this node shows {gpus} GPU(s) and each process needs "
                          f"its own: run one process per GPU (--nproc-per-node {gpus}), or "
                          f"--device cpu",
                          tell=local_rank == 0 or local_world is None)
    return torch.device("cuda", local_rank)


def init_distributed(device_arg: str = "auto", gpus: int | None = None) -> DistInfo:
    """Initialise from torchrun's environment; NCCL on CUDA, gloo on CPU. `gpus`: the GPUs
    this process sees (default: what torch says). Raises DeviceError where the device asked
    for is not there."""
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_world = os.environ.get("LOCAL_WORLD_SIZE")
    device = pick_device(device_arg, local_rank, int(local_world) if local_world else None,
                         visible_gpus() if gpus is None else gpus)
    use_cuda = device.type == "cuda"
    if use_cuda:
        torch.cuda.set_device(device)
    launched = "RANK" in os.environ and "MASTER_ADDR" in os.environ
    backend = None
    if launched:
        backend = "nccl" if use_cuda else "gloo"
        kwargs = {"backend": backend}
        if use_cuda:
            # Binding the device lets NCCL create its communicator eagerly.
            kwargs["device_id"] = device
        dist.init_process_group(**kwargs)
        rank, world_size = dist.get_rank(), dist.get_world_size()
    return DistInfo(rank, local_rank, world_size, device, backend)


def cleanup_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # pragma: no cover - best effort on the way out
            pass


# How long a rank that has torn its group down waits for the others to have done so too.
LEAVE_TIMEOUT = 30.0


def leave_together(info: DistInfo, timeout: float = LEAVE_TIMEOUT) -> None:
    """Tear the process group down on every rank before any rank exits. A rank that exits
    closes its gloo connections, and a peer still inside its own tear-down has aborted on that
    ("terminate called without an active exception", SIGABRT after FINAL, under load). So:
    destroy the group, then count the ranks that have done so in the rendezvous store, which
    outlives the group (it is the launcher's), and leave once all have, or after `timeout` (a
    store that stops answering ends the wait: the job's work is done). Only on the way out of
    a run that ended well, after a barrier every rank passed."""
    if not (info.peers and dist.is_initialized()):
        return
    store = dist.distributed_c10d._get_default_store()
    dist.destroy_process_group()
    key = "cluster/left/%s" % os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    deadline = time.monotonic() + timeout
    try:
        store.add(key, 1)
        while store.add(key, 0) < info.world_size and time.monotonic() < deadline:
            time.sleep(0.01)
    except Exception:  # pragma: no cover - the store went away: nothing left to wait for
        pass


def barrier(info: DistInfo) -> None:
    if info.peers:
        if info.device.type == "cuda":
            dist.barrier(device_ids=[info.device.index])
        else:
            dist.barrier()


def all_reduce_sum(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if info.peers:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_gather_object(obj, info: DistInfo) -> list:
    if not info.peers:
        return [obj]
    out = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj, info: DistInfo, src: int = 0):
    if not info.peers:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]
