"""CLUSTER_REQUIRE_INTEGRATION=1 (CI) turns a skipped integration or slurm test into a failure;
a test marked cuda or docker may still skip; without the variable a skip is a skip. Each case
runs a small suite in a pytest of its own, with tests/require.py as its plugin."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree


REPO = Path(__file__).resolve().parents[2]
SUITE = """
import pytest

@pytest.mark.integration
def test_tier():
    pytest.skip("needs root")

@pytest.mark.slurm
def test_slurm():
    pytest.skip("needs slurm-wlm")

@pytest.mark.integration
@pytest.mark.cuda
def test_gpu():
    pytest.skip("needs a CUDA GPU")

@pytest.mark.integration
@pytest.mark.docker
def test_docker():
    pytest.skip("needs a docker client")

def test_unit():
    pytest.skip("regenerating")
"""


def outcomes(tmp_path: Path, require: str | None) -> tuple[dict[str, str], str]:
    """test name -> passed, failed or skipped (from the run's junit XML), and the output."""
    (tmp_path / "test_suite.py").write_text(SUITE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))   # its packages kept after
    env.pop("CLUSTER_REQUIRE_INTEGRATION", None)
    if require is not None:
        env["CLUSTER_REQUIRE_INTEGRATION"] = require
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.require", "-p",
                           "no:cacheprovider", "-W", "ignore", "--junitxml=out.xml",
                           "test_suite.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    found = {}
    for case in ElementTree.parse(tmp_path / "out.xml").iter("testcase"):
        kinds = {child.tag for child in case} & {"failure", "skipped", "error"}
        found[case.get("name")] = kinds.pop() if kinds else "passed"
    return found, done.stdout


def test_ci_fails_a_skipped_integration_or_slurm_test_and_says_why(tmp_path: Path) -> None:
    found, out = outcomes(tmp_path, "1")
    assert found == {"test_tier": "failure", "test_slurm": "failure", "test_gpu": "skipped",
                     "test_docker": "skipped", "test_unit": "skipped"}, out
    assert "test_tier skipped (Skipped: needs root), but CLUSTER_REQUIRE_INTEGRATION=1" in out, out


def test_without_the_variable_a_skip_is_a_skip(tmp_path: Path) -> None:
    found, out = outcomes(tmp_path, None)
    assert found == dict.fromkeys(("test_tier", "test_slurm", "test_gpu", "test_docker",
                                    "test_unit"), "skipped"), out
