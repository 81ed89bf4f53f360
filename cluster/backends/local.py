"""Local backend: the same node scripts an SSH launch would push, run as processes here.

With no inventory `cluster up` runs one node on this machine; `--local --nodes N` simulates N
nodes (ranks 0..N-1, MASTER_ADDR 127.0.0.1, the GPUs split between them).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from ..errors import InputError
from ..spec import Host, Inventory, Network
from .supervised import Result, SupervisedBackend


def gpu_count() -> int:
    """GPUs on this machine, without importing torch (slow): nvidia-smi -L, else 0."""
    if os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        return 0
    smi = shutil.which("nvidia-smi")
    if not smi:
        return 0
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    count = sum(1 for line in out.splitlines() if line.startswith("GPU"))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        count = min(count, len([v for v in visible.split(",") if v.strip()]))
    return count


def local_inventory(nodes: int = 1, nproc_per_node: int | None = None,
                    gpus: int | None = None, python: str | None = None,
                    env: dict[str, str] | None = None) -> Inventory:
    """N simulated nodes on 127.0.0.1. GPUs are split between them with CUDA_VISIBLE_DEVICES;
    without GPUs each node runs CPU processes with gloo (2 for one node, else 1 per node)."""
    if nodes < 1:
        raise InputError("Invalid value for --nodes: must be at least 1")
    gpus = gpu_count() if gpus is None else gpus
    if gpus and gpus < nodes:
        raise InputError(f"Invalid value for --nodes: {gpus} GPU(s) cannot be split over {nodes} "
                         f"simulated nodes (use at most {gpus}, or hide the GPUs with CUDA_VISIBLE_DEVICES=)")
    hosts = []
    for rank in range(nodes):
        host_env = dict(env or {})
        if gpus:
            first, last = rank * gpus // nodes, (rank + 1) * gpus // nodes
            if nodes > 1:
                host_env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in range(first, last))
            nproc = nproc_per_node or (last - first)
        else:
            nproc = nproc_per_node or (2 if nodes == 1 else 1)
        hosts.append(Host(
            name="localhost" if nodes == 1 else f"local{rank}", address="127.0.0.1",
            workdir=os.getcwd(), python=python or sys.executable, nproc_per_node=nproc,
            rendezvous="static", network=Network(ifname="lo", ib="off"),
            env=tuple(host_env.items())))
    return Inventory(hosts=tuple(hosts), source=None, backend="local")


class LocalChannel:
    def __init__(self, command: str) -> None:
        # Its own session: Ctrl-C reaches `cluster up` alone, which then stops every node in
        # order. stdin stays open: if `cluster up` dies, the supervisor sees EOF and stops.
        self.proc = subprocess.Popen(["/bin/sh", "-c", command], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def read(self) -> bytes:
        assert self.proc.stdout is not None
        return os.read(self.proc.stdout.fileno(), 65536)

    def wait(self) -> int | None:
        code = self.proc.wait()
        return code if code >= 0 else 128 - code

    def close(self) -> None:
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream:
                stream.close()


class LocalTransport:
    label = "localhost"

    def run(self, command: str, *, timeout: float | None = None) -> Result:
        try:
            out = subprocess.run(["/bin/sh", "-c", command], capture_output=True,
                                 timeout=timeout, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired as exc:
            return Result(None, exc.stdout or b"", b"timed out")
        return Result(out.returncode, out.stdout, out.stderr)

    def spawn(self, command: str) -> LocalChannel:
        return LocalChannel(command)

    def put(self, data: bytes, path: str, mode: int) -> None:
        target = Path(path)
        tmp = target.with_name(f".{target.name}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, mode)
        tmp.replace(target)

    def close(self) -> None:
        pass


class LocalBackend(SupervisedBackend):
    name = "local"

    def __init__(self) -> None:
        super().__init__(lambda host: LocalTransport())
