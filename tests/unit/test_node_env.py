"""Environments on the nodes: setup lines, python: auto, values forwarded from this shell,
--env-file, torchrun_args and slurm.extra. Parsing and rejection (file:line:key), and the
rendered script run by real bash; tests/integration/test_everyday.py runs them on the
namespaced nodes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cluster import inventory, spec
from cluster.cli import run_cli
from cluster.errors import InputError, InventoryError
from cluster.plan import Job, Templates, python_command, render
from cluster.runs import RunDir


def parse(text: str) -> spec.Inventory:
    return inventory.parse_yaml(text, "inv.yaml")


def error(text: str) -> str:
    with pytest.raises(InventoryError) as info:
        parse(text)
    return str(info.value)


# --- setup ---------------------------------------------------------------------------------


def test_setup_lines_are_kept_as_written_and_a_host_replaces_the_defaults() -> None:
    inv = parse("defaults:\n  setup: ['module load cuda/12.4', 'source ~/v/bin/activate']\n"
                "hosts:\n  - a\n  - {name: b, setup: ['conda activate x']}\n")
    a, b = inv.hosts
    assert a.setup == ("module load cuda/12.4", "source ~/v/bin/activate")
    assert b.setup == ("conda activate x",)


def test_a_setup_line_that_is_not_shell_names_its_own_line() -> None:
    text = ("defaults:\n  setup:\n    - module load cuda\n    - 'if true; then'\n"
            "    - echo ok\nhosts: [a]\n")
    assert error(text).startswith("inv.yaml:4: setup: not valid shell")


def test_python_auto_needs_setup_lines() -> None:
    assert "'auto' takes the python that 'setup' leaves on PATH" in error(
        "defaults: {python: auto}\nhosts: [a]\n")
    assert parse("defaults: {python: auto, setup: ['true']}\nhosts: [a]\n").hosts[0].python == "auto"


def run_script(tmp_path: Path, host: spec.Host) -> subprocess.CompletedProcess:
    plan = render(spec.Inventory(hosts=(host,)), Job(run_id="r", script="t.py"), Templates())
    script = tmp_path / "launch.sh"
    script.write_text(plan.nodes[0].script)
    return subprocess.run(["bash", str(script)], capture_output=True, text=True, cwd=tmp_path,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}, timeout=30)


def fake_venv(tmp_path: Path) -> Path:
    """A directory with an activate script and a python3 that reports how it was run."""
    bindir = tmp_path / "venv" / "bin"
    bindir.mkdir(parents=True)
    (bindir / "python3").write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                                    "print(json.dumps({'exe': sys.argv[0], 'argv': sys.argv[1:], "
                                    "'ran': os.environ.get('SETUP_RAN'), 'u': os.environ.get('UNSET_OK')}))\n")
    (bindir / "python3").chmod(0o755)
    # like a real activate script: reads a variable that may be unset (set -u would stop it)
    (bindir / "activate").write_text(f'UNSET_OK="${{NEVER_SET}}x"\nexport UNSET_OK\n'
                                     f'export PATH="{bindir}:$PATH"\nexport SETUP_RAN=yes\n')
    return bindir


def test_setup_runs_in_the_script_shell_and_auto_takes_the_python_it_leaves(tmp_path: Path) -> None:
    venv = fake_venv(tmp_path)
    host = spec.Host(name="n", address="127.0.0.1", workdir=str(tmp_path), python="auto",
                          setup=(f"source {venv}/activate",), nproc_per_node=1,
                          torchrun_args=("--monitor-interval=1",))
    res = run_script(tmp_path, host)
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout.splitlines()[-1])
    assert got["exe"] == str(venv / "python3") and got["ran"] == "yes" and got["u"] == "x"
    assert got["argv"][0] == "-c" and 'run_module("torch.distributed.run"' in got["argv"][1]
    assert got["argv"][-2:] == ["--monitor-interval=1", "t.py"]


def test_a_failing_setup_line_stops_the_node_with_its_number_and_text(tmp_path: Path) -> None:
    host = spec.Host(name="n", address="127.0.0.1", workdir=str(tmp_path), python="auto",
                          setup=("true", "module load no-such-module"), nproc_per_node=1)
    res = run_script(tmp_path, host)
    assert res.returncode == 2
    assert "cluster: setup line 2 failed (exit 127): module load no-such-module" in res.stderr


def test_cluster_programs_run_after_the_setup_too(tmp_path: Path) -> None:
    """The probe, the staged process and the supervisor use the same python as the job."""
    venv = fake_venv(tmp_path)
    command = python_command("auto", (f"source {venv}/activate",)) + " -c pass 'a b'"
    res = subprocess.run(["sh", "-c", command], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin"}, timeout=30)
    got = json.loads(res.stdout)
    assert got["exe"] == str(venv / "python3") and got["argv"] == ["-c", "pass", "a b"]
    assert python_command("/opt/py 3/bin/python") == "'/opt/py 3/bin/python'"   # no setup: no bash


def test_setup_output_goes_to_stderr_for_cluster_programs(tmp_path: Path) -> None:
    """The probe answers on stdout: a setup line's chatter must not land there."""
    command = python_command(sys.executable, ("echo chatter",)) + " -c 'print(42)'"
    res = subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=30)
    assert res.stdout == "42\n" and "chatter" in res.stderr


# --- torchrun_args and slurm.extra ---------------------------------------------------------


@pytest.mark.parametrize("arg", ["--nnodes=2", "--node-rank=1", "--rdzv_endpoint", "--master-port=1",
                                 "--standalone"])
def test_torchrun_options_cluster_owns_are_refused(arg: str) -> None:
    text = f"defaults:\n  torchrun_args:\n    - --monitor-interval=1\n    - '{arg}'\nhosts: [a]\n"
    message = error(text)
    assert message.startswith("inv.yaml:4: torchrun_args:") and "set by cluster itself" in message


def test_slurm_extra_flags_values_and_refusals() -> None:
    inv = parse("slurm:\n  extra: {qos: high, mem: 0, exclusive: true, requeue_me: false}\nhosts: [a]\n"
                .replace("requeue_me", "overcommit"))
    assert inv.slurm.extra == (("exclusive", None), ("mem", "0"), ("qos", "high"))
    assert "--nodes is set with slurm.nodes" in error("slurm:\n  extra: {nodes: 2}\nhosts: [a]\n")
    assert "--output is written by cluster itself" in error("slurm:\n  extra: {output: x}\nhosts: [a]\n")
    assert "set twice" in error("slurm:\n  time: '1:00'\n  extra: {time: '2:00'}\nhosts: [a]\n")
    assert "not an sbatch option name" in error("slurm:\n  extra: {'--qos': x}\nhosts: [a]\n")
    assert error("slurm:\n  extra:\n    qos: [a]\nhosts: [a]\n").startswith("inv.yaml:3: qos:")


def test_slurm_extra_nodelist_twice_is_refused_at_render() -> None:
    import dataclasses
    from cluster.sbatch import render_sbatch
    inv = parse("backend: slurm\nslurm:\n  extra: {nodelist: 'n[1-2]'}\nhosts: [n1, n2]\n")
    chosen = dataclasses.replace(inv.slurm, nodelist="n[1-2]", nodes=2)   # as --hosts sets it
    with pytest.raises(InputError, match="slurm.extra.nodelist: --nodelist is also set by --hosts"):
        render_sbatch(inv, Job(run_id="r", script="t.py"), Templates(), chosen, cwd="/w")


# --- forwarding and --env-file -------------------------------------------------------------


def test_forwarding_copies_names_and_globs_and_never_secrets() -> None:
    inv = parse("defaults:\n  env: {A: inventory, WANDB_MODE: offline}\n"
                "  env_forward: [A, 'WANDB_*']\n  secret_env: [WANDB_API_KEY]\n"
                "hosts:\n  - a\n  - {name: b, env_forward: [ONLY_B]}\n")
    environ = {"A": "shell", "WANDB_PROJECT": "p", "WANDB_API_KEY": "s3cret", "ONLY_B": "b",
               "WANDB_BAD-NAME": "x", "OTHER": "o"}
    a, b = inventory.forward_env(inv, environ).hosts
    assert dict(a.env) == {"A": "shell", "WANDB_MODE": "offline", "WANDB_PROJECT": "p"}
    assert dict(b.env)["ONLY_B"] == "b" and dict(b.env)["WANDB_PROJECT"] == "p"
    assert "WANDB_API_KEY" not in dict(a.env)              # a secret goes over the connection


def test_a_forwarded_name_missing_from_this_shell_is_an_error() -> None:
    inv = parse("defaults:\n  env_forward: [HF_TOKEN_X, 'NOTHING_*']\nhosts: [a]\n")
    with pytest.raises(InputError, match="env_forward: HF_TOKEN_X is not set in this shell"):
        inventory.forward_env(inv, {})
    assert inventory.forward_env(inv, {"HF_TOKEN_X": "1"}).hosts[0].env == (("HF_TOKEN_X", "1"),)


def test_a_dry_run_leaves_an_unset_forwarded_name_out_and_names_it() -> None:
    inv = parse("defaults:\n  env_forward: [HF_TOKEN_X, B, 'NOTHING_*']\nhosts: [a]\n")
    assert inventory.forward_env(inv, {"B": "b"}, dry_run=True).hosts[0].env == (("B", "b"),)
    assert inventory.unset_forwarded(inv, {"B": "b"}) == ["HF_TOKEN_X"]


@pytest.mark.parametrize("name,why", [("CLUSTER_X", "reserved"), ("1BAD", "not an environment"),
                                      ("MASTER_ADDR", "set by cluster")])
def test_forward_names_are_checked_at_load(name: str, why: str) -> None:
    assert why in error(f"defaults:\n  env_forward:\n    - '{name}'\nhosts: [a]\n")


def test_env_file_reads_dotenv_without_expanding(tmp_path: Path) -> None:
    f = tmp_path / ".env"
    f.write_text("# comment\n\nexport A=1\nB = two words # note\nC='$HOME \"x\"'\n"
                 'D="next \\"q\\" \\\\ $HOME"\nE=\n')
    assert inventory.load_env_file(f) == {"A": "1", "B": "two words", "C": '$HOME "x"',
                                          "D": 'next "q" \\ $HOME', "E": ""}


@pytest.mark.parametrize("line,problem", [("not a pair", "expected KEY=VALUE"),
                                          ("X='open", "unterminated"),
                                          ("CLUSTER_RUN_ID=1", "set by cluster itself"),
                                          ('X="a\\nb"', "control character '\\n'")])
def test_env_file_errors_name_file_and_line(tmp_path: Path, line: str, problem: str) -> None:
    f = tmp_path / "bad.env"
    f.write_text(f"OK=1\n{line}\n")
    with pytest.raises(InventoryError) as info:
        inventory.load_env_file(f)
    assert str(info.value).startswith(f"{f}:2") and problem in str(info.value)


@pytest.fixture
def in_tmp(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CLUSTER_RUNS_DIR", raising=False)
    return tmp_path


def test_cli_env_name_env_file_and_forwarding_in_order(in_tmp: Path, monkeypatch) -> None:
    (in_tmp / "inv.yaml").write_text("defaults:\n  env: {A: inv, B: inv, C: inv}\n"
                                     "  env_forward: [B]\nhosts: [{name: n, address: 10.0.0.1}]\n")
    (in_tmp / "x.env").write_text("C=file\nD=file\n")
    monkeypatch.setenv("B", "shell")
    monkeypatch.setenv("FROM_SHELL", "it's here")
    assert run_cli(["up", "-i", "inv.yaml", "--dry-run", "--env-file", "x.env",
                    "--env", "D=flag", "--env", "FROM_SHELL", "--", "t.py"]) == 0
    env = json.loads((RunDir.find(None, in_tmp / "runs", dry_runs=True).path / "env.json").read_text())["n"]
    assert (env["A"], env["B"], env["C"], env["D"]) == ("inv", "shell", "file", "flag")
    assert env["FROM_SHELL"] == "it's here"


def test_cli_env_name_not_set_is_an_error_and_nothing_is_created(in_tmp: Path, capsys) -> None:
    os.environ.pop("SURELY_NOT_SET_X", None)
    assert run_cli(["up", "--hosts", "a", "--dry-run", "--env", "SURELY_NOT_SET_X", "--", "t.py"]) == 2
    assert "SURELY_NOT_SET_X is not set in this shell" in capsys.readouterr().err
    assert not (in_tmp / "runs").exists()
