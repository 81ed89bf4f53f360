"""`cluster top`'s collection and rows, with fakes: a node's answer is what its status program
(cluster/remote/status.py, through the bootloader) prints, run here with a PATH of the node's
own (a stand-in nvidia-smi on a GPU node, none on a CPU node, whatever this machine has),
parsed by pure functions."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from rich.console import Console as RichConsole

from cluster.backends.shipping import BOOT, SUPERVISOR, SUPERVISOR_FILES, program
from cluster.backends.transport import Result
from cluster.errors import ClusterError
from cluster.nodes import NodeStatus, read_answer
from cluster.runs import RunDir
from cluster.spec import Host
from cluster.observe.top import (STALE_S, Gpu, Metrics, Pace, Row, cells, collect, collect_slurm, ended,
                         metrics_file, parse_gpus, parse_metrics, parse_steps, render, row_from,
                         status_args, tail)

SMI = """#!/bin/sh
echo "0, 97, 40960, 81920"
echo "1, [N/A], 1024, 81920"
"""


def node_dir(tmp_path: Path, state: dict) -> Path:
    d = tmp_path / "node"
    d.mkdir()
    for name in SUPERVISOR_FILES:       # as a run's start leaves them
        (d / f"{name}.py").write_text(SUPERVISOR.with_name(f"{name}.py").read_text())
    for name, value in state.items():
        (d / name).write_text(value)
    return d


def node_bin(tmp_path: Path, smi: str | None) -> Path:
    """A node's PATH: nvidia-smi only when `smi` is given (the node's python is given by its
    full path), so that a CPU node stays one on a machine that has GPUs."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if smi is not None:
        (bin_dir / "nvidia-smi").write_text(smi)
        (bin_dir / "nvidia-smi").chmod(0o755)
    return bin_dir


def ask(args: list[str], bin_dir: Path) -> Result:
    """The node's status program, as the backend's run_program sends it."""
    env = dict(os.environ, PATH=str(bin_dir))
    p = subprocess.run([sys.executable, "-c", BOOT], input=program("status", *args).data,
                       capture_output=True, env=env)
    return Result(p.returncode, p.stdout, p.stderr)


def test_metrics_file_follows_the_recorded_out() -> None:
    assert metrics_file(["--out", ".cluster/r/train", "--x"], "~/w") == "~/w/.cluster/r/train/metrics.jsonl"
    assert metrics_file(["--out=/abs/out/"], "~/w") == "/abs/out/metrics.jsonl"
    assert metrics_file(["--epochs", "1"], "~/w") is None


def test_one_round_trip_reads_status_gpus_and_metrics(tmp_path: Path) -> None:
    d = node_dir(tmp_path, {"exit": json.dumps({"code": 0, "stopped": False}),
                            "started": "1.0", "pgid": "5"})
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"type": "run", "step": 0}\n'
                       '{"type": "step", "step": 40, "loss": 0.5, "images_per_s": 1200.0}\n'
                       '{"type": "step", "step": 50, "loss": 0.25, "images_per_s": 1300.5}\n'
                       '{"type": "step", "st')                         # a write in progress
    answer = ask(status_args(str(d), str(metrics)), node_bin(tmp_path, SMI))
    row = row_from({"rank": 0, "name": "gpu1"}, answer)
    assert row.state == "exited" and row.detail == "exit code 0"
    assert row.gpus == (Gpu(0, 97.0, 40960.0, 81920.0), Gpu(1, None, 1024.0, 81920.0))
    assert row.metrics == Metrics(50, 0.25, 1300.5)
    assert cells(row)[4:9] == ["97% ?", "40.0/80G 1.0/80G", "50", "0.2500", "1,300"]


def test_a_cpu_node_without_metrics_shows_dashes(tmp_path: Path) -> None:
    d = node_dir(tmp_path, {})
    answer = ask(status_args(str(d), str(tmp_path / "none.jsonl")), node_bin(tmp_path, None))
    row = row_from({"rank": 0, "name": "cpu1"}, answer)
    assert row.gpus is None and row.metrics is None
    assert cells(row)[4:9] == ["-", "-", "-", "-", "-"]


def steps_file(d: Path, name: str, text: str, age: float = 0.0) -> None:
    f = d / f"heartbeat.steps.{name}"
    f.write_text(text)
    when = time.time() - age
    os.utime(f, (when, when))


def test_the_ranks_step_reports_give_the_nodes_slowest_rate_and_work(tmp_path: Path) -> None:
    """Two ranks on the node: the rate is the slower one's (steps / seconds), the work the
    larger compute + data; an old line without "seconds", a file being written (.tmp) and a
    garbage file are read as far as they go."""
    d = node_dir(tmp_path, {"started": "1.0", "pgid": "5"})
    steps_file(d, "0", '{"rank": 0, "compute": 0.2, "data": 0.004, "steps": 5, "seconds": 1.25}\n')
    steps_file(d, "1", '{"rank": 1, "compute": 0.25, "data": 0.01, "steps": 4, "seconds": 1.6}\n', 3)
    steps_file(d, "2", '{"rank": 2, "compute": 0.3, "data": 0.0, "steps": 3}\n')   # no "seconds"
    steps_file(d, "3.tmp", '{"rank": 3, "compute": 9, "data": 9, "steps": 1, "seconds": 90}\n')
    steps_file(d, "4", '{"rank": 4, "compute"')                                  # cut
    answer = ask(status_args(str(d), None), node_bin(tmp_path, None))
    said = read_answer(answer.stdout)
    assert [r["rank"] for r in said["steps"]] == [0, 1, 2], said
    assert said["steps"][0]["rate"] == 4.0 and said["steps"][1]["rate"] == 2.5
    assert said["steps"][2]["rate"] is None and said["steps"][2]["seconds"] is None
    assert 2.5 < said["steps"][1]["age"] < 3 + 10 and said["steps"][0]["age"] < 10
    row = row_from({"rank": 0, "name": "n1"}, answer)
    assert row.pace is not None and row.pace.rate == 2.5 and not row.pace.stale
    assert row.pace.work == 0.3 and row.pace.age < 3
    assert cells(row)[9:11] == ["2.50", "0.300"]


def test_a_node_whose_reports_stopped_coming_reads_stalled(tmp_path: Path) -> None:
    d = node_dir(tmp_path, {"started": "1.0", "pgid": "5"})
    steps_file(d, "0", '{"rank": 0, "compute": 0.2, "data": 0.0, "steps": 5, "seconds": 1.0}\n', 42)
    steps_file(d, "1", '{"rank": 1, "compute": 0.2, "data": 0.0, "steps": 5, "seconds": 1.0}\n', 50)
    row = row_from({"rank": 0, "name": "n1"}, ask(status_args(str(d), None), node_bin(tmp_path, None)))
    assert row.pace is not None and row.pace.stale
    rate, work = cells(row)[9:11]
    assert rate.startswith("stalled 4") and rate.endswith(" s") and 42 <= int(rate.split()[1]) < 50
    assert work == "0.200", "the last work per step stays shown"


def test_a_node_without_step_reports_has_no_pace(tmp_path: Path) -> None:
    d = node_dir(tmp_path, {})
    row = row_from({"rank": 0, "name": "n1"}, ask(status_args(str(d), None), node_bin(tmp_path, None)))
    assert row.pace is None and cells(row)[9:11] == ["-", "-"]


def test_parse_steps_takes_the_slowest_rank_and_the_newest_report() -> None:
    pace = parse_steps([{"rank": 0, "rate": 4.0, "seconds": 1.0, "compute": 0.1, "data": 0.1, "age": 5.0},
                        {"rank": 1, "rate": 3.0, "seconds": 1.2, "compute": 0.3, "data": 0.0, "age": 1.0},
                        {"rank": 2, "rate": None, "seconds": None, "compute": 0.1, "data": 0.0, "age": 0.5},
                        {"rank": 3, "age": "soon"}, "junk"])
    assert pace == Pace(3.0, 0.3, 0.5, 1.2, compute=0.3, data=0.1)   # each part's slowest rank
    assert parse_steps([]) is None and parse_steps(None) is None and parse_steps({"0": 1}) is None
    assert parse_steps([{"rank": 0, "compute": 0.1, "data": 0.0, "age": 1.0}]) == \
        Pace(None, 0.1, 1.0, compute=0.1, data=0.0)


def test_stalled_after_ten_seconds_or_three_report_intervals_when_steps_are_slower() -> None:
    assert not Pace(2.0, 0.4, STALE_S - 1).stale and Pace(2.0, 0.4, STALE_S + 1).stale
    slow = Pace(0.05, 19.0, 45.0, every=20.0)          # one step per 20 s: a report each 20 s
    assert not slow.stale and replace(slow, age=61.0).stale
    assert cells(Row(0, "n", "running", pace=Pace(None, None, 130.0)))[9] == "stalled 2 min"
    assert cells(Row(0, "n", "running", pace=Pace(1234.5, 0.0008, 1.0)))[9:11] == ["1,234", "0.001"]


def test_a_removed_run_folder_reads_gone(tmp_path: Path) -> None:
    answer = ask(status_args(str(tmp_path / "removed"), None), node_bin(tmp_path, None))
    assert row_from({"rank": 1, "name": "n2"}, answer).state == "gone"


def test_an_unreachable_node_is_a_row_too() -> None:
    row = row_from({"rank": 2, "name": "n3"}, ClusterError("n3: connection refused\nmore"))
    assert (row.state, row.detail) == ("unreachable", "n3: connection refused")
    lost = row_from({"rank": 2, "name": "n3"}, Result(None, b"", b"timed out"))
    assert lost.state == "unreachable"


def test_parsers_skip_what_they_do_not_know() -> None:
    assert parse_gpus(["No devices were found"]) is None
    assert parse_metrics(["not json", "[1, 2]"]) is None
    assert parse_metrics(['{"type": "epoch", "step": 22, "train_loss": 0.3, "images_per_s": null}']) \
        == Metrics(22, 0.3, None)


class FakeBackend:
    """each() and run_program() as SupervisedBackend has them."""

    def __init__(self, answers: dict[str, Result]) -> None:
        self.answers = answers
        self.asked: dict[str, list[tuple[str, ...]]] = {name: [] for name in answers}

    def run_program(self, host: Host, program: str, *args: str, timeout: float = 120) -> Result:
        self.asked[host.name].append((program, *args))
        return self.answers[host.name]

    def each(self, nodes, fn):  # type: ignore[no-untyped-def]
        return [(n, fn(n)) for n in nodes]


def recorded(tmp_path: Path, backend: str = "ssh", **meta) -> RunDir:
    from cluster.spec import Inventory
    run = RunDir.create("20260101-000000-abcd", tmp_path / "runs")
    run.write_inventory(Inventory(hosts=(Host(name="n1", address="10.0.0.1", workdir="~/w"),
                                         Host(name="n2", address="10.0.0.2", workdir="~/w"))))
    run.write_meta({"backend": backend, "nodes": [
        {"rank": 0, "name": "n1", "run_dir": "~/w/.cluster/r/n1", "dir": "/home/u/w/.cluster/r/n1"},
        {"rank": 1, "name": "n2", "run_dir": "~/w/.cluster/r/n2"}], **meta})
    return run


def framed(obj: dict) -> bytes:
    """A node program's answer as it says it (remote/options.answer)."""
    return b"\x1e" + json.dumps(obj).encode() + b"\x1f"


def test_collect_asks_every_node_once_and_only_rank_0_for_metrics(tmp_path: Path) -> None:
    running = {"state": "running", "uptime": 75.0}
    fake = FakeBackend({
        "n1": Result(0, framed({"status": running, "gpus": None,
                                "metrics": ['{"step": 7, "loss": 1.5}']}), b""),
        "n2": Result(0, b"a greeting\n" + framed({"status": running, "gpus": None}) + b"\n", b"")})
    rows = collect(recorded(tmp_path, args=["--out", ".cluster/r/train"]), fake)
    assert [(r.node, r.state, r.uptime) for r in rows] == [("n1", "running", 75.0), ("n2", "running", 75.0)]
    assert rows[0].metrics == Metrics(7, 1.5, None) and rows[1].metrics is None
    (c1,), (c2,) = fake.asked["n1"], fake.asked["n2"]
    assert c1 == ("status", "--dir", "/home/u/w/.cluster/r/n1", "--gpus",
                  "--steps", "/home/u/w/.cluster/r/n1/heartbeat",
                  "--metrics", "~/w/.cluster/r/train/metrics.jsonl", "--lines", "20")
    assert c2 == ("status", "--dir", "~/w/.cluster/r/n2", "--gpus",
                  "--steps", "~/w/.cluster/r/n2/heartbeat")
    assert not ended(rows)
    assert ended([Row(0, "n1", "exited"), Row(1, "n2", "stopped")])
    assert not ended([Row(0, "n1", "exited"), Row(1, "n2", "unreachable")]), \
        "an unreachable node may still be running"


def test_collect_under_slurm_uses_the_scheduler_and_the_shared_output(tmp_path: Path) -> None:
    out = tmp_path / "runs" / "x" / "train"
    out.mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 3, "loss": 2.0, "images_per_s": 10}\n')

    class Slurm:
        def status(self, run: RunDir) -> list[NodeStatus]:
            return [NodeStatus(0, "c1", "running", detail="job 5 RUNNING"), NodeStatus(1, "c2", "running")]
    run = recorded(tmp_path, backend="slurm", args=["--out", "runs/x/train"], cwd=str(tmp_path))
    rows = collect_slurm(run, Slurm())
    assert [(r.node, r.state, r.gpus) for r in rows] == [("c1", "running", None), ("c2", "running", None)]
    assert rows[0].metrics == Metrics(3, 2.0, 10.0) and rows[1].metrics is None


def test_tail_reads_the_last_lines_of_a_long_file(tmp_path: Path) -> None:
    f = tmp_path / "m.jsonl"
    f.write_text("".join(f'{{"step": {i}}}\n' for i in range(20000)))
    assert tail(f, 2) == ['{"step": 19998}', '{"step": 19999}']
    assert tail(tmp_path / "missing", 2) is None


def test_render_shows_a_row_per_node_and_detail_only_when_there_is_one() -> None:
    rows = [Row(1, "n2", "exited", detail="exit code 1"), Row(0, "n1", "running", 3725.0)]
    text = io.StringIO()
    RichConsole(file=text, width=200).print(render(rows, "run x"))
    lines = text.getvalue().splitlines()
    assert "detail" in lines[2]
    body = [l for l in lines if "n1" in l or "n2" in l]
    assert "1:02:05" in body[0] and "exit code 1" in body[1]
    text = io.StringIO()
    RichConsole(file=text, width=200).print(render([Row(0, "n1", "running")], "run x"))
    assert "detail" not in text.getvalue()
    assert "step/s" not in text.getvalue() and "work s" not in text.getvalue()


def test_render_shows_the_pace_columns_when_a_node_reported() -> None:
    rows = [Row(0, "n1", "running", pace=Pace(4.25, 0.204, 1.0)),
            Row(1, "n2", "running", pace=Pace(1.5, 0.61, 42.0)), Row(2, "n3", "unreachable")]
    text = io.StringIO()
    RichConsole(file=text, width=200).print(render(rows, "run x"))
    lines = text.getvalue().splitlines()
    head = [c.strip() for c in lines[2].split("┃")[1:-1]]
    assert head[-2:] == ["step/s", "work s"], head
    body = {c[1]: c for c in ([x.strip() for x in l.split("│")[1:-1]] for l in lines)
            if len(c) > 2 and c[1].startswith("n")}
    assert body["n1"][-2:] == ["4.25", "0.204"]
    assert body["n2"][-2:] == ["stalled 42 s", "0.610"]
    assert body["n3"][-2:] == ["-", "-"]


LONG_NAME = ".".join(["n" + "x" * 59] * 4)          # 243 characters: a host name may be 253


def test_top_once_into_a_pipe_is_as_wide_as_the_table_not_80_columns(tmp_path: Path, monkeypatch,
                                                                     capsys) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("COLUMNS", raising=False)
    from cluster.cli import run_cli
    from cluster.spec import Inventory
    run = RunDir.create("20260101-000000-abcd", tmp_path / "runs")
    run.write_inventory(Inventory(hosts=(Host(name=LONG_NAME, address="127.0.0.1",
                                              workdir=str(tmp_path)),), backend="local"))
    run.write_meta({"backend": "local", "nodes": [
        {"rank": 0, "name": LONG_NAME, "run_dir": str(tmp_path / "removed")}]})
    assert run_cli(["top", "--once"]) == 0
    out = capsys.readouterr().out
    row = next((line for line in out.splitlines() if "gone" in line), None)
    assert row is not None and LONG_NAME in row, out
    # The whole row, to its last column (step, loss, images/s); the GPU columns before them
    # are whatever this machine has.
    assert row and row.rstrip().endswith("│    - │    - │     - │"), row


def test_fit_keeps_a_terminals_own_width_and_reads_a_dumb_ones(monkeypatch) -> None:
    from cluster.observe.top import fit
    table = render([Row(0, LONG_NAME, "running")], "run x")
    term = RichConsole(file=io.StringIO(), force_terminal=True, _environ={"TERM": "xterm", "COLUMNS": "120"})
    fit(term, table)
    assert term.width == 120                       # rich follows the terminal, resizes included
    monkeypatch.setenv("COLUMNS", "150")           # what shutil.get_terminal_size reads first
    dumb = RichConsole(file=io.StringIO(), force_terminal=True, _environ={"TERM": "dumb"})
    assert dumb.width == 80
    fit(dumb, table)
    assert dumb.width == 150
    pipe = RichConsole(file=io.StringIO(), _environ={})
    fit(pipe, table)
    assert pipe.width > len(LONG_NAME)
