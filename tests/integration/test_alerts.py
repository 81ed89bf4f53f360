"""Alerts end to end: `cluster up --local --nodes 2 --notify URL` with real torchrun, gloo and
a real HTTP server on 127.0.0.1 (tests/webhook.py): the bodies a failed, a restarted, a hung
and a clean run send, in order, and a secret the failing rank prints in none of them."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.webhook import Webhook

REPO = Path(__file__).resolve().parents[2]
PROGRAMS = REPO / "tests" / "integration" / "programs"
CANARY = "canary-7d1e55a0c3"

pytestmark = pytest.mark.skipif(
    subprocess.run([sys.executable, "-c", "import torch"], capture_output=True).returncode != 0,
    reason="torch is not installed for this python")


def up(tmp_path: Path, hook: Webhook, *args: str, nodes: int = 2,
       nproc: int = 1) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """`cluster up` on two simulated nodes with --notify, the secret exported; its output and
    the bodies received, each printed (the report of this test)."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", NO_COLOR="1", ALERT_CANARY=CANARY)
    env.pop("CLUSTER_RUNS_DIR", None)
    res = subprocess.run([sys.executable, "-m", "cluster", "up", "--local", "--nodes", str(nodes),
                          "--nproc-per-node", str(nproc), "--secret-env", "ALERT_CANARY",
                          "--notify", hook.url, *args], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=240)
    bodies = list(hook.bodies)
    for body in bodies:
        print(json.dumps(body))
    everything = res.stdout + res.stderr + json.dumps(bodies) + "".join(
        p.read_text(errors="replace") for p in (tmp_path / "runs").rglob("*.json"))
    assert hook.path not in everything, "the URL's token was shown or recorded"
    assert CANARY not in json.dumps(bodies)
    assert all(b["run"] == run_id(tmp_path) and b["launcher"] for b in bodies), bodies
    return res, bodies


def run_id(tmp_path: Path) -> str:
    (run,) = list((tmp_path / "runs").iterdir())
    return run.name


def kinds(bodies: list[dict[str, Any]]) -> list[tuple[str, int]]:
    return [(b["event"], b["attempt"]) for b in bodies]


def test_a_failed_run_sends_its_failure_then_its_finish(tmp_path: Path) -> None:
    with Webhook() as hook:
        res, bodies = up(tmp_path, hook, "--", str(PROGRAMS / "alerts_job.py"), "--mode", "fail")
    assert res.returncode == 4, res.stderr
    assert CANARY in (tmp_path / "runs" / run_id(tmp_path) / "logs" / "1-local1.log").read_text()
    assert kinds(bodies) == [("failure", 0), ("finish", 0)], bodies
    failure, finish = bodies
    assert failure["node"] == "local1 1"
    assert failure["cause"] == "RuntimeError: the store refused token ***", failure
    assert finish["ok"] is False and finish["error"].startswith("node [local1 1] failed: "
                                                                "RuntimeError: the store refused "
                                                                "token ***"), finish


def test_a_restarted_run_sends_failure_restart_finish(tmp_path: Path) -> None:
    with Webhook() as hook:
        res, bodies = up(tmp_path, hook, "--max-restarts", "1", "--",
                         str(PROGRAMS / "alerts_job.py"), "--mode", "fail-once")
    assert res.returncode == 0, res.stderr
    assert [k for k in kinds(bodies) if k[0] != "aside"] == [
        ("failure", 0), ("restart", 0), ("finish", 1)], bodies
    restart = next(b for b in bodies if b["event"] == "restart")
    assert restart["planned"] is False and restart["cause"] == (
        "RuntimeError: the store refused token ***"), restart
    assert "restarting the whole job" in restart["why"] and restart.get("class"), restart
    assert bodies[-1]["ok"] is True and bodies[-1]["code"] == 0


def test_a_hung_run_sends_its_hang_then_its_finish(tmp_path: Path) -> None:
    """Three nodes: two ranks wait in a barrier for the third, which sleeps elsewhere: the
    hang's odd one out and its frame come with the alert."""
    with Webhook() as hook:
        res, bodies = up(tmp_path, hook, "--hang-timeout", "8", "--",
                         str(PROGRAMS / "alerts_job.py"), "--mode", "hang", nodes=3)
    assert res.returncode == 4, res.stderr
    assert kinds(bodies) == [("hang", 0), ("finish", 0)], bodies
    hang, finish = bodies
    assert hang["how"].startswith("hang: no progress for") and hang["quiet"] >= 8, hang
    assert hang["node"] == "local2" and "stuck_here" in hang["frame"], hang
    assert finish["ok"] is False and " hung: " in finish["error"], finish


def test_a_clean_run_sends_only_its_finish(tmp_path: Path) -> None:
    with Webhook() as hook:
        res, bodies = up(tmp_path, hook, "--", str(PROGRAMS / "alerts_job.py"), "--mode", "ok")
    assert res.returncode == 0, res.stderr
    assert kinds(bodies) == [("finish", 0)], bodies
    assert bodies[0]["ok"] is True and bodies[0]["code"] == 0
    # the finish carries the run's goodput, as run.json records it
    run = next((tmp_path / "runs").iterdir())
    recorded = json.loads((run / "run.json").read_text())["goodput"]
    assert bodies[0]["goodput"]["fraction"] == recorded["fraction"] is not None, bodies[0]
    assert bodies[0]["goodput"]["wall"] == recorded["wall"] > 0
    assert "not delivered" not in res.stderr


def test_a_detached_run_sends_nothing_and_logs_f_sends_its_end(tmp_path: Path) -> None:
    """The launcher of a detached run leaves before it ends: no finish from it. `cluster logs
    -f --notify` sends the first failure and the finish once it sees the end. One node of
    two ranks: its torchrun stops the other rank (of two nodes, no launcher would stop the
    other node: it would wait out torchrun's exit barrier)."""
    with Webhook() as hook:
        res, bodies = up(tmp_path, hook, "--detach", "--", str(PROGRAMS / "alerts_job.py"),
                         "--mode", "fail", nodes=1, nproc=2)
        assert res.returncode == 0, res.stderr
        assert bodies == [] and hook.requests == []
        env = dict(os.environ, NO_COLOR="1", ALERT_CANARY=CANARY)
        env.pop("CLUSTER_RUNS_DIR", None)
        follow = subprocess.run([sys.executable, "-m", "cluster", "logs", "-f", "--notify",
                                 hook.url], cwd=tmp_path, env=env, capture_output=True,
                                text=True, timeout=180)
        bodies = list(hook.bodies)
    for body in bodies:
        print(json.dumps(body))
    assert follow.returncode == 4, follow.stderr
    assert CANARY in follow.stdout                     # the log shows it; the alerts do not
    assert hook.path not in follow.stdout + follow.stderr
    assert kinds(bodies) == [("failure", 0), ("finish", 0)], bodies
    failure, finish = bodies
    assert failure["node"].endswith(" 0") and failure["run"] == run_id(tmp_path)
    assert failure["cause"] == "RuntimeError: the store refused token ***", failure
    assert finish["ok"] is False and "***" in finish["error"] and CANARY not in json.dumps(bodies)
