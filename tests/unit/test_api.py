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


# --- a detached run's nodes that do not answer -----------------------------------------------


def test_a_node_unanswered_for_the_keepalive_is_lost_and_an_answer_starts_it_over():
    from cluster.api import Unanswered
    from cluster.nodes import NodeStatus
    now = [100.0]
    silent = Unanswered(6.0, clock=lambda: now[0])
    gone = [NodeStatus(0, "a", "running"), NodeStatus(1, "b", "unreachable", detail="timed out")]
    now[0] = 105.0
    assert silent.lost(gone, asked=100.0) == []             # 5 s without an answer
    now[0] = 106.5
    assert [r.name for r in silent.lost(gone, asked=104.0)] == ["b"]   # counted from 100
    assert silent.why(silent.lost(gone, asked=106.0)) == \
        "no answer for 6 s, ssh.keepalive is 6 s: timed out"
    back = [NodeStatus(0, "a", "running"), NodeStatus(1, "b", "running")]
    assert silent.lost(back, asked=107.0) == []
    now[0] = 110.0
    assert silent.lost(gone, asked=109.0) == []             # silent again: from 109


def test_the_unreachable_error_names_the_node_and_what_to_do():
    from cluster.errors import NodeLost
    from cluster.nodes import unreachable_error
    err = unreachable_error("R1", ["node2 1"], "the connection to it was lost")
    assert isinstance(err, NodeLost) and err.exit_code == 5
    assert err.message.startswith("run R1: node [node2 1] cannot be reached (the connection "
                                  "to it was lost)")
    assert "`cluster status R1`" in err.message and "`cluster down R1`" in err.message
