"""--sync against a real shell and filesystem (the local transport stands in for a node)."""
from __future__ import annotations

import os
from pathlib import Path

import json

import pytest

from cluster.backends.local import LocalTransport
from cluster.backends.supervised import Result
from cluster.backends.sync import local_files, preview, summary, sync_dir
from tests.files import tree


def test_a_file_named_like_an_option_stays_a_file_name(tmp_path: Path) -> None:
    """A top-level `-delete` once reached `find` as its -delete action and erased the remote
    workdir. Every name now reaches find behind './'."""
    src = tree(tmp_path / "src", {"-delete": "x", "-exec": "y", "train.py": "print(1)\n"})
    remote = tree(tmp_path / "remote", {"precious.txt": "keep me\n"})
    report = sync_dir(LocalTransport(), src, str(remote))
    assert (remote / "precious.txt").read_text() == "keep me\n"
    assert (remote / "-delete").read_text() == "x" and (remote / "-exec").read_text() == "y"
    assert report["copied"] == 3
    again = sync_dir(LocalTransport(), src, str(remote))
    assert again["copied"] == 0, "unchanged files (size and mtime) are skipped"
    assert (remote / "precious.txt").exists()


def test_defaults_skip_vcs_caches_and_environments(tmp_path: Path) -> None:
    """...and what `cluster up` writes here: run records, and the reference trainer's
    checkpoints (a run on the nodes would resume from a run of this machine)."""
    src = tree(tmp_path, {"a.py": "", ".git/config": "", "pkg/__pycache__/m.pyc": "",
                          "pkg/m.py": "", "venv/pyvenv.cfg": "", "venv/lib/x.py": "",
                          "env/conda-meta/history": "", "env/lib/y.py": "", "runs/r/run.json": "",
                          "sub/runs/keep.txt": "", "checkpoints/ckpt_step00000220.pt": "",
                          "sub/checkpoints/keep.pt": ""})
    os.chmod(src / "a.py", 0o755)
    files = {f.rel: f for f in local_files(src).files}
    assert list(files) == ["a.py", "pkg/m.py", "sub/checkpoints/keep.pt", "sub/runs/keep.txt"]
    assert files["a.py"].mode == 0o755 and files["a.py"].size == 0


def test_ignore_files_and_command_line_patterns(tmp_path: Path) -> None:
    src = tree(tmp_path, {".gitignore": "data/\n*.ckpt\n!keep.ckpt\n", "data/big.bin": "",
                          "x.ckpt": "", "keep.ckpt": "", "train.py": "", "notes.md": ""})
    sel = local_files(src, exclude=["*.md"])
    assert sel.ignore_file == ".gitignore"
    assert [f.rel for f in sel.files] == [".gitignore", "keep.ckpt", "train.py"]
    (src / ".clusterignore").write_text("train.py\n")      # wins over .gitignore
    sel = local_files(src)
    assert sel.ignore_file == ".clusterignore"
    assert "train.py" not in [f.rel for f in sel.files] and "data/big.bin" in [f.rel for f in sel.files]


def test_symlinks_are_followed_only_inside_the_tree(tmp_path: Path) -> None:
    outside = tree(tmp_path / "secret", {"id_rsa": "PRIVATE"})
    src = tree(tmp_path / "src", {"lib/util.py": "u", "main.py": "m"})
    os.symlink(outside / "id_rsa", src / "key")
    os.symlink(outside, src / "home")
    os.symlink(src / "lib" / "util.py", src / "alias.py")
    os.symlink(src / "lib", src / "lib2")
    remote = tmp_path / "remote"
    report = sync_dir(LocalTransport(), src, str(remote))
    assert sorted(report["skipped_links"]) == ["home/", "key"]
    assert not (remote / "key").exists() and not (remote / "home").exists()
    assert (remote / "alias.py").read_text() == "u" and not (remote / "alias.py").is_symlink()
    assert (remote / "lib2" / "util.py").read_text() == "u"
    assert "PRIVATE" not in "".join(p.read_text() for p in remote.rglob("*") if p.is_file())


def test_upload_leaves_no_partial_file(tmp_path: Path) -> None:
    src = tree(tmp_path / "src", {"m.py": "x" * 100000})
    remote = tmp_path / "remote"
    sync_dir(LocalTransport(), src, str(remote))
    assert sorted(p.name for p in remote.iterdir()) == [".cluster", "m.py"], \
        "no temporary file is left behind"
    assert [p.name for p in (remote / ".cluster").iterdir()] == ["synced.json"]
    assert (remote / "m.py").stat().st_mtime == int((src / "m.py").stat().st_mtime)


# --- counts ----------------------------------------------------------------------------------


def test_counts_sent_unchanged_and_one_line_for_every_node(tmp_path: Path) -> None:
    src = tree(tmp_path / "src", {"a.py": "a", "pkg/b.py": "bb", "pkg/c.py": "ccc"})
    nodes = {f"node{i}": tmp_path / f"n{i}" for i in (1, 2, 3)}
    first = {n: sync_dir(LocalTransport(), src, str(d)) for n, d in nodes.items()}
    assert {n: (r["copied"], r["bytes"], r["unchanged"]) for n, r in first.items()} == \
        {n: (3, 6, 0) for n in nodes}
    assert summary(".", ".", first, delete=False) == \
        "synced . to 3 nodes: 3 files sent (6 B), 0 unchanged"
    (src / "a.py").write_text("a changed")
    os.utime(src / "a.py", (1, 1))
    (nodes["node2"] / "pkg" / "c.py").unlink()         # node2 lost a file meanwhile
    again = {n: sync_dir(LocalTransport(), src, str(d)) for n, d in nodes.items()}
    assert again["node1"]["copied"] == 1 and again["node1"]["unchanged"] == 2
    assert again["node2"]["copied"] == 2 and again["node2"]["bytes"] == 9 + 3
    assert summary(".", ".", again, delete=False) == (
        "synced . to 3 nodes: node1, node3: 1 file sent (9 B), 2 unchanged; "
        "node2: 2 files sent (12 B), 1 unchanged")
    assert summary("/t", "cluster-train", again, delete=True).startswith(
        "synced /t to <workdir>/cluster-train on 3 nodes: ")


# --- dry run: a preview from this machine alone ----------------------------------------------


def test_preview_lists_every_file_and_says_no_node_was_asked(tmp_path: Path) -> None:
    src = tree(tmp_path / "src", {"train.py": "x" * 2048, "data/big.bin": "", ".git/HEAD": "",
                                  ".gitignore": "data/\n"})
    text, note = preview(str(src), ".", [], ["node1", "node2"], delete=True)
    lines = text.splitlines()
    assert lines[0] == f"# --sync {src} to node1, node2: 2 files (2.0 KB) to each"
    assert lines[1:3] == ["#         6 B  .gitignore", "#      2.0 KB  train.py"]
    assert "data/big.bin" not in text and ".git/" not in text and len(lines) == 4
    assert "2 files (2.0 KB) to each; not compared with the nodes (a dry run contacts none)" in note
    assert "--sync-delete" in note


# --- --sync-delete ---------------------------------------------------------------------------


class Recording(LocalTransport):
    """The local transport, keeping every command it was given."""

    def __init__(self) -> None:
        self.commands: list[str] = []

    def run(self, command: str, *, timeout: float | None = None, input: bytes = b"") -> Result:
        self.commands.append(command)
        return super().run(command, timeout=timeout, input=input)


def test_a_file_deleted_here_stays_there_unless_sync_delete(tmp_path: Path) -> None:
    src = tree(tmp_path / "src", {"keep.py": "k", "old.py": "o", "gone/deep/x.py": "x"})
    remote = tmp_path / "remote"
    sync_dir(LocalTransport(), src, str(remote))
    tree(remote, {"checkpoints/step1.pt": "weights", "out/metrics.jsonl": "{}"})  # the job's
    (src / "old.py").unlink()
    (src / "gone" / "deep" / "x.py").unlink()
    kept = sync_dir(LocalTransport(), src, str(remote))
    assert kept["stale"] == ["gone/deep/x.py", "old.py"] and kept["deleted"] == 0
    assert (remote / "old.py").exists() and (remote / "gone" / "deep" / "x.py").exists()
    assert "2 removed here but kept there (--sync-delete removes them)" in \
        summary(".", ".", {"n": kept}, delete=False)
    gone = sync_dir(LocalTransport(), src, str(remote), delete=True)
    assert gone["deleted"] == 2 and gone["stale"] == []
    assert not (remote / "old.py").exists() and not (remote / "gone").exists(), \
        "the directories the deletion emptied go too"
    assert (remote / "keep.py").read_text() == "k"
    assert (remote / "checkpoints" / "step1.pt").read_text() == "weights", "never a sync's own"
    assert (remote / "out" / "metrics.jsonl").exists()
    assert summary(".", ".", {"n": gone}, delete=True) == \
        "synced . to 1 node: 0 files sent (0 B), 1 unchanged, 2 deleted"
    assert sync_dir(LocalTransport(), src, str(remote), delete=True)["deleted"] == 0


def test_delete_of_names_like_options_and_shell_never_sees_a_name(tmp_path: Path) -> None:
    names = ["-rf", "--no-preserve-root", "$(touch pwned)", "a b;rm -rf ~", "tab\there", "new\nline"]
    src = tree(tmp_path / "src", {**{n: n for n in names}, "keep.py": "k"})
    remote = tree(tmp_path / "remote", {"precious.txt": "keep me"})
    sync_dir(LocalTransport(), src, str(remote))
    assert all((remote / n).read_text() == n for n in names)
    for n in names:
        (src / n).unlink()
    node = Recording()
    report = sync_dir(node, src, str(remote), delete=True)
    assert report["deleted"] == len(names)
    assert sorted(p.name for p in remote.iterdir()) == [".cluster", "keep.py", "precious.txt"]
    assert not (tmp_path / "pwned").exists() and not Path("pwned").exists()
    removal = [c for c in node.commands if "xargs" in c]
    assert len(removal) == 1 and removal[0].endswith("&& xargs -0 -r rm -f --"), \
        "names travel on stdin to xargs -0, never on a command line"


def test_delete_keeps_excluded_paths_environments_and_what_links_lead_to(tmp_path: Path) -> None:
    outside = tree(tmp_path / "outside", {"x.py": "not ours"})
    src = tree(tmp_path / "src", {"data/set.bin": "d", "lib/x.py": "x", "tools/t.py": "t",
                                  "main.py": "m"})
    remote = tmp_path / "remote"
    sync_dir(LocalTransport(), src, str(remote))
    tree(remote, {".git/HEAD": "ref", "__pycache__/m.pyc": "", "venv/pyvenv.cfg": "",
                  "venv/bin/python": ""})
    # on the node, lib/ became a link to a directory outside the destination
    (remote / "lib" / "x.py").unlink()
    (remote / "lib").rmdir()
    os.symlink(outside, remote / "lib")
    # and a record that names things outside, or inside an environment
    manifest = remote / ".cluster" / "synced.json"
    recorded = json.loads(manifest.read_text())["files"]
    manifest.write_text(json.dumps({"files": recorded + [
        "../outside/x.py", "/etc/hostname", "venv/bin/python", ".git/HEAD", "a//b", "./main.py"]}))
    for rel in ("data/set.bin", "lib/x.py", "tools/t.py"):
        (src / rel).unlink()
    report = sync_dir(LocalTransport(), src, str(remote), exclude=["data/"], delete=True)
    assert report["deleted"] == 1 and not (remote / "tools").exists()
    assert (remote / "data" / "set.bin").read_text() == "d", "an excluded path is never removed"
    assert (outside / "x.py").read_text() == "not ours", "a link on the node is not followed"
    assert (remote / "lib").is_symlink()
    for rel in (".git/HEAD", "__pycache__/m.pyc", "venv/pyvenv.cfg", "venv/bin/python", "main.py"):
        assert (remote / rel).exists(), rel


@pytest.mark.parametrize("record", ["not json", '{"files": "x"}', '{"files": [1, null]}', ""])
def test_an_unreadable_record_deletes_nothing(tmp_path: Path, record: str) -> None:
    src = tree(tmp_path / "src", {"a.py": "a", "b.py": "b"})
    remote = tmp_path / "remote"
    sync_dir(LocalTransport(), src, str(remote))
    (remote / ".cluster" / "synced.json").write_text(record)
    (src / "b.py").unlink()
    assert sync_dir(LocalTransport(), src, str(remote), delete=True)["deleted"] == 0
    assert (remote / "b.py").exists()


def test_dry_run_of_up_shows_what_sync_would_send(tmp_path: Path, monkeypatch, capsys) -> None:
    from cluster.cli import run_cli
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CLUSTER_RUNS_DIR", raising=False)
    tree(tmp_path / "proj", {"t.py": "print(1)\n", "notes.md": "", "pkg/m.py": ""})
    code = run_cli(["up", "--hosts", "gpu[1-3]", "--sync", "proj", "--sync-exclude", "*.md",
                    "--sync-delete", "--dry-run", "--", "t.py"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "# --sync proj to gpu1, gpu2, gpu3: 2 files (9 B) to each\n" in out
    assert "  pkg/m.py\n" in out and "  t.py\n" in out and "notes.md" not in out
    assert ("cluster: dry run: --sync proj to 3 nodes would send at most 2 files (9 B) to each; "
            "not compared with the nodes (a dry run contacts none)") in err


@pytest.mark.parametrize("args,words", [
    (["--hosts", "a", "--sync-delete"], "--sync-delete goes with --sync DIR"),
    (["--local", "--sync", ".", "--sync-delete"], "--sync is for the ssh backend"),
])
def test_sync_delete_needs_sync_over_ssh(tmp_path: Path, monkeypatch, capsys, args, words) -> None:
    from cluster.cli import run_cli
    monkeypatch.chdir(tmp_path)
    assert run_cli(["up", *args, "--dry-run", "--", "t.py"]) == 2
    assert words in capsys.readouterr().err
    assert not (tmp_path / "runs").exists(), "nothing is created"


def test_a_shells_greeting_is_not_read_as_the_listing(tmp_path: Path) -> None:
    """Behind a login shell that greets first (a ~/.bashrc that echoes, over SSH), the folder's
    path, the last sync's record and what is there are still read from the listing itself."""
    from tests.unit.test_pull import GreetingTransport
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.py").write_text("a")
    remote = tmp_path / "remote"
    first = sync_dir(GreetingTransport(), src, str(remote))
    again = sync_dir(GreetingTransport(), src, str(remote))
    assert (remote / "a.py").read_text() == "a"
    assert (first["copied"], again["copied"], again["unchanged"]) == (1, 0, 1), (first, again)
