"""Shell completion: the scripts `cluster completion` prints, and RUN ids completed from ./runs
by the real command under click's completion protocol."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.cli import run_cli
from cluster.runs import RunDir


@pytest.mark.parametrize("shell,marker", [("bash", "_CLUSTER_COMPLETE=bash_complete"),
                                          ("zsh", "_CLUSTER_COMPLETE=zsh_complete"),
                                          ("fish", "_CLUSTER_COMPLETE=fish_complete")])
def test_completion_prints_the_script_for_each_shell(shell: str, marker: str, capsys) -> None:
    assert run_cli(["completion", shell]) == 0
    assert marker in capsys.readouterr().out


def test_completion_refuses_an_unknown_shell(capsys) -> None:
    assert run_cli(["completion", "tcsh"]) == 2
    assert "'tcsh' is not one of 'bash', 'zsh', 'fish'" in capsys.readouterr().err


def complete(cwd: Path, words: str) -> list[str]:
    env = dict(os.environ, _CLUSTER_COMPLETE="bash_complete", COMP_WORDS=words,
               COMP_CWORD=str(len(words.split()) - (0 if words.endswith(" ") else 1)))
    env.pop("CLUSTER_RUNS_DIR", None)
    out = subprocess.run([sys.executable, "-m", "cluster"], cwd=cwd, env=env,
                         capture_output=True, text=True, timeout=60)
    return [line.split(",", 1)[1] for line in out.stdout.splitlines() if "," in line]


def test_run_ids_complete_from_the_runs_folder(tmp_path: Path) -> None:
    for run_id in ("20260101-000000-aaaa", "20260102-000000-bbbb"):
        RunDir.create(run_id, tmp_path / "runs").write_meta({"run_id": run_id})
    (tmp_path / "runs" / "20260103-000000-cccc").mkdir()        # no run.json: not a run
    for verb in ("status", "logs", "down", "top"):
        assert complete(tmp_path, f"cluster {verb} 2026") == ["20260102-000000-bbbb",
                                                               "20260101-000000-aaaa"], verb
    assert complete(tmp_path, "cluster top 20260101") == ["20260101-000000-aaaa"]
    assert "exec" in complete(tmp_path, "cluster ex")
