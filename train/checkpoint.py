"""Atomic checkpoints: temp file in the same directory, fsync, os.replace, fsync dir.

A reader only ever sees complete files named ``ckpt_step00000042.pt``; temp files
(``.ckpt_step...pt.tmp.<pid>.<thread>``) left by a process killed mid-save are ignored and
removed at the next save or resume.
"""
from __future__ import annotations

import os
import random
import re
import sys
import threading
import time

import numpy as np
import torch

CKPT_RE = re.compile(r"^ckpt_step(\d+)\.pt$")
TMP_PREFIX = ".ckpt_"
# Test hook: "STEP:SECONDS" sleeps SECONDS between writing and renaming the
# checkpoint of step STEP (so a test can SIGKILL a save in flight).
SAVE_SLEEP_ENV = "CLUSTER_TRAIN_TEST_SAVE_SLEEP"


def ckpt_name(step: int) -> str:
    return f"ckpt_step{step:08d}.pt"


def list_checkpoints(out_dir: str) -> list[tuple[int, str]]:
    """(step, path) of every complete checkpoint, oldest first."""
    found = []
    try:
        names = os.listdir(out_dir)
    except FileNotFoundError:
        return []
    for n in names:
        m = CKPT_RE.match(n)
        if m:
            found.append((int(m.group(1)), os.path.join(out_dir, n)))
    return sorted(found)


def remove_stale_temps(out_dir: str) -> list[str]:
    removed = []
    for n in os.listdir(out_dir) if os.path.isdir(out_dir) else []:
        if n.startswith(TMP_PREFIX) and ".tmp" in n:
            try:
                os.remove(os.path.join(out_dir, n))
                removed.append(n)
            except OSError:
                pass
    return removed


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_save(obj, path: str) -> None:
    d = os.path.dirname(os.path.abspath(path))
    # pid and thread: a stop's watchdog thread may save while the main thread does
    tmp = os.path.join(d, f"{TMP_PREFIX}{os.path.basename(path)[5:]}.tmp.{os.getpid()}.{threading.get_ident()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        hook = os.environ.get(SAVE_SLEEP_ENV)
        if hook:
            step_s, secs = hook.split(":")
            if int(step_s) == obj.get("step", -1):
                time.sleep(float(secs))
        os.replace(tmp, path)
        _fsync_dir(d)
    finally:
        if os.path.exists(tmp):  # an exception before the rename: leave nothing behind
            try:
                os.remove(tmp)
            except OSError:
                pass


def save_checkpoint(state: dict, out_dir: str, keep: int) -> str:
    path = os.path.join(out_dir, ckpt_name(state["step"]))
    atomic_save(state, path)
    if keep > 0:
        for _, old in list_checkpoints(out_dir)[:-keep]:
            try:
                os.remove(old)
            except OSError:
                pass
    return path


def set_aside(out_dir: str, name: str) -> str:
    """Move every complete checkpoint of out_dir into out_dir/name/ (which resume ignores),
    so that a new run's checkpoints are the only ones there; returns that folder."""
    folder = os.path.join(out_dir, name)
    os.makedirs(folder, exist_ok=True)
    for _, path in list_checkpoints(out_dir):
        os.replace(path, os.path.join(folder, os.path.basename(path)))
    _fsync_dir(out_dir)
    return folder


def load_checkpoint(path: str) -> dict:
    # weights_only=False: the file holds numpy / python RNG states; we wrote it ourselves.
    return torch.load(path, map_location="cpu", weights_only=False)


def load_latest(out_dir: str) -> tuple[str, dict] | None:
    """Newest loadable checkpoint in out_dir; falls back past unreadable ones."""
    for _, path in reversed(list_checkpoints(out_dir)):
        try:
            return path, load_checkpoint(path)
        except Exception as e:  # truncated by a non-atomic copy, bad disk, ...
            print(f"warning: cannot load {path}: {e}; trying an older one", file=sys.stderr)
    return None


def rng_state() -> dict:
    st = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
          "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = torch.cuda.get_rng_state()
    return st


def set_rng_state(st: dict) -> None:
    torch.set_rng_state(st["torch"])
    np.random.set_state(st["numpy"])
    random.setstate(st["python"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state(st["cuda"])
