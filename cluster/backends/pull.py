"""`cluster pull`: files under a node's workdir copied to this machine, through the node's
transport (over SSH, the SFTP session --sync uses; for simulated local nodes, plain files).

One round trip lists every PATH on the node (regular files; a PATH that is a symbolic link is
followed, links below it are not), then each file is copied under a temporary name and renamed
into place, with the node's modification time; a file already here with the same size and time
is skipped. What lands here is private (folders 0700, files 0600), and a name the node sends
back is used only when it stays below the folder it lands in.
"""
from __future__ import annotations

import os
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Protocol

from ..errors import ClusterError
from ..plan import shpath
from ..runs import make_private_dir
from .transport import PRINT_MARK, Result, after_mark
from .sync import safe_rel


class PullSource(Protocol):
    def run(self, command: str, *, timeout: float | None = None, input: bytes = b"") -> Result: ...

    def download(self, path: str, into: BinaryIO) -> int: ...


@dataclass
class RemoteFile:
    rel: str                 # below the workdir, e.g. checkpoints/step100.pt
    size: int
    mtime: int


@dataclass
class PullResult:
    """One node's pull: what came, what was already here, the PATHs it does not have."""
    into: Path
    files: int = 0
    bytes: int = 0
    unchanged: int = 0
    missing: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.missing


def listing_command(workdir: str, paths: Sequence[str]) -> str:
    """cd into the workdir, print its absolute path, then per PATH either an 'm' record (not
    there) or one 'f' record per regular file (size, mtime, path), NUL-ended. Each PATH is
    quoted and behind './', so none is read as an option or by the shell."""
    names = " ".join(shlex.quote(f"./{p}") for p in paths)
    return (f"cd -- {shpath(workdir)} && {PRINT_MARK} && pwd && {{ for p in {names}; do "
            f"if [ -e \"$p\" ]; then find -H \"$p\" -type f -printf 'f\\t%s\\t%T@\\t%p\\0'; "
            f"else printf 'm\\t%s\\0' \"$p\"; fi; done; true; }}")


def parse_listing(data: bytes) -> tuple[str, list[RemoteFile], list[str]]:
    """(the workdir's absolute path, the files, the PATHs not there)."""
    head, _, records = after_mark(data).partition(b"\n")
    files: dict[str, RemoteFile] = {}
    missing: list[str] = []
    for record in records.split(b"\0"):
        kind, _, rest = record.decode(errors="surrogateescape").partition("\t")
        if kind == "m":
            missing.append(rest.removeprefix("./"))
        elif kind == "f":
            parts = rest.split("\t", 2)
            rel = parts[-1].removeprefix("./")
            if len(parts) == 3 and safe_rel(rel):
                try:
                    files[rel] = RemoteFile(rel, int(parts[0]), int(float(parts[1])))
                except ValueError:
                    continue
    return head.decode(errors="replace").strip(), list(files.values()), missing


def fetch(node: PullSource, workdir: str, paths: Sequence[str], into: Path) -> PullResult:
    """Copy every PATH (relative to workdir; checked by the caller) from one node into
    `into`, keeping each file's path below the workdir. Raises ClusterError when the node
    cannot be listed or a file cannot be copied."""
    listed = node.run(listing_command(workdir, paths), timeout=120)
    if listed.code != 0:
        raise ClusterError(f"cannot list {workdir}: {listed.text()[-300:] or 'no answer'}")
    base, files, missing = parse_listing(listed.stdout)
    result = PullResult(into, missing=missing)
    make_private_dir(into)
    for f in files:
        target = _target(into, f.rel)
        if _same(target, f):
            result.unchanged += 1
            continue
        result.bytes += _copy(node, f"{base}/{f.rel}", target, f.mtime)
        result.files += 1
    return result


def _target(into: Path, rel: str) -> Path:
    """into/rel, its folders made private; refused when a folder on the way is a link (it
    could lead out of into)."""
    here = into
    for part in rel.split("/")[:-1]:
        here = here / part
        if here.is_symlink():
            raise ClusterError(f"{here} is a symbolic link; not writing through it")
        make_private_dir(here)
    return here / rel.rsplit("/", 1)[-1]


def _same(target: Path, f: RemoteFile) -> bool:
    try:
        st = target.lstat()
    except OSError:
        return False
    return st.st_size == f.size and int(st.st_mtime) == f.mtime


def _copy(node: PullSource, remote: str, target: Path, mtime: int) -> int:
    tmp = target.with_name(f".{target.name}.pull-tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "wb") as out:
            size = node.download(remote, out)
        os.utime(tmp, (mtime, mtime))
        tmp.replace(target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return size
