"""--sync against a real shell and filesystem (the local transport stands in for a node)."""
from __future__ import annotations

import os
from pathlib import Path

from cluster.backends.local import LocalTransport
from cluster.backends.sync import local_files, sync_dir


def tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


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
    src = tree(tmp_path, {"a.py": "", ".git/config": "", "pkg/__pycache__/m.pyc": "",
                          "pkg/m.py": "", "venv/pyvenv.cfg": "", "venv/lib/x.py": "",
                          "env/conda-meta/history": "", "env/lib/y.py": "", "runs/r/run.json": "",
                          "sub/runs/keep.txt": ""})
    os.chmod(src / "a.py", 0o755)
    files = {f.rel: f for f in local_files(src).files}
    assert list(files) == ["a.py", "pkg/m.py", "sub/runs/keep.txt"]
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
    assert [p.name for p in remote.iterdir()] == ["m.py"], "no temporary file is left behind"
    assert (remote / "m.py").stat().st_mtime == int((src / "m.py").stat().st_mtime)
