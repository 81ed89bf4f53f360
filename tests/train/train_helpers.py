"""Helpers for the train/ tests: launch train/train.py with 1 plain process or with
torchrun (gloo, CPU), parse its FINAL line, read its checkpoints, kill process trees.

What a test means decides the device: the processes started here see no GPU
(CUDA_VISIBLE_DEVICES="") unless the trainer's own arguments say `--device cuda`. Otherwise a
test meant for gloo on CPU picks CUDA on a machine with a GPU (--device auto), and with fewer
GPUs than ranks rank 1 fails on `torch.cuda.set_device(1)`. A test that means CUDA passes
`--device cuda` and is marked `cuda` with a skip where no GPU is."""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "train" / "train.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_cmd(nproc: int, args: list[str]) -> list[str]:
    if nproc == 1:  # plain process: no process group, no DDP wrapper
        return [sys.executable, str(TRAIN), *args]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
            "--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(TRAIN), *args]


def asks_for_cuda(args: list[str]) -> bool:
    """The trainer's arguments say --device cuda (the last --device wins, as in argparse)."""
    device = None
    for i, a in enumerate(args):
        if a == "--device" and i + 1 < len(args):
            device = args[i + 1]
        elif a.startswith("--device="):
            device = a.split("=", 1)[1]
    return device == "cuda"


def train_env(extra: dict | None = None, gpus: bool = False) -> dict:
    """The environment of a process a test starts: no launcher's variables, and no GPU
    visible unless `gpus` (a test that means CUDA)."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", MPLBACKEND="Agg")
    if not gpus:              # else the GPUs the test run itself sees
        env["CUDA_VISIBLE_DEVICES"] = ""
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "CLUSTER_RESTART_COUNT", "CLUSTER_HEARTBEAT_FILE"):
        env.pop(k, None)
    env.update(extra or {})
    return env


def parse_final(stdout: str) -> dict:
    lines = [ln for ln in stdout.splitlines() if ln.startswith("FINAL ")]
    assert len(lines) == 1, f"expected one FINAL line, got {len(lines)}:\n{stdout[-3000:]}"
    return json.loads(lines[0][len("FINAL "):])


def run_train(nproc: int, args: list[str], env: dict | None = None, timeout: float = 180) -> dict:
    p = subprocess.run(train_cmd(nproc, args), cwd=REPO, env=train_env(env, asks_for_cuda(args)),
                       text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)
    assert p.returncode == 0, f"train.py failed (rc {p.returncode}):\n{p.stdout[-5000:]}"
    final = parse_final(p.stdout)
    final["_stdout"] = p.stdout
    return final


def start_train(nproc: int, args: list[str], env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(train_cmd(nproc, args), cwd=REPO, env=train_env(env, asks_for_cuda(args)),
                            text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _children(pid: int) -> list[int]:
    kids = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid:
            kids.append(int(d))
    return kids


def descendants(pid: int) -> list[int]:
    todo, found = [pid], []
    while todo:
        kids = _children(todo.pop())
        found.extend(kids)
        todo.extend(kids)
    return found


def worker_pid(launcher_pid: int, rank: int) -> int:
    """The torchrun worker of `rank` under the launcher we started (by its environment)."""
    for p in descendants(launcher_pid):
        try:
            with open(f"/proc/{p}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if env.get(b"RANK") == str(rank).encode() and env.get(b"LOCAL_RANK") is not None:
            return p
    raise AssertionError(f"no worker of rank {rank} under {launcher_pid}")


def kill_tree(pid: int) -> None:
    """SIGKILL a process we started and all its descendants (torchrun puts its
    workers in new sessions, so a process-group kill would miss them)."""
    for p in [pid, *descendants(pid)]:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def wait_for(pred, timeout: float, proc: subprocess.Popen | None = None, what: str = ""):
    t0 = time.time()
    while time.time() - t0 < timeout:
        r = pred()
        if r:
            return r
        if proc is not None and proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            pytest.fail(f"training exited (rc {proc.returncode}) before {what}:\n{out[-4000:]}")
        time.sleep(0.02)
    pytest.fail(f"timed out waiting for {what}")


def step_logged(out: Path, step: int) -> bool:
    """Has metrics.jsonl in `out` a step record at `step` or later?"""
    try:
        lines = (out / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return False
    for ln in lines:
        try:
            r = json.loads(ln)
        except json.JSONDecodeError:  # a line being written
            continue
        if r.get("type") == "step" and r["step"] >= step:
            return True
    return False


def checkpoints(out: Path) -> list[Path]:
    return sorted(out.glob("ckpt_step*.pt"))


def load_ckpt(path: Path) -> dict:
    import torch
    return torch.load(path, map_location="cpu", weights_only=False)


def final_weights(out: Path) -> dict:
    ck = checkpoints(out)
    assert ck, f"no checkpoint in {out}"
    return load_ckpt(ck[-1])["model"]


def max_abs_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def load_train_module(name: str):
    """Import train/<name>.py in-process as a module of a private package, so its relative
    imports of sibling modules work and nothing is put on sys.path."""
    pkg = "_cluster_train"
    if pkg not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            pkg, REPO / "train" / "__init__.py", submodule_search_locations=[str(REPO / "train")])
        mod = importlib.util.module_from_spec(spec)
        sys.modules[pkg] = mod  # dataclasses and relative imports look it up there
        spec.loader.exec_module(mod)
    return importlib.import_module(f"{pkg}.{name}")
