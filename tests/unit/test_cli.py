"""The CLI without any node: dry runs, run directories, option errors."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from cluster.cli import run_cli
from cluster.runs import RunDir

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def in_tmp(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CLUSTER_RUNS_DIR", raising=False)
    return tmp_path


def test_dry_run_prints_every_script_and_records_the_run(in_tmp: Path, capsys) -> None:
    code = run_cli(["up", "-i", str(REPO / "inventory" / "example.yaml"), "--dry-run",
                    "--", "train.py", "--lr", "0.1 x"])
    assert code == 0
    out = capsys.readouterr().out
    assert out.count("#!/usr/bin/env bash") == 2
    assert "node 0: gpu-a (10.0.0.11)" in out and "node 1: gpu-b (10.0.0.12)" in out
    run = RunDir.find(None, in_tmp / "runs", dry_runs=True)
    meta = run.meta()
    assert meta["dry_run"] is True and meta["backend"] == "ssh"
    assert meta["command"][-3:] == ["train.py", "--lr", "0.1 x"]
    assert meta["git_commit"] is None, "the working directory is no git checkout"
    scripts = sorted(p.name for p in (run.path / "scripts").iterdir())
    assert scripts == ["0-gpu-a.sh", "1-gpu-b.sh"]
    env = json.loads((run.path / "env.json").read_text())
    assert env["gpu-b"]["FOO"] == "bar" and env["gpu-a"]["MASTER_ADDR"] == "10.0.0.11"
    assert "gpu-a" in (run.path / "inventory.yaml").read_text()
    assert (run.path / "inventory.source").read_text() == (REPO / "inventory" / "example.yaml").read_text()


def test_dry_run_of_the_container_example(in_tmp: Path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_secret_value")
    code = run_cli(["up", "-i", str(REPO / "inventory" / "containers.yaml"), "--dry-run",
                    "--", "train.py"])
    assert code == 0
    out = capsys.readouterr().out
    assert out.count("docker \"${CLUSTER_RUN[@]}\" nvcr.io/nvidia/pytorch:24.05-py3") == 2
    run = RunDir.find(None, in_tmp / "runs", dry_runs=True)
    assert "CLUSTER_CONTAINER=cluster-" + run.run_id + "-gpu-a" in out
    assert "hf_secret_value" not in out
    assert all("hf_secret_value" not in p.read_text() for p in run.path.rglob("*") if p.is_file())


def test_run_records_the_git_commit_of_the_working_tree(in_tmp: Path, capsys) -> None:
    import subprocess
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (in_tmp / "train.py").write_text("print(1)\n")
    subprocess.run([*git, "add", "train.py"], check=True)
    subprocess.run([*git, "commit", "-qm", "x"], check=True)
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert run_cli(["up", "--hosts", "a", "--dry-run", "--", "train.py"]) == 0
    assert RunDir.find(None, in_tmp / "runs", dry_runs=True).meta()["git_commit"] == head
    (in_tmp / "train.py").write_text("print(2)\n")
    assert run_cli(["up", "--hosts", "a", "--dry-run", "--", "train.py"]) == 0
    assert RunDir.find(None, in_tmp / "runs", dry_runs=True).meta()["git_commit"] == head + "-dirty"


def test_dry_run_selects_hosts(in_tmp: Path, capsys) -> None:
    assert run_cli(["up", "-i", str(REPO / "inventory" / "hostfile"), "--dry-run",
                    "--exclude", "gpu01", "--nodes", "1", "--", "t.py"]) == 0
    out = capsys.readouterr().out
    assert "node 0: gpu02" in out and "gpu01" not in out.split("\n", 1)[0] and "worker-3" not in out


def test_local_dry_run_simulated_nodes(in_tmp: Path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert run_cli(["up", "--local", "--nodes", "2", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "--node_rank=0" in out and "--node_rank=1" in out
    assert out.count("--master_addr=127.0.0.1") == 2
    assert "train/train.py" in out


@pytest.mark.parametrize("where", [["--local"], ["-i", str(REPO / "inventory" / "example.yaml")]])
def test_options_after_the_dashes_go_to_the_reference_trainer(in_tmp: Path, capsys, where,
                                                                monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert run_cli(["up", *where, "--dry-run", "--", "--epochs", "3", "--out", "mine"]) == 0
    out = capsys.readouterr().out.replace(" \\\n  ", " ")     # one argument per line
    assert "train/train.py" in out and "--epochs 3 --out mine" in out
    meta = RunDir.find(None, in_tmp / "runs", dry_runs=True).meta()
    assert meta["script"].endswith("train/train.py")
    assert meta["args"][-4:] == ["--epochs", "3", "--out", "mine"]
    defaults = meta["args"][:-4]                           # ours first: the user's win
    # checkpoints outlive the run (not under runs/<id>), so every attempt and the next
    # `cluster up` resume from the newest
    ckpt = defaults[defaults.index("--checkpoint-dir") + 1]
    assert Path(ckpt).name == "checkpoints" and "runs" not in Path(ckpt).parts


def test_templates_override(in_tmp: Path, capsys) -> None:
    (in_tmp / "tpl").mkdir()
    (in_tmp / "tpl" / "node.sh.j2").write_text("#!/bin/bash\necho custom {{ rank }}\n")
    assert run_cli(["up", "--local", "--dry-run", "--templates", "tpl"]) == 0
    assert "echo custom 0" in capsys.readouterr().out


@pytest.mark.parametrize("args,words", [
    (["up", "--env", "1X=2", "--dry-run"], "Invalid value for --env"),
    (["up", "-i", "nope.yaml"], "cannot read inventory"),
    (["up", "--local", "--nodes", "0", "--dry-run"], "--nodes: must be at least 1"),
    (["up", "--backend", "ssh"], "needs -i/--inventory or --hosts"),
    (["up", "--templates", "missing-dir", "--dry-run"], "--templates"),
    (["status"], "no runs"),
    (["up", "--env", "CLUSTER_RUN_ID=x", "--dry-run"], "reserved"),
    (["up", "--env", "MASTER_ADDR=10.0.0.1", "--dry-run"], "set by cluster itself"),
    (["up", "--secret-env", "CLUSTER_NODE", "--dry-run"], "reserved"),
    (["up", "--secret-env", "A=B", "--dry-run"], "give the NAME"),
    (["up", "--secret-env", "T", "--env", "T=1", "--dry-run"], "also given with --env"),
    (["up", "--backend", "slurm", "--partition", "gpu\ntouch /tmp/x #", "--dry-run"],
     "Invalid value for --partition: control character '\\n'"),
    (["up", "--backend", "slurm", "--time", "1:00\r", "--dry-run"], "Invalid value for --time"),
    (["up", "--backend", "slurm", "--account", "a\x00", "--dry-run"], "Invalid value for --account"),
    (["up", "--dry-run", "--", "train\n.py"], "Invalid value for SCRIPT"),
    (["up", "--templates", "x\x00y", "--dry-run"], "control character"),
    (["up", "-i", "inv\x00.yaml", "--dry-run"], "control character"),
    (["up", "--hosts", "a", "--sync", "d\x00", "--dry-run"], "control character"),
    (["up", "--secret-env", "UNSET_SECRET_FOR_THIS_TEST"], "not set in this shell"),
    (["up", "--hosts", "a", "--python", "/venv/bin/python\ntouch /tmp/x", "--dry-run"],
     "Invalid value for '--python': control character '\\n' at position 16"),
    (["up", "--hosts", "a", "--user", "bob\x00", "--dry-run"], "Invalid value for '--user': control character"),
    (["up", "--hosts", "a", "--user", "", "--dry-run"], "Invalid value for '--user': must not be empty"),
    (["up", "--hosts", "a", "--port", "0", "--dry-run"], "Invalid value for '--port'"),
    (["up", "--hosts", "a", "--identity", "k\x1b", "--dry-run"], "Invalid value for '--identity'"),
    (["up", "--hosts", "a", "--python", "auto", "--dry-run"], "'auto' takes the python that 'setup'"),
    (["doctor", "--hosts", "a", "--python", "py\rthon"], "Invalid value for '--python': control character"),
    (["doctor", "--hosts", "a", "--user", "x\ny"], "Invalid value for '--user': control character"),
    (["exec", "--hosts", "a", "--user", "x\ny", "--", "true"], "Invalid value for '--user': control character"),
    (["clean", "--hosts", "a", "--python", "p\x00"], "Invalid value for '--python': control character"),
])
def test_bad_options_exit_2(in_tmp: Path, capsys, args: list[str], words: str) -> None:
    assert run_cli(args) == 2
    assert words in capsys.readouterr().err
    assert not (in_tmp / "runs").exists(), "bad input must not create a run"


@pytest.mark.parametrize("name,hint,unrelated", [
    ("MASTER_ADDR", "from the rendezvous: the address of the node torch numbers 0: the "
                    "inventory's first host", "port"),
    ("MASTER_PORT", "from the rendezvous (choose the rendezvous port with master_port / "
                    "--master-port)", "address"),
    ("CLUSTER_NODE", "names starting with CLUSTER_ are reserved", "port"),
])
def test_a_reserved_name_says_what_sets_it_and_what_to_do_instead(
        in_tmp: Path, capsys, name: str, hint: str, unrelated: str) -> None:
    assert run_cli(["up", "--env", f"{name}=1", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert f"--env: {name} is set by cluster itself" in err and hint in err, err
    assert unrelated not in err, f"a hint about something else: {err}"
    assert not (in_tmp / "slurm-logs").exists()


def test_secret_env_value_is_never_written_or_printed(in_tmp: Path, capsys, monkeypatch) -> None:
    secret = "s3cr3t-value-" + "x" * 20
    monkeypatch.setenv("HF_TOKEN", secret)
    inv = in_tmp / "inv.yaml"
    inv.write_text("defaults: {secret_env: [WANDB_API_KEY]}\nhosts: [gpu-a, gpu-b]\n")
    monkeypatch.setenv("WANDB_API_KEY", secret + "-2")
    assert run_cli(["up", "-i", str(inv), "--secret-env", "HF_TOKEN", "--dry-run", "--", "t.py"]) == 0
    captured = capsys.readouterr()
    assert secret not in captured.out + captured.err
    assert "never written" in captured.out and "HF_TOKEN" in captured.out
    run = RunDir.find(None, in_tmp / "runs", dry_runs=True)
    files = [p for p in run.path.rglob("*") if p.is_file()]
    assert files
    for f in files:
        assert secret.encode() not in f.read_bytes(), f
    assert run.meta()["secret_env"] == ["HF_TOKEN", "WANDB_API_KEY"]


def test_hosts_without_inventory_uses_hostlist(in_tmp: Path, capsys) -> None:
    assert run_cli(["up", "--hosts", "gpu[1-3]", "--dry-run", "--", "t.py"]) == 0
    out = capsys.readouterr().out
    assert all(f"gpu{i}" in out for i in (1, 2, 3))


def test_hosts_take_python_user_port_and_key_from_the_command_line(in_tmp: Path, capsys) -> None:
    assert run_cli(["up", "--hosts", "gpu[1-2]", "--python", "/opt/venv/bin/python", "--user", "bob",
                    "--port", "2222", "--identity", "/keys/id_ed25519", "--dry-run", "--", "t.py"]) == 0
    out = capsys.readouterr().out
    assert out.count("/opt/venv/bin/python") >= 2
    hosts = RunDir.find(None, in_tmp / "runs", dry_runs=True).inventory().hosts
    assert [(h.name, h.python, h.user, h.port, h.identity_file) for h in hosts] == [
        (f"gpu{i}", "/opt/venv/bin/python", "bob", 2222, "/keys/id_ed25519") for i in (1, 2)]


def test_command_line_host_settings_win_over_the_inventorys(in_tmp: Path, capsys) -> None:
    inv = in_tmp / "inv.yaml"
    inv.write_text("defaults: {python: /usr/bin/python3, user: alice}\n"
                   "hosts: [a, {name: b, python: /b/python, port: 2200}]\n")
    assert run_cli(["up", "-i", str(inv), "--python", "/opt/venv/bin/python", "--dry-run", "--", "t.py"]) == 0
    hosts = RunDir.find(None, in_tmp / "runs", dry_runs=True).inventory().hosts
    assert [(h.python, h.user, h.port) for h in hosts] == [
        ("/opt/venv/bin/python", "alice", None), ("/opt/venv/bin/python", "alice", 2200)]


def sbatch_options(out: str) -> list[str]:
    return [line.split(" ", 1)[1] for line in out.splitlines() if line.startswith("#SBATCH ")]


def test_slurm_honours_hosts_and_exclude(in_tmp: Path, capsys) -> None:
    assert run_cli(["up", "--backend", "slurm", "--hosts", "gpu[01-03]", "--dry-run", "--", "t.py"]) == 0
    opts = sbatch_options(capsys.readouterr().out)
    assert "--nodelist=gpu[01-03]" in opts and "--nodes=3" in opts
    assert run_cli(["up", "--backend", "slurm", "--exclude", "gpu[07,09]", "--nodes", "2",
                    "--dry-run", "--", "t.py"]) == 0
    opts = sbatch_options(capsys.readouterr().out)
    assert "--exclude=gpu[07,09]" in opts and "--nodes=2" in opts
    assert not any(o.startswith("--nodelist") for o in opts)


def test_slurm_inventory_hosts_become_the_nodelist(in_tmp: Path, capsys) -> None:
    inv = in_tmp / "inv.yaml"
    inv.write_text("backend: slurm\nhosts: ['gpu[01-04]']\nslurm: {partition: p}\n")
    assert run_cli(["up", "-i", str(inv), "--exclude", "gpu02", "--nodes", "2", "--dry-run",
                    "--", "t.py"]) == 0
    opts = sbatch_options(capsys.readouterr().out)
    assert "--nodelist=gpu[01,03]" in opts and "--nodes=2" in opts and "--partition=p" in opts


def test_dry_run_after_the_script_is_refused_not_a_real_launch(in_tmp: Path, capsys) -> None:
    """`cluster up -i inv.yaml train.py --dry-run`, the -- forgotten: --dry-run would go to the
    script and the job would start for real."""
    assert run_cli(["up", "--local", "t.py", "--epochs", "1", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cluster: error: --dry-run after the script goes to the script (t.py)")
    assert "put cluster's options before the script, or use -- " in err
    assert not (in_tmp / "runs").exists(), "nothing may start"


def test_cluster_options_after_the_script_are_warned_about_and_passed_on(in_tmp: Path, capsys) -> None:
    assert run_cli(["up", "--local", "--dry-run", "t.py", "--detach", "--epochs", "2",
                    "--nodes=2", "-i", "x.yaml"]) == 0
    err = capsys.readouterr().err
    assert ("cluster: warning: --detach --nodes=2 -i after the script go to the script (t.py), "
            "not to cluster") in err
    assert RunDir.find(None, in_tmp / "runs", dry_runs=True).meta()["args"] == [
        "--detach", "--epochs", "2", "--nodes=2", "-i", "x.yaml"]


@pytest.mark.parametrize("args", [
    ["--", "t.py", "--dry-run", "--detach", "-i", "x"],     # -- before the script: all its own
    ["t.py", "--", "--dry-run", "--detach"],                # -- before those words
    ["t.py", "--epochs", "2", "--lr=0.1", "--nproc", "4"],  # nothing of cluster's
    ["--", "--nodes", "3"],                                 # the default script's options
])
def test_script_arguments_after_an_explicit_dashdash_are_the_scripts(in_tmp: Path, capsys,
                                                                     args: list[str]) -> None:
    assert run_cli(["up", "--local", "--dry-run", *args]) == 0
    err = capsys.readouterr().err
    assert "warning" not in err and "error" not in err, err


@pytest.mark.parametrize("options,words", [
    ({"python": "/venv/bin/python\nrm -rf ~"}, "Invalid value for --python: control character '\\n'"),
    ({"user": "bob\x00"}, "Invalid value for --user: control character"),
    ({"user": ""}, "Invalid value for --user: must not be empty"),
    ({"port": 70000}, "Invalid value for --port: 70000 is not a port number"),
])
def test_the_api_checks_host_settings_as_the_command_line_does(in_tmp: Path, options, words) -> None:
    from cluster import api
    from cluster.errors import InputError
    with pytest.raises(InputError, match=re.escape(words)):
        api.prepare(api.Request(hosts="a,b", dry_run=True, command=("t.py",), **options))
    assert not (in_tmp / "runs").exists()
