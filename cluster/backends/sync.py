"""`--sync DIR`: copy a directory to a node through its transport, skipping the files whose
size and modification time already match there.

What is copied:
- every regular file under DIR, except what an ignore file or --sync-exclude leaves out:
  `.clusterignore` at the top of DIR if there is one, else DIR's `.gitignore` (gitignore
  syntax, as rsync-based launchers do), plus each --sync-exclude PATTERN;
- never version-control data, caches, virtual environments or conda environments (DEFAULT_SKIP,
  and any directory holding pyvenv.cfg or conda-meta), nor the local run records (top-level runs/)
  nor the reference trainer's checkpoints (top-level checkpoints/, where `cluster up` here
  writes them): a run on the nodes must never resume from a run of this machine;
- a symbolic link is followed only while it stays inside DIR: one leading out of the tree is
  skipped and reported, never copied from wherever it points.

Each file is written under a temporary name and renamed into place, and no name from DIR ever
reaches a remote command where it could be read as an option (a file called `-delete` stays a
file name).

What a sync put in a destination is recorded there (`.cluster/synced.json`), so that
`--sync-delete` removes exactly the files an earlier sync put there and DIR no longer has,
and nothing else: not what the job wrote (checkpoints, outputs), not what an exclude names now,
not what lies behind a symbolic link on the node, not inside an environment.
"""
from __future__ import annotations

import json
import os
import posixpath
import shlex
import stat
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ..console import human_bytes
from ..errors import ClusterError
from ..plan import shpath
from .transport import PRINT_MARK, Result, after_mark

if TYPE_CHECKING:
    import pathspec

DEFAULT_SKIP = ("__pycache__/", ".git/", ".hg/", ".svn/", ".cluster/", ".mypy_cache/",
                ".pytest_cache/", ".ruff_cache/", ".tox/", ".ipynb_checkpoints/", "*.pyc", "*.pyo",
                "/runs/", "/checkpoints/")
ENV_MARKERS = ("pyvenv.cfg", "conda-meta")   # a directory holding one is an environment
IGNORE_FILES = (".clusterignore", ".gitignore")
MANIFEST_DIR = ".cluster"
MANIFEST = f"{MANIFEST_DIR}/synced.json"     # in each destination: the names the last sync put there


class SyncTarget(Protocol):
    def run(self, command: str, *, timeout: float | None = None, input: bytes = b"") -> Result: ...

    def upload(self, local: Path, remote: str, mode: int, mtime: int) -> None: ...

    def put(self, data: bytes, path: str, mode: int) -> None: ...


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
    spec: pathspec.GitIgnoreSpec | None = None               # everything left out, as patterns


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
    return ignore_lines(lines), used


def ignore_lines(lines: Sequence[str]) -> pathspec.GitIgnoreSpec:
    import pathspec       # here, not at the top: a launch without --sync never loads its 31 modules
    return pathspec.GitIgnoreSpec.from_lines(lines)


def local_files(root: str | Path, exclude: Sequence[str] = ()) -> Selection:
    """The files of root to copy (see the module docstring), in a stable order."""
    root = Path(root).resolve()
    spec, used = ignore_spec(root, exclude)
    out = Selection(ignore_file=used, spec=spec)
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


# --- on the node -----------------------------------------------------------------------------


def _find(tops: Iterable[str]) -> str:
    """find over top-level names of the destination, each behind './' (so no name can be read
    as one of find's options), never following a symbolic link (-P): what lies behind a link
    on the node is never listed, so never deleted. One NUL-ended record per regular file:
    size, mtime, path (a name may hold a tab or a newline)."""
    names = " ".join(shlex.quote(f"./{t}") for t in tops)
    if not names:
        return "true"
    return f"{{ find -P {names} -type f -printf '%s\\t%T@\\t%p\\0' 2>/dev/null || true; }}"


def _listing_command(remote: str, tops: Iterable[str]) -> str:
    """mkdir + cd + pwd, the record of the last sync (one line, or an empty one), then size
    and mtime of what is there already under the given top-level names."""
    return (f"mkdir -p -- {shpath(remote)} && cd -- {shpath(remote)} && {PRINT_MARK} && pwd && "
            f"(umask 077 && mkdir -p ./{MANIFEST_DIR}) && "
            f"{{ cat ./{MANIFEST} 2>/dev/null || true; }} && echo && {_find(tops)}")


def _parse_records(data: bytes) -> dict[str, tuple[int, int]]:
    have: dict[str, tuple[int, int]] = {}
    for record in data.split(b"\0"):
        parts = record.decode(errors="surrogateescape").split("\t", 2)
        if len(parts) == 3:
            try:
                have[parts[2].removeprefix("./")] = (int(parts[0]), int(float(parts[1])))
            except ValueError:
                continue
    return have


def _parse_manifest(line: bytes) -> set[str]:
    """The files the last sync put there; a record that cannot be read is no record (nothing
    is then deleted), and only plain relative names count."""
    try:
        files = json.loads(line.decode(errors="surrogateescape") or "{}").get("files") or []
    except (ValueError, AttributeError):
        return set()
    return {f for f in files if isinstance(f, str) and safe_rel(f)}


def safe_rel(rel: str) -> bool:
    """A relative name that stays below its directory: no '', '.' or '..' part, no NUL."""
    return "\0" not in rel and all(p not in ("", ".", "..") for p in rel.split("/"))


def _ancestors(rel: str) -> list[str]:
    """'a/b/c' -> ['', 'a', 'a/b']."""
    parts = rel.split("/")[:-1]
    return [""] + ["/".join(parts[:i + 1]) for i in range(len(parts))]


def _excluded(rel: str, spec: pathspec.GitIgnoreSpec) -> bool:
    return spec.match_file(rel) or any(spec.match_file(a + "/") for a in _ancestors(rel) if a)


def _environments(have: Iterable[str]) -> set[str]:
    """The directories on the node that are environments (hold pyvenv.cfg or conda-meta/)."""
    envs = set()
    for rel in have:
        parts = rel.split("/")
        if parts[-1] == "pyvenv.cfg":
            envs.add("/".join(parts[:-1]))
        if "conda-meta" in parts[:-1]:
            envs.add("/".join(parts[:parts.index("conda-meta")]))
    return envs


def stale_files(previous: set[str], chosen: Selection, have: dict[str, tuple[int, int]]) -> list[str]:
    """What an earlier sync put there that is no longer in the local tree: files on the node
    (listed without following links), not excluded now (an excluded name is never touched),
    not inside an environment."""
    local = {f.rel for f in chosen.files}
    spec = chosen.spec or ignore_lines(DEFAULT_SKIP)
    envs = _environments(have)
    return sorted(rel for rel in previous - local
                  if rel in have and safe_rel(rel) and not _excluded(rel, spec)
                  and not any(a in envs for a in _ancestors(rel)))


def _names_input(rels: Iterable[str]) -> bytes:
    """Names for xargs -0, each behind './': they reach rm as arguments, never through a shell
    and never as an option."""
    return b"".join(f"./{rel}".encode(errors="surrogateescape") + b"\0" for rel in rels)


def _delete(transport: SyncTarget, base: str, stale: list[str]) -> None:
    """Remove the stale files, then the directories they leave empty (deepest first; a
    directory with anything else in it stays)."""
    where = shlex.quote(base)
    gone = transport.run(f"cd -- {where} && xargs -0 -r rm -f --", timeout=120,
                         input=_names_input(stale))
    if gone.code != 0:
        raise ClusterError(f"sync: cannot remove files in {base}: {gone.text()[-300:]}")
    dirs = sorted({a for rel in stale for a in _ancestors(rel) if a},
                  key=lambda d: (-d.count("/"), d))
    if dirs:
        transport.run(f"cd -- {where} && {{ xargs -0 -r rmdir -- 2>/dev/null; true; }}",
                      timeout=60, input=_names_input(dirs))


def sync_dir(transport: SyncTarget, local: str | Path, remote: str,
             exclude: Sequence[str] = (), delete: bool = False) -> dict[str, Any]:
    """Copy local's files into remote (a directory on the node, may start with ~), skipping
    the ones whose size and mtime already match; uploaded files get the local mtime. The
    names synced are recorded in remote's .cluster/synced.json; with delete, the files an
    earlier sync recorded there that are no longer in local are removed (stale_files)."""
    chosen = local_files(local, exclude)
    files = chosen.files
    tops = sorted({f.rel.split("/", 1)[0] for f in files})
    res = transport.run(_listing_command(remote, tops), timeout=120)
    if res.code != 0:
        raise ClusterError(f"sync: cannot list {remote}: {res.text()[-300:]}")
    base_line, _, rest = after_mark(res.stdout).partition(b"\n")
    manifest_line, _, records = rest.partition(b"\n")
    base = base_line.decode(errors="replace").strip()
    have = _parse_records(records)
    previous = _parse_manifest(manifest_line)
    more = sorted({rel.split("/", 1)[0] for rel in previous - {f.rel for f in files}} - set(tops))
    if more:                  # a whole top-level name gone here: list it there too
        listed = transport.run(f"cd -- {shlex.quote(base)} && {_find(more)}", timeout=120)
        have.update(_parse_records(listed.stdout))
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
    stale = stale_files(previous, chosen, have)
    if delete and stale:
        _delete(transport, base, stale)
    synced = {f.rel for f in files} | (set() if delete else set(stale))
    if synced != previous:
        transport.put(json.dumps({"files": sorted(synced)}).encode(), f"{base}/{MANIFEST}", 0o600)
    return {"dir": base, "files": len(files), "copied": len(todo),
            "bytes": sum(f.size for f in todo), "unchanged": len(files) - len(todo),
            "deleted": len(stale) if delete else 0, "stale": [] if delete else stale,
            "skipped_links": chosen.outside_links, "ignore_file": chosen.ignore_file}


# --- what the user reads ---------------------------------------------------------------------


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _counts(report: dict[str, Any], delete: bool) -> str:
    text = (f"{_plural(report['copied'], 'file')} sent ({human_bytes(report['bytes'])}), "
            f"{report['unchanged']} unchanged")
    if delete:
        text += f", {report['deleted']} deleted"
    elif report["stale"]:
        text += (f", {len(report['stale'])} removed here but kept there "
                 f"(--sync-delete removes them)")
    return text


def destination(local: str, sub: str, nodes: str) -> str:
    """'. to 3 nodes', or 'train to <workdir>/cluster-train on 3 nodes'."""
    return f"{local} to {nodes}" if sub in ("", ".") else f"{local} to <workdir>/{sub} on {nodes}"


def summary(local: str, sub: str, reports: dict[str, dict[str, Any]], delete: bool) -> str:
    """One line for every node: `synced . to 3 nodes: 12 files sent (1.2 MB), 340 unchanged,
    2 deleted`; nodes whose counts differ are named, grouped by their counts."""
    groups: dict[str, list[str]] = {}
    for node, report in reports.items():
        groups.setdefault(_counts(report, delete), []).append(node)
    where = destination(local, sub, _plural(len(reports), "node"))
    if len(groups) == 1:
        return f"synced {where}: {next(iter(groups))}"
    return f"synced {where}: " + "; ".join(f"{', '.join(nodes)}: {counts}"
                                          for counts, nodes in groups.items())


def preview(local: str, sub: str, exclude: Sequence[str], nodes: Sequence[str],
            delete: bool) -> tuple[str, str]:
    """What a dry run shows of a sync, read here alone (a dry run contacts no node): every
    file that would be sent, as a comment block for the plan's output, and one line."""
    chosen = local_files(local, exclude)
    total = sum(f.size for f in chosen.files)
    head = (f"# --sync {destination(local, sub, ', '.join(nodes))}: "
            f"{_plural(len(chosen.files), 'file')} ({human_bytes(total)}) to each")
    lines = [head] + [f"#   {human_bytes(f.size):>9}  {f.rel}" for f in chosen.files]
    lines += [f"#   skipped: {link} (a symbolic link leading out of {local})"
              for link in chosen.outside_links]
    if chosen.ignore_file:
        lines.append(f"#   also left out: what {chosen.ignore_file} names")
    note = (f"dry run: --sync {destination(local, sub, _plural(len(nodes), 'node'))} would "
            f"send at most {_plural(len(chosen.files), 'file')} ({human_bytes(total)}) to "
            f"each; not compared "
            f"with the nodes (a dry run contacts none), so files a node already has are "
            f"counted too")
    if delete:
        note += "; --sync-delete decides on each node what an earlier sync left there"
    return "\n".join(lines) + "\n", note
