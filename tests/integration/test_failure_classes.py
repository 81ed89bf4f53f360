"""Restarts decided by the failure's class, on four real sshd nodes (three running, node4 a
spare): a rank's hardware-looking error sets its node aside and the spare takes its place at
the same world size; the program's own error twice in a row stops the job after one restart
instead of spending the whole budget."""
from __future__ import annotations

import json
import re

import pytest

try:
    from tests.integration.conftest import PROGRAMS
except ImportError:  # run with tests/integration on sys.path
    from conftest import PROGRAMS  # type: ignore

pytestmark = [pytest.mark.integration]

SYNC = ["--sync", str(PROGRAMS), "--", "allreduce.py"]


def records(proc) -> list[dict]:
    return [json.loads(m.group(1)) for line in proc.out
            if (m := re.match(r"^\[\S+ \d+\] (\{.*\})$", line))]


def test_a_hardware_error_sets_the_node_aside_and_the_spare_takes_its_place(ssh_nodes4, cli):
    inv = ssh_nodes4.write_inventory(cli.home / "inv.yaml")
    ecc = "CUDA error: uncorrectable ECC error encountered"
    proc = cli.run("up", "-i", inv, "--nodes", "3", "--max-restarts", "2", *SYNC,
                   "--raise-node", "node2", "--raise-text", ecc, timeout=240)
    assert proc.popen.returncode == 0, proc.dump()
    assert "node2 set aside (failed_first: its rank failed first: RuntimeError: " + ecc \
        in proc.stderr, proc.dump()
    assert "node4 takes its place" in proc.stderr, proc.dump()
    second = [r for r in records(proc) if r.get("restart") == 1 and "sum" in r]
    assert sorted(r["node"] for r in second) == ["node1", "node3", "node4"], second
    assert {r["world_size"] for r in second} == {3}
    run = json.loads(next((cli.cwd / "runs").glob("*/run.json")).read_text())
    assert [(a.get("class"), a.get("rule")) for a in run["attempts"]] == [("node", "ecc"),
                                                                        (None, None)]


def test_the_programs_same_error_twice_stops_after_one_restart(ssh_nodes4, cli):
    inv = ssh_nodes4.write_inventory(cli.home / "inv.yaml")
    proc = cli.run("up", "-i", inv, "--nodes", "2", "--max-restarts", "5", *SYNC,
                   "--raise-rank", "1", timeout=240)
    assert proc.popen.returncode == 4, proc.dump()
    assert proc.stderr.count("restarting the whole job") == 1, proc.dump()
    assert "not restarted: the program failed the same way twice (RuntimeError: rank 1 gave " \
           "up)" in proc.stderr, proc.dump()
    run = json.loads(next((cli.cwd / "runs").glob("*/run.json")).read_text())
    assert [a.get("class") for a in run["attempts"]] == ["program", "program"]
    status = cli.run("status", timeout=60)
    assert "(class: program, python_error)" in status.stdout, status.dump()
