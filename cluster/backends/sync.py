"""`--sync DIR`: copy a directory to a node through its transport, skipping the files whose
size and modification time already match there.

What is copied:
- every regular file under DIR, except what an ignore file or --sync-exclude leaves out:
  `.clusterignore` at the top of DIR if there is one, else DIR's `.gitignore` (gitignore
  syntax, as rsync-based launchers do), plus each --sync-exclude PATTERN;
- never version-control data, caches, virtual environments or conda environments (DEFAULT_SKIP,
  and any directory holding pyvenv.cfg or conda-meta), nor the local run records (top-level runs/);
- a symbolic link is followed only while it stays inside DIR: one leading out of the tree is
  skipped and reported, never copied from wherever it points.

Each file is written under a temporary name and renamed into place, and no name from DIR ever
reaches a remote command where it could be read as an option (a file called `-delete` stays a
file name).
"""
from __future__ import annotations

import os
import posixpath
import shlex
import stat
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import pathspec

from ..errors import ClusterError
from ..plan import shpath
from .supervised import Result

DEFAULT_SKIP = ("__pycache__/", ".git/", ".hg/", ".svn/", ".cluster/", ".mypy_cache/",
                ".pytest_cache/", ".ruff_cache/", ".tox/", ".ipynb_checkpoints/", "*.pyc", "*.pyo",
                "/runs/")
ENV_MARKERS = ("pyvenv.cfg", "conda-meta")   # a directory holding one is an environment
IGNORE_FILES = (".clusterignore", ".gitignore")


class SyncTarget(Protocol):
    def run(self, command: str, *, timeout: float | None = None, input: bytes = b"") -> Result: ...

    def upload(self, local: Path, remote: str, mode: int, mtime: int) -> None: ...


@dataclass(frozen=True)
class LocalFile:
    rel: str
    path: Path
    size: int
    mtime: int
    mode: int


@dataclass
class Selection:
    files: list[LocalFile] = field(default_factory=list)
    outside_links: list[str] = field(default_factory=list)   # symlinks leading out of the tree
    ignore_file: str | None = None                           # which ignore file was honoured


def ignore_spec(root: Path, extra: Sequence[str] = ()) -> tuple[pathspec.GitIgnoreSpec, str | None]:
    """Our defaults, then the tree's own ignore file, then the command line's patterns."""
    lines = list(DEFAULT_SKIP)
    used = None
    for name in IGNORE_FILES:
        f = root / name
        if f.is_file():
            lines += f.read_text(errors="replace").splitlines()
            used = name
            break
    lines += list(extra)
    return pathspec.GitIgnoreSpec.from_lines(lines), used


def local_files(root: str | Path, exclude: Sequence[str] = ()) -> Selection:
    """The files of root to copy (see the module docstring), in a stable order."""
    root = Path(root).resolve()
    spec, used = ignore_spec(root, exclude)
    out = Selection(ignore_file=used)
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        here = Path(dirpath)
        kept = []
        for d in sorted(dirnames):
            p = here / d
            rel = p.relative_to(root).as_posix()
            if spec.match_file(rel + "/") or any((p / m).exists() for m in ENV_MARKERS):
                continue
            if p.is_symlink():
                _linked_dir(root, p, rel, spec, out)
                continue
            kept.append(d)
        dirnames[:] = kept
        for name in sorted(filenames):
            p = here / name
            rel = p.relative_to(root).as_posix()
            if not spec.match_file(rel):
                _add(root, p, rel, out)
    return out


def _inside(root: Path, p: Path) -> bool:
    try:
        p.resolve().relative_to(root)
        return True
    except (ValueError, OSError):
        return False


def _add(root: Path, p: Path, rel: str, out: Selection) -> None:
    if p.is_symlink() and not _inside(root, p):
        out.outside_links.append(rel)
        return
    try:
        st = p.stat()
    except OSError:
        return
    if stat.S_ISREG(st.st_mode):
        out.files.append(LocalFile(rel, p, st.st_size, int(st.st_mtime), stat.S_IMODE(st.st_mode)))


def _linked_dir(root: Path, p: Path, rel: str, spec: pathspec.GitIgnoreSpec, out: Selection) -> None:
    """A symlinked directory: copied under its link's name while it points inside the tree
    (its target is not itself a link into a loop: os.walk does not follow further links)."""
    if not _inside(root, p):
        out.outside_links.append(rel + "/")
        return
    target = p.resolve()
    for dirpath, dirnames, filenames in os.walk(target, followlinks=False):
        sub = Path(dirpath).relative_to(target)
        dirnames[:] = sorted(d for d in dirnames
                             if not spec.match_file(f"{rel}/{(sub / d).as_posix()}/"))
        for name in sorted(filenames):
            link_rel = f"{rel}/{(sub / name).as_posix()}"
            if not spec.match_file(link_rel):
                _add(root, Path(dirpath) / name, link_rel, out)


def _listing_command(remote: str, tops: Iterable[str]) -> str:
    """mkdir + cd + pwd, then size and mtime of what is there already. Every top-level name
    goes to find behind './', so no name can be read as one of find's options."""
    names = " ".join(shlex.quote(f"./{t}") for t in tops)
    listing = (f"{{ find {names} -type f -printf '%p\\t%s\\t%T@\\n' 2>/dev/null || true; }}"
               if names else "true")
    return f"mkdir -p -- {shpath(remote)} && cd -- {shpath(remote)} && pwd && {listing}"


def _parse_listing(lines: list[str]) -> dict[str, tuple[int, int]]:
    have: dict[str, tuple[int, int]] = {}
    for line in lines:
        parts = line.rsplit("\t", 2)
        if len(parts) == 3:
            try:
                have[parts[0].removeprefix("./")] = (int(parts[1]), int(float(parts[2])))
            except ValueError:
                continue
    return have


def sync_dir(transport: SyncTarget, local: str | Path, remote: str,
             exclude: Sequence[str] = ()) -> dict[str, Any]:
    """Copy local's files into remote (a directory on the node, may start with ~), skipping
    the ones whose size and mtime already match; uploaded files get the local mtime."""
    chosen = local_files(local, exclude)
    files = chosen.files
    tops = sorted({f.rel.split("/", 1)[0] for f in files})
    res = transport.run(_listing_command(remote, tops), timeout=120)
    if res.code != 0:
        raise ClusterError(f"sync: cannot list {remote}: {res.text()[-300:]}")
    lines = res.stdout.decode(errors="replace").splitlines()
    base = lines[0].strip()
    have = _parse_listing(lines[1:])
    todo = [f for f in files if have.get(f.rel) != (f.size, f.mtime)]
    if todo:
        dirs = sorted({posixpath.dirname(f.rel) for f in todo} - {""})
        if dirs:
            made = transport.run(f"cd -- {shlex.quote(base)} && mkdir -p -- "
                                 + " ".join(shlex.quote(f"./{d}") for d in dirs), timeout=60)
            if made.code != 0:
                raise ClusterError(f"sync: cannot create directories in {base}: {made.text()[-300:]}")
        for f in todo:
            transport.upload(f.path, f"{base}/{f.rel}", f.mode & 0o777, f.mtime)
    return {"dir": base, "files": len(files), "copied": len(todo),
            "bytes": sum(f.size for f in todo), "skipped_links": chosen.outside_links,
            "ignore_file": chosen.ignore_file}
