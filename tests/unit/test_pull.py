"""`cluster pull`: the PATH rules, which argument is the RUN, and the copying from nodes whose
transport is the local one (real files, a real shell), every node reporting."""
from __future__ import annotations

import dataclasses
import io
import os
import stat
from pathlib import Path

import pytest

from cluster.backends.local import LocalTransport, local_inventory
from cluster.backends.transport import Result
from cluster.backends.pull import fetch, parse_listing
from cluster.backends.ssh.errors import Unreachable
from cluster.backends.supervised import SupervisedBackend
from cluster.cli import run_cli
from cluster.console import Console
from cluster.errors import ClusterError, InputError, PreflightError
from cluster.plan import Job, Templates, render
from cluster.pull import check_path, pull, split_args
from cluster.runs import RunDir
from tests.files import tree


# --- PATH rules ------------------------------------------------------------------------------


@pytest.mark.parametrize("path,words", [
    ("/etc/passwd", "is absolute"),
    ("~/.ssh/id_rsa", "is absolute"),
    ("../x", "leaves the workdir"),
    ("out/../../x", "leaves the workdir"),
    ("out/..", "leaves the workdir"),
    (".", "is the whole workdir"),
    ("./", "is the whole workdir"),
    ("", "is the whole workdir"),
    ("out\nrm -rf ~", "control character"),
])
def test_a_path_must_stay_inside_the_workdir(path: str, words: str) -> None:
    with pytest.raises(InputError) as info:
        check_path(path)
    assert words in str(info.value) and info.value.exit_code == 2


@pytest.mark.parametrize("path,normal", [("./ckpt//a/", "ckpt/a"), ("-rf", "-rf"),
                                         ("a b/$(id)", "a b/$(id)"), ("..x/y..", "..x/y..")])
def test_a_path_is_normalised(path: str, normal: str) -> None:
    assert check_path(path) == normal


@pytest.mark.parametrize("args", [["/etc/passwd"], ["20260101-000000-aaaa", "../x"],
                                  ["ok", "/abs"]])
def test_cli_refuses_a_bad_path_before_anything_else(tmp_path: Path, monkeypatch, capsys,
                                                     args: list[str]) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CLUSTER_RUNS_DIR", raising=False)
    assert run_cli(["pull", *args]) == 2
    err = capsys.readouterr().err
    assert "Invalid value for PATH" in err and "relative to each node's workdir" in err


def test_which_argument_is_the_run(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    RunDir.create("20260101-000000-aaaa", root).write_meta({"run_id": "x"})
    assert split_args(["out"], root) == (None, ["out"])
    assert split_args(["20260101-000000-aaaa", "out"], root) == ("20260101-000000-aaaa", ["out"])
    assert split_args(["2026", "out", "ckpt"], root) == ("2026", ["out", "ckpt"])
    assert split_args(["20270101-00", "out"], root) == ("20270101-00", ["out"]), \
        "shaped like a run id: RunDir.find then says no run matches"
    assert split_args(["ckpt", "out"], root) == (None, ["ckpt", "out"])
    with pytest.raises(InputError, match="Missing argument PATH: '20260101-000000-aaaa' is a run"):
        split_args(["20260101-000000-aaaa"], root)


# --- one node --------------------------------------------------------------------------------


def test_fetch_copies_files_and_folders_privately_and_reports_what_is_missing(tmp_path: Path) -> None:
    secret = tree(tmp_path / "secret", {"key": "PRIVATE"})
    work = tree(tmp_path / "work", {"out/a.txt": "a", "out/sub/b.bin": "bb", "ckpt.pt": "w",
                                    "-rf": "dash", "elsewhere.txt": "not asked"})
    os.symlink(secret, work / "out" / "link")          # a link below a PATH is not followed
    os.symlink(secret / "key", work / "out" / "key")
    os.utime(work / "ckpt.pt", (1_000_000, 1_000_000))
    into = tmp_path / "pulled" / "node1"
    result = fetch(LocalTransport(), str(work), ["out", "ckpt.pt", "-rf", "missing/x"], into)
    assert (result.files, result.bytes, result.missing) == (4, 8, ["missing/x"])
    got = {p.relative_to(into).as_posix(): p for p in into.rglob("*") if p.is_file()}
    assert sorted(got) == ["-rf", "ckpt.pt", "out/a.txt", "out/sub/b.bin"]
    assert got["out/sub/b.bin"].read_text() == "bb" and got["-rf"].read_text() == "dash"
    assert got["ckpt.pt"].stat().st_mtime == 1_000_000, "the node's time comes along"
    for p in [into, *into.rglob("*")]:
        mode = stat.S_IMODE(p.stat().st_mode)
        assert mode == (0o700 if p.is_dir() else 0o600), (p, oct(mode))
    assert not any(p.name.startswith(".") for p in into.rglob("*")), "no temporary file left"
    again = fetch(LocalTransport(), str(work), ["out"], into)
    assert (again.files, again.unchanged) == (0, 2), "what is already here is not copied again"


def test_a_node_cannot_send_a_name_that_leaves_the_folder() -> None:
    listing = (b"/w\n" + b"f\t1\t1.0\t./../../evil\0f\t1\t1.0\t./ok/../../x\0"
               b"f\t1\t1.0\t/etc/passwd\0f\t2\t3.5\t./out/fine\0m\t./gone\0")
    base, files, missing = parse_listing(listing)
    assert base == "/w" and [f.rel for f in files] == ["out/fine"] and missing == ["gone"]
    assert (files[0].size, files[0].mtime) == (2, 3)


def test_a_folder_here_that_is_a_link_is_not_written_through(tmp_path: Path) -> None:
    work = tree(tmp_path / "work", {"out/a.txt": "a"})
    outside = tmp_path / "outside"
    outside.mkdir()
    into = tmp_path / "pulled"
    into.mkdir()
    os.symlink(outside, into / "out")
    with pytest.raises(ClusterError, match="symbolic link"):
        fetch(LocalTransport(), str(work), ["out"], into)
    assert list(outside.iterdir()) == []


# --- every node of a run ---------------------------------------------------------------------


class Unreachable3:
    """A node whose SSH connection cannot be made."""
    label = "node3"

    def run(self, command: str, **_: object):
        raise Unreachable("node3 (10.0.0.3:22): cannot connect: No route to host")


def recorded(tmp_path: Path, names: tuple[str, ...], **meta: object) -> RunDir:
    base = local_inventory(len(names), gpus=[])           # CPU nodes, whatever this machine has
    hosts = tuple(dataclasses.replace(h, name=n, workdir=str(tmp_path / n))
                  for h, n in zip(base.hosts, names))
    inv = dataclasses.replace(base, hosts=hosts)
    run = RunDir.create("20260101-000000-abcd", tmp_path / "runs")
    run.record(render(inv, Job(run_id=run.run_id, script="t.py"), Templates()), inv, "local",
               ["cluster", "up"], dict(meta))
    return run


def test_every_node_reports_and_the_others_are_fetched(tmp_path: Path) -> None:
    run = recorded(tmp_path, ("node1", "node2", "node3"))
    tree(tmp_path / "node1", {"out/who.txt": "node1"})
    tree(tmp_path / "node2", {"elsewhere.txt": ""})              # lacks out/
    backend = SupervisedBackend(lambda h: Unreachable3() if h.name == "node3" else LocalTransport())
    err = io.StringIO()
    try:
        with pytest.raises(PreflightError) as info:
            pull(run, ["out"], backend, Console(err=err))
    finally:
        backend.close()
    lines = err.getvalue().splitlines()
    assert lines[0] == f"cluster: [node1] 1 file(s) (5 B) into {run.path}/pulled/node1/"
    assert lines[1] == f"cluster: [node2] 0 file(s) (0 B) into {run.path}/pulled/node2/; not on this node: out"
    assert lines[2].startswith("cluster: [node3] failed: node3 (10.0.0.3:22): cannot connect")
    assert str(info.value) == (f"pulled 1 file(s) (5 B) into {run.path}/pulled/; out from 1 of 3 node(s); "
                               f"incomplete from node3")
    assert info.value.exit_code == 3, "a node could not be reached"
    assert (run.path / "pulled" / "node1" / "out" / "who.txt").read_text() == "node1"
    assert stat.S_IMODE((run.path / "pulled").stat().st_mode) == 0o700


def test_a_path_that_only_some_nodes_have_is_pulled_from_them_and_one_on_none_fails(
        tmp_path: Path) -> None:
    """Rank 0 alone writes the checkpoints, on one node: `cluster pull checkpoints/` (as
    docs/getting-started.md has it) gets them from that node and exits 0 (it exited 1, the
    other nodes lacking them). A PATH that no node has still fails (exit 1)."""
    run = recorded(tmp_path, ("node1", "node2"))
    tree(tmp_path / "node2", {"checkpoints/epoch-0.pt": "e0", "out/log.txt": "2"})
    tree(tmp_path / "node1", {"out/log.txt": "1"})
    backend = SupervisedBackend(lambda h: LocalTransport())
    err = io.StringIO()
    try:
        assert pull(run, ["checkpoints", "out"], backend, Console(err=err)) == 0
        with pytest.raises(ClusterError) as info:
            pull(run, ["checkpoints", "nope"], backend, Console(err=io.StringIO()))
    finally:
        backend.close()
    lines = err.getvalue().splitlines()
    assert lines[0].endswith("/pulled/node1/; not on this node: checkpoints"), lines
    assert lines[-1].endswith("/pulled/; checkpoints from 1 of 2 node(s), out from 2 of 2 node(s)")
    assert (run.path / "pulled" / "node2" / "checkpoints" / "epoch-0.pt").read_text() == "e0"
    assert str(info.value).endswith("checkpoints from 1 of 2 node(s), nope from 0 of 2 node(s); "
                                    "on no node: nope") and info.value.exit_code == 1


def test_pull_of_a_local_run_through_the_cli(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CLUSTER_RUNS_DIR", raising=False)
    run = recorded(tmp_path, ("local0", "local1"))
    for n in ("local0", "local1"):
        tree(tmp_path / n, {"ckpt/last.pt": n})
    assert run_cli(["pull", run.run_id[:12], "ckpt/", "--node", "local1"]) == 0
    err = capsys.readouterr().err
    assert f"pulled 1 file(s) (6 B) into runs/{run.run_id}/pulled/; ckpt from 1 of 1 node(s)" in err
    assert (run.path / "pulled" / "local1" / "ckpt" / "last.pt").read_text() == "local1"
    assert not (run.path / "pulled" / "local0").exists()
    assert run_cli(["pull", "ckpt", "--node", "gpu9"]) == 2
    assert "Invalid value for --node: 'gpu9' is not in run" in capsys.readouterr().err


def test_a_dry_run_and_a_slurm_run_say_why_nothing_is_pulled(tmp_path: Path, monkeypatch,
                                                            capsys) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CLUSTER_RUNS_DIR", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")               # two CPU nodes, even on a GPU box
    assert run_cli(["up", "--local", "--nodes", "2", "--dry-run", "--", "t.py"]) == 0
    capsys.readouterr()
    assert run_cli(["pull", "out"]) == 2      # a dry run is never the newest run: named only
    assert "dry runs are named by id only" in capsys.readouterr().err
    dry = RunDir.find(None, dry_runs=True).run_id
    assert run_cli(["pull", dry, "out"]) == 2
    assert "was a dry run: nothing ran on its nodes" in capsys.readouterr().err
    assert run_cli(["up", "--backend", "slurm", "--hosts", "n[1-2]", "--dry-run", "--", "t.py"]) == 0
    capsys.readouterr()
    run = RunDir.find(None, dry_runs=True)
    run.update(dry_run=False)
    assert run_cli(["pull", "out"]) == 2
    err = capsys.readouterr().err
    assert f"ran under SLURM in {tmp_path}" in err and "share with this machine" in err
    assert "Traceback" not in err


def test_pull_completes_as_a_verb_and_its_run(tmp_path: Path) -> None:
    from tests.unit.test_completion import complete
    RunDir.create("20260101-000000-aaaa", tmp_path / "runs").write_meta({"run_id": "x"})
    assert "pull" in complete(tmp_path, "cluster pu")
    assert complete(tmp_path, "cluster pull 2026") == ["20260101-000000-aaaa"]
    assert complete(tmp_path, "cluster pull 20260101-000000-aaaa 2026") == []


class GreetingTransport(LocalTransport):
    """This machine behind a login shell that greets first, as a ~/.bashrc that echoes does
    over SSH: a line that looks like a path, then one like a listing's record."""

    def run(self, command: str, *, timeout: float | None = None, input: bytes = b"") -> Result:
        return super().run("echo /home/greeting; printf 'f\\t1\\t1.0\\t./planted\\0\\n'; " + command,
                           timeout=timeout, input=input)


def test_a_shells_greeting_is_not_read_as_the_listing(tmp_path: Path) -> None:
    work = tree(tmp_path / "work", {"out/a.txt": "a"})
    into = tmp_path / "pulled"
    into.mkdir()
    got = fetch(GreetingTransport(), str(work), ["out"], into)
    assert got.files == 1 and (into / "out" / "a.txt").read_text() == "a"
    assert not (into / "planted").exists() and not (into / "home").exists()
