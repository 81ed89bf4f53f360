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
