"""Files to and from the nodes, end to end on the namespaced SSH nodes through the real
`cluster` CLI: `--sync` (its summary line, `--sync-delete`) and `cluster pull`. Each test works
in a workdir of its own on every node, so what one syncs is not another's."""
from __future__ import annotations

import stat
from pathlib import Path

import pytest

from tests.files import tree

try:
    from tests.integration.conftest import Cli
except ImportError:  # run with tests/integration on sys.path
    from conftest import Cli  # type: ignore

pytestmark = [pytest.mark.integration]

NODES = (1, 2, 3)


def inventory(ssh_nodes4, cli: Cli, sub: str) -> tuple[str, dict[int, Path]]:
    """An inventory of nodes 1-3 whose workdirs are <workdir>/<sub>; and those workdirs."""
    import yaml
    data = ssh_nodes4.inventory(list(NODES))
    for host in data["hosts"]:
        host["workdir"] = f"{host['workdir']}/{sub}"
    path = cli.home / f"{sub}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path), {i: Path(ssh_nodes4.workdir(i)) / sub for i in NODES}


def test_sync_delete_removes_what_was_deleted_here_on_every_node(ssh_nodes4, cli, tmp_path):
    inv, work = inventory(ssh_nodes4, cli, "syncdel")
    proj = tree(tmp_path / "proj", {"hello.py": "print('hello')\n", "old.py": "x = 1\n",
                                    "pkg/gone.py": "y = 2\n", ".git/HEAD": "ref\n"})
    up = ["up", "-i", inv, "--sync", str(proj)]
    first = cli.run(*up, "--", "hello.py")
    assert first.popen.returncode == 0, first.dump()
    assert f"cluster: synced {proj} to 3 nodes: 3 files sent (27 B), 0 unchanged" in first.err, first.dump()
    for i in NODES:
        assert (work[i] / "old.py").read_text() == "x = 1\n" and (work[i] / "pkg" / "gone.py").exists()
        tree(work[i], {"out/result.txt": "the job's own"})       # written on the node, not synced

    (proj / "old.py").unlink()
    (proj / "pkg" / "gone.py").unlink()
    kept = cli.run(*up, "--", "hello.py")
    assert kept.popen.returncode == 0, kept.dump()
    assert (f"cluster: synced {proj} to 3 nodes: 0 files sent (0 B), 1 unchanged, 2 removed "
            f"here but kept there (--sync-delete removes them)") in kept.err, kept.dump()
    assert all((work[i] / "old.py").exists() for i in NODES), "without the flag they stay"

    gone = cli.run(*up, "--sync-delete", "--", "hello.py")
    assert gone.popen.returncode == 0, gone.dump()
    assert f"cluster: synced {proj} to 3 nodes: 0 files sent (0 B), 1 unchanged, 2 deleted" in gone.err, gone.dump()
    for i in NODES:
        assert not (work[i] / "old.py").exists() and not (work[i] / "pkg").exists(), i
        assert (work[i] / "hello.py").exists() and not (work[i] / ".git").exists()
        assert (work[i] / "out" / "result.txt").read_text() == "the job's own", i
        runs = {p.name for p in (work[i] / ".cluster").iterdir() if p.is_dir()}
        assert {first.run_id(), kept.run_id(), gone.run_id()} <= runs, "run folders stay"


WRITER = """\
import os, socket
if os.environ.get("LOCAL_RANK", "0") == "0":
    me = socket.gethostname()
    os.makedirs("out/deep", exist_ok=True)
    open("out/who.txt", "w").write(me)
    open(f"out/deep/{me}.txt", "w").write(me * 1000)
"""


def test_pull_brings_each_nodes_files_into_its_own_folder(ssh_nodes4, cli, tmp_path):
    inv, work = inventory(ssh_nodes4, cli, "pull")
    proj = tree(tmp_path / "proj", {"writer.py": WRITER})
    up = cli.run("up", "-i", inv, "--sync", str(proj), "--", "writer.py")
    assert up.popen.returncode == 0, up.dump()
    run_id = up.run_id()
    ssh_nodes4.stop_sshd(3)                                       # one node cannot be reached
    try:
        partial = cli.run("pull", run_id, "out", timeout=120)
    finally:
        ssh_nodes4.start_sshd(3)
    assert partial.popen.returncode == 3, partial.dump()
    assert "[node3] failed:" in partial.stderr and "incomplete from node3" in partial.stderr
    done = cli.run("pull", "out", "writer.py", timeout=120)
    assert done.popen.returncode == 0, done.dump()
    pulled = cli.cwd / "runs" / run_id / "pulled"
    for i in NODES:
        name = f"node{i}"
        assert (pulled / name / "out" / "who.txt").read_text() == name
        assert (pulled / name / "out" / "deep" / f"{name}.txt").read_text() == name * 1000
        assert (pulled / name / "writer.py").read_text() == WRITER
        assert sorted(p.name for p in (pulled / name / "out" / "deep").iterdir()) == [f"{name}.txt"]
        assert f"cluster: [{name}] " in done.stderr
    assert "out from 3 of 3 node(s), writer.py from 3 of 3 node(s)" in done.stderr, done.dump()
    for p in [pulled, *pulled.rglob("*")]:
        assert stat.S_IMODE(p.stat().st_mode) == (0o700 if p.is_dir() else 0o600), p
    missing = cli.run("pull", "nope", "--node", "node2", timeout=120)
    assert missing.popen.returncode == 1, missing.dump()
    assert "[node2] 0 file(s) (0 B) into" in missing.stderr and "not on this node: nope" in missing.stderr
    assert "nope from 0 of 1 node(s); on no node: nope" in missing.stderr, missing.dump()


# A training script as people write them: every rank trains, rank 0 alone saves the
# checkpoints (in checkpoints/ of its working directory), as the reference trainer does.
TRAIN = """\
import argparse, os, time
import torch.distributed as dist
p = argparse.ArgumentParser()
p.add_argument("--epochs", type=int, default=2)
args = p.parse_args()
dist.init_process_group("gloo")
for epoch in range(args.epochs):
    time.sleep(0.2)
    dist.barrier()
    if dist.get_rank() == 0:
        os.makedirs("checkpoints", exist_ok=True)
        open(f"checkpoints/epoch-{epoch}.pt", "w").write(f"epoch {epoch}")
dist.destroy_process_group()
"""


def test_the_getting_started_ssh_flow_as_written(ssh_nodes4, cli, tmp_path):
    """docs/getting-started.md, section 2, in its order, on two SSH nodes: sync and run, then
    the detached run, status, logs -f, top, pull checkpoints/, down. Every step succeeds; the
    checkpoints come from the node that wrote them."""
    import yaml
    data = ssh_nodes4.inventory([1, 2])
    for host in data["hosts"]:
        host["workdir"] = f"{host['workdir']}/getting-started"
    inv = cli.home / "my-hosts.yaml"
    inv.write_text(yaml.safe_dump(data, sort_keys=False))
    cli.cwd = tree(tmp_path / "project", {"train.py": TRAIN})      # `--sync .` is this folder
    steps = [("up", "-i", str(inv), "--sync", ".", "--", "train.py", "--epochs", "5"),
             ("up", "-i", str(inv), "--detach", "--", "train.py"),
             ("status",), ("logs", "-f"), ("top", "--once"), ("pull", "checkpoints/"), ("down",)]
    said = {}
    for step in steps:
        done = cli.run(*step, timeout=180)
        said[step[0] + (" detach" if "--detach" in step else "")] = done
        assert done.popen.returncode == 0, (step, done.dump())
    run_id = said["up detach"].run_id()
    pulled = cli.cwd / "runs" / run_id / "pulled"
    got = sorted(p.relative_to(pulled).as_posix() for p in pulled.rglob("*.pt"))
    writer = got[0].split("/")[0]               # rank 0's node, wherever the rendezvous put it
    assert got == [f"{writer}/checkpoints/epoch-{i}.pt" for i in range(5)], got
    assert "checkpoints from 1 of 2 node(s)" in said["pull"].stderr, said["pull"].dump()
