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
from collections.abc import Sequence
from typing import TYPE_CHECKING, BinaryIO

from ..errors import ClusterError, InputError
from ..request import Request
from ..runs import RunDir
from ..spec import Host, Inventory, Network
from .supervised import Result, SupervisedBackend


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES names them (indices or UUIDs),
    without importing torch (slow): the variable when set, else every GPU nvidia-smi lists."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        # CUDA stops at the first invalid entry; an empty variable hides every GPU.
        names = [v.strip() for v in visible.split(",")]
        return names[:names.index("")] if "" in names else names
    smi = shutil.which("nvidia-smi")
    if not smi:
        return []
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [str(i) for i, line in enumerate(l for l in out.splitlines() if l.startswith("GPU"))]


def local_inventory(nodes: int = 1, nproc_per_node: int | None = None,
                    gpus: list[str] | None = None, python: str | None = None,
                    env: dict[str, str] | None = None) -> Inventory:
    """N simulated nodes on 127.0.0.1. The visible GPUs are split between them with
    CUDA_VISIBLE_DEVICES (keeping the names the launching shell gave them); without GPUs each
    node runs CPU processes with gloo (2 for one node, else 1 per node)."""
    if nodes < 1:
        raise InputError("Invalid value for --nodes: must be at least 1")
    devices = visible_gpus() if gpus is None else list(gpus)
    if devices and len(devices) < nodes:
        raise InputError(f"Invalid value for --nodes: {len(devices)} GPU(s) cannot be split over "
                         f"{nodes} simulated nodes (use at most {len(devices)}, or hide the GPUs "
                         f"with CUDA_VISIBLE_DEVICES=)")
    hosts = []
    for rank in range(nodes):
        host_env = dict(env or {})
        if devices:
            mine = devices[rank * len(devices) // nodes:(rank + 1) * len(devices) // nodes]
            if nodes > 1:
                host_env["CUDA_VISIBLE_DEVICES"] = ",".join(mine)
            nproc = nproc_per_node or len(mine)
        else:
            nproc = nproc_per_node or (2 if nodes == 1 else 1)
        hosts.append(Host(
            name="localhost" if nodes == 1 else f"local{rank}", address="127.0.0.1",
            workdir=os.getcwd(), python=python or sys.executable, nproc_per_node=nproc,
            rendezvous="static", network=Network(ifname="lo", ib="off"),
            env=tuple(host_env.items())))
    return Inventory(hosts=tuple(hosts), source=None, backend="local")


CLOSE_WAIT = 5.0      # seconds a closed channel's process is given to end before close returns


class LocalChannel:
    def __init__(self, command: str) -> None:
        # Its own session: Ctrl-C reaches `cluster up` alone, which then stops every node in
        # order. stdin stays open: if `cluster up` dies, the supervisor sees EOF and stops.
        self.proc = subprocess.Popen(["/bin/sh", "-c", command], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def read(self) -> bytes:
        return os.read(self.fileno(), 65536)

    def fileno(self) -> int:
        assert self.proc.stdout is not None
        return self.proc.stdout.fileno()

    def write(self, data: bytes) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(data)
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError) as exc:
            raise ClusterError(f"cannot write to the node: {exc}") from None

    def wait(self) -> int | None:
        code = self.proc.wait()
        return code if code >= 0 else 128 - code

    def close(self) -> None:
        """End its input, then let it end (a staged node exits at once on that end of input)
        before this returns, so that a caller who then looks finds nothing of ours; bounded,
        since a supervisor that was running stops its node first (and goes on doing so)."""
        if self.proc.stdin:
            try:
                self.proc.stdin.close()
            except BrokenPipeError:
                pass          # it ended before reading all (no such python): closed all the same
        try:
            self.proc.wait(timeout=CLOSE_WAIT)
        except subprocess.TimeoutExpired:
            pass
        if self.proc.stdout:
            self.proc.stdout.close()


class LocalTransport:
    label = "localhost"

    def open(self) -> None:
        """Nothing to connect to."""

    def run(self, command: str, *, timeout: float | None = None, input: bytes = b"") -> Result:
        try:
            out = subprocess.run(["/bin/sh", "-c", command], capture_output=True,
                                 timeout=timeout, input=input)
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

    def upload(self, local: Path, path: str, mode: int, mtime: int) -> None:
        """Copy a file with its mode and mtime, atomically (as SshTransport.upload does)."""
        target = Path(os.path.expanduser(path))
        tmp = target.with_name(f".{target.name}.cluster-tmp-{os.getpid()}")
        shutil.copyfile(local, tmp)
        os.chmod(tmp, mode)
        os.utime(tmp, (mtime, mtime))
        tmp.replace(target)

    def download(self, path: str, into: BinaryIO) -> int:
        """Copy a file into an open local file (as SshTransport.download does)."""
        try:
            with open(os.path.expanduser(path), "rb") as src:
                return _copy(src, into)
        except OSError as exc:
            raise ClusterError(f"cannot copy {path}: {exc.strerror}") from None

    def close(self) -> None:
        pass


def _copy(src: BinaryIO, dst: BinaryIO) -> int:
    size = 0
    while chunk := src.read(1 << 20):
        dst.write(chunk)
        size += len(chunk)
    return size


class LocalBackend(SupervisedBackend):
    name = "local"

    def __init__(self) -> None:
        super().__init__(lambda host: LocalTransport())


# --- the module's hooks (backends.BackendModule) -----------------------------------------------


def nodes(inventory: Inventory | None, request: Request) -> Inventory:
    """This machine's N simulated nodes (--nodes); an inventory file that says `backend: local`
    runs its own hosts here."""
    asked = request.force_local or request.backend == LocalBackend.name
    if asked and request.inventory_path:
        raise InputError("--local runs on this machine; leave out -i/--inventory")
    if inventory is None or asked:
        return local_inventory(1 if request.nodes is None else request.nodes,
                               nproc_per_node=request.nproc_per_node, env=dict(request.env))
    return inventory.select(nodes=request.nodes, hosts=request.host_filter,
                            exclude=request.exclude)


def configure(inventory: Inventory, request: Request) -> Inventory:
    """No options of its own."""
    return inventory


def create(inventory: Inventory, request: Request,
           sync: Sequence[tuple[str, str]] = ()) -> LocalBackend:
    return LocalBackend()


def recorded(run: RunDir) -> LocalBackend:
    return LocalBackend()


if TYPE_CHECKING:       # mypy holds this module and its class to the contract
    from . import Backend, BackendModule, NodeChecks, local as _module
    from ..plan import LaunchPlan
    _hooks: BackendModule = _module
    _backend: Backend[LaunchPlan] = LocalBackend()
    _checks: NodeChecks = LocalBackend()
