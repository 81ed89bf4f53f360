"""The Python API's promises on bad input and resources (docs/python-api.md), through the
local backend's dry run: nothing is contacted."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from cluster import api
from cluster.errors import InputError


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "t.py").write_text("print(1)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    return tmp_path


def test_a_misspelled_keyword_is_an_input_error_with_the_nearest_option(project: Path) -> None:
    with pytest.raises(InputError, match="'nodez'.*did you mean 'nodes'"):
        api.up(None, "t.py", nodez=2)


def test_echo_false_leaves_no_file_open(project: Path) -> None:
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(5):
        run = api.up(None, "t.py", echo=False, dry_run=True)
        run._thread.join(60)
        assert run.returncode == 0, run.error
    assert len(os.listdir("/proc/self/fd")) == before


def tree(*roots: Path) -> set[str]:
    return {str(p) for root in roots for p in root.rglob("*")}


@pytest.mark.parametrize("local", [False, True], ids=["this-machine", "simulated-nodes"])
def test_prepare_creates_nothing(project: Path, tmp_path_factory: pytest.TempPathFactory,
                                 monkeypatch: pytest.MonkeyPatch, local: bool) -> None:
    """prepare() checks and renders every script, and no file or folder appears: not the
    run's folder, not the compiled templates' cache (a run's start writes it)."""
    home = tmp_path_factory.mktemp("home")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv("CLUSTER_RUNS_DIR", raising=False)
    before = tree(project, home)
    api.prepare(api.Request(command=("t.py",), nodes=2 if local else None, force_local=local))
    assert tree(project, home) == before
    run = api.up(None, "t.py", echo=False, dry_run=True)        # a run: the cache is written
    run._thread.join(60)
    assert run.returncode == 0, run.error
    assert any("templates" in p for p in tree(home) - before), tree(home)
