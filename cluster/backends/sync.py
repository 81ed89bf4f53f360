"""`--sync DIR`: copy a directory to a node through its transport, skipping the files whose
size and modification time already match there."""
from __future__ import annotations

import os
import posixpath
import shlex
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ..errors import ClusterError
from ..plan import shpath
from .supervised import Result

SKIP_NAMES = frozenset({"__pycache__", ".git", ".cluster", ".mypy_cache", ".pytest_cache"})
SKIP_TOP = frozenset({"runs"})        # the local run records, at the top of a synced dir
SKIP_SUFFIXES = (".pyc", ".pyo")


class SyncTarget(Protocol):
    def run(self, command: str, *, timeout: float | None = None) -> Result: ...

    def upload(self, local: Path, remote: str, mode: int, mtime: int) -> None: ...


@dataclass(frozen=True)
class LocalFile:
    rel: str
    path: Path
    size: int
    mtime: int
    mode: int


def local_files(root: str | Path) -> list[LocalFile]:
    """Files to sync under root: no __pycache__, .git, .cluster, top-level runs/, *.pyc."""
    root = Path(root)
    out: list[LocalFile] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        top = Path(dirpath) == root
        dirnames[:] = sorted(d for d in dirnames
                             if d not in SKIP_NAMES and not (top and d in SKIP_TOP))
        for name in sorted(filenames):
            if name.endswith(SKIP_SUFFIXES):
                continue
            p = Path(dirpath) / name
            try:
                st = p.stat()
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            out.append(LocalFile(p.relative_to(root).as_posix(), p, st.st_size,
                                 int(st.st_mtime), stat.S_IMODE(st.st_mode)))
    return out


def sync_dir(transport: SyncTarget, local: str | Path, remote: str) -> dict[str, Any]:
    """Copy local's files into remote (a directory on the node, may start with ~), skipping
    the ones whose size and mtime already match; uploaded files get the local mtime."""
    files = local_files(local)
    tops = sorted({f.rel.split("/", 1)[0] for f in files})
    listing = " ".join(shlex.quote(t) for t in tops)
    cmd = (f"mkdir -p {shpath(remote)} && cd {shpath(remote)} && pwd && "
           + (f"{{ find {listing} -type f -printf '%p\\t%s\\t%T@\\n' 2>/dev/null || true; }}"
              if tops else "true"))
    res = transport.run(cmd, timeout=120)
    if res.code != 0:
        raise ClusterError(f"sync: cannot list {remote}: {res.text()[-300:]}")
    lines = res.stdout.decode(errors="replace").splitlines()
    base = lines[0].strip()
    have: dict[str, tuple[int, int]] = {}
    for line in lines[1:]:
        parts = line.rsplit("\t", 2)
        if len(parts) == 3:
            try:
                have[parts[0]] = (int(parts[1]), int(float(parts[2])))
            except ValueError:
                continue
    todo = [f for f in files if have.get(f.rel) != (f.size, f.mtime)]
    if todo:
        dirs = sorted({posixpath.dirname(f.rel) for f in todo} - {""})
        if dirs:
            made = transport.run(f"cd {shlex.quote(base)} && mkdir -p -- "
                                 + " ".join(shlex.quote(d) for d in dirs), timeout=60)
            if made.code != 0:
                raise ClusterError(f"sync: cannot create directories in {base}: {made.text()[-300:]}")
        for f in todo:
            transport.upload(f.path, f"{base}/{f.rel}", f.mode & 0o777, f.mtime)
    return {"dir": base, "files": len(files), "copied": len(todo),
            "bytes": sum(f.size for f in todo)}
