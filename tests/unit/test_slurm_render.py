"""The rendered sbatch script: golden files, `bash -n`, shellcheck, and a run of the script
itself under fake `srun`/`scontrol` that proves per-node values expand inside the step.

Regenerate the golden files after an intended change:
    CLUSTER_REGEN_GOLDEN=1 pytest tests/unit/test_slurm_render.py
"""
from __future__ import annotations

import dataclasses
import json
import os
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from cluster.errors import InputError
from cluster.spec import Container, Host, Inventory, Mount, Network, SlurmSettings
from cluster.plan import Job, Templates
from cluster.sbatch import pyxis_image, render_sbatch, signal_parts

from .golden import check_golden

GOLDEN = Path(__file__).parent / "golden" / "sbatch"
RUN_ID = "20250101-120000-abcd"
NASTY = (("QUOTES", "it's \"quoted\""), ("DOLLAR", "$HOME and $(rm -rf /) and `id`"),
         ("SPACES", "  a  b  "), ("NEWLINE", "line1\nline2"), ("PARENS", "64(x2)"),
         ("HEREDOC_END", "x\nCLUSTER_STEP_END\ny"), ("EMPTYISH", "''"))


def inv(**host: object) -> Inventory:
    base: dict[str, object] = {"name": "slurm", "address": "slurm", "python": "/opt/venv/bin/python"}
    base.update(host)
    return Inventory(hosts=(Host(**base),), backend="slurm")  # type: ignore[arg-type]


def job(*args: str, script: str = "train.py") -> Job:
    return Job(run_id=RUN_ID, script=script, args=args)


CASES: dict[str, tuple[Inventory, SlurmSettings, Job]] = {
    "one_node": (inv(), SlurmSettings(), job("--out", f"runs/{RUN_ID}/train")),
    "two_nodes_8_gpus": (inv(), SlurmSettings(nodes=2, gpus_per_node=8, cpus_per_task=32,
                                              partition="gpu", account="proj-1", time="04:00:00",
                                              constraint="h100&ib"),
                         job("--epochs", "3")),
    "gres_style": (inv(network=Network(ifname="ib0", ib="on")),
                   SlurmSettings(nodes=4, gpus_per_node=4, gpu_style="gres", partition="old"),
                   job()),
    "requeue_custom_signal": (inv(nproc_per_node=2),
                              SlurmSettings(nodes=2, signal="B:TERM@300", max_requeues=5,
                                            job_name="my long run", output_dir="/scratch/logs"),
                              job("--resume")),
    "no_requeue": (inv(), SlurmSettings(nodes=2, max_requeues=0, signal="USR2"), job()),
    "failure_restarts": (dataclasses.replace(inv(), restarts=2),
                         SlurmSettings(nodes=2, max_requeues=1, exclude="node9",
                                       output_dir="/scratch/it's logs"), job()),
    "container_pyxis": (inv(container=Container(
        image="nvcr.io/nvidia/pytorch:24.05-py3", runtime="docker", python="python",
        mounts=(Mount("/datasets", "/datasets", "ro"), Mount("~/ckpt dir", "/ckpt", "rw,rslave")),
        options=("--ulimit", "stack=67108864")), secret_env=("HF_TOKEN",)),
        SlurmSettings(nodes=2, gpus_per_node=8), job("--epochs", "3")),
    "container_docker_hub": (inv(container=Container(image="pytorch/pytorch:2.3.0-cuda12.1")),
                             SlurmSettings(nodes=2), job()),
    "nasty_env": (inv(env=NASTY, network=Network(ifname="^docker0,lo", ib="off")),
                  SlurmSettings(nodes=2, partition="a b"),
                  job("--name", "a b $(x)", "it's", script="/path with space/train.py")),
    "setup_and_extra": (inv(python="auto", setup=("module load cuda/12.4", "conda activate 'my env'"),
                            torchrun_args=("--monitor-interval=1", "--log-dir", "a b/$(x)")),
                        SlurmSettings(nodes=2, extra=(("exclusive", None), ("mem", "0"),
                                                      ("qos", "high prio"), ("reservation", "r1"))),
                        job()),
}


def render_case(name: str, cwd: str = "/home/u/project") -> str:
    inventory, settings, j = CASES[name]
    return render_sbatch(inventory, j, Templates(), settings, cwd=cwd).script


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden(name: str) -> None:
    check_golden(GOLDEN / f"{name}.sh", render_case(name), "tests/unit/test_slurm_render.py")


@pytest.mark.parametrize("name", sorted(CASES))
def test_bash_syntax(name: str, tmp_path: Path) -> None:
    f = tmp_path / "job.sh"
    f.write_text(render_case(name))
    out = subprocess.run(["bash", "-n", str(f)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


@pytest.mark.skipif(not shutil.which("shellcheck"), reason="shellcheck not installed")
@pytest.mark.parametrize("name", sorted(CASES))
def test_shellcheck(name: str, tmp_path: Path) -> None:
    f = tmp_path / "job.sh"
    f.write_text(render_case(name))
    out = subprocess.run(["shellcheck", str(f)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout


def sbatch_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("#SBATCH ")]


@pytest.mark.parametrize("name", sorted(CASES))
def test_sbatch_lines_sorted_quoted_and_first(name: str) -> None:
    text = render_case(name)
    lines = sbatch_lines(text)
    assert lines == sorted(lines)
    for line in lines:
        words = shlex.split(line[len("#SBATCH "):])
        assert len(words) == 1, line          # every value is one shell word
    body = text.splitlines()
    first_command = next(i for i, line in enumerate(body) if line and not line.startswith("#"))
    assert all(body.index(line) < first_command for line in lines)


def test_consensus_options() -> None:
    text = render_case("two_nodes_8_gpus")
    for opt in ("--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=8", "--cpus-per-task=32",
                "--partition=gpu", "--account=proj-1", "--time=04:00:00", "--requeue",
                "--open-mode=append", "--signal=B:USR2@90", "--chdir=/home/u/project",
                "--output=/home/u/project/slurm-logs/20250101-120000-abcd.out",
                '--constraint="h100&ib"'):
        assert f"#SBATCH {opt}\n" in text, opt
    assert 'export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"' in text
    assert 'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)' in text
    assert "srun --kill-on-bad-exit=1 --wait=60" in text
    step = step_text(text)
    # static ranks: srun's node N is torch's node N (c10d would sort addresses as strings)
    for part in ('--nnodes="$SLURM_NNODES"', "--nproc_per_node=8", '--node_rank="$SLURM_NODEID"',
                 '--master_addr="$MASTER_ADDR"', '--master_port="$MASTER_PORT"',
                 '-c "$CLUSTER_TORCHRUN"', 'runpy.run_module("torch.distributed.run"'):
        assert part in step
    assert "--rdzv_backend" not in step and "--rdzv_endpoint" not in step


def test_gres_style_and_fixed_interface() -> None:
    text = render_case("gres_style")
    assert "#SBATCH --gres=gpu:4" in text and "--gpus-per-node" not in text
    assert "export NCCL_SOCKET_IFNAME=ib0" in text and "export GLOO_SOCKET_IFNAME=ib0" in text
    assert "export NCCL_IB_DISABLE=0" in text
    assert "ip -o -4 addr show" not in step_text(text)      # no detection when given


def test_no_gpus_no_cpus_options_when_unset() -> None:
    text = render_case("one_node")
    assert "--gpus-per-node" not in text and "--gres" not in text
    assert "SRUN_CPUS_PER_TASK" not in text and "--cpus-per-task" not in text
    assert '--nproc_per_node="$NPROC"' in step_text(text)


def test_signal_is_for_the_batch_shell_and_never_usr1() -> None:
    assert signal_parts("USR2@90") == ("USR2", "B:USR2@90")
    assert signal_parts("B:TERM@300") == ("TERM", "B:TERM@300")
    for bad in ("USR1@90", "B:SIGUSR1", "10@30"):
        with pytest.raises(InputError):
            signal_parts(bad)
    text = render_case("requeue_custom_signal")
    assert "#SBATCH --signal=B:TERM@300" in text and "trap cluster_on_signal TERM" in text
    assert '#SBATCH --job-name="my long run"' in text
    assert '"${SLURM_RESTART_COUNT:-0}" -lt 5' in text
    assert "#SBATCH --no-requeue" in render_case("no_requeue")


def test_pyxis_options_in_the_step() -> None:
    text = render_case("container_pyxis")
    srun = text[text.index("\nsrun "):text.index("CLUSTER_SRUN=$!")]
    assert "--container-image='nvcr.io#nvidia/pytorch:24.05-py3'" in srun
    assert '--container-mounts="$CLUSTER_MOUNTS"' in srun and "--no-container-mount-home" in srun
    assert "--container-workdir=/home/u/project" in srun
    assert srun.index("--container-image") < srun.index("bash -c"), "srun's options come first"
    assert ("CLUSTER_MOUNTS=/home/u/project:/home/u/project,/datasets:/datasets:ro,"
            "\"$HOME\"/'ckpt dir':/ckpt:rw+rslave\n") in text
    assert "  python \\\n" in srun, "the image's python, not the node's"
    assert "--ulimit" not in srun and "docker/podman options: not for pyxis" in text
    assert "--container" not in render_case("one_node")


def test_mounts_expand_to_what_pyxis_reads(tmp_path: Path) -> None:
    """The CLUSTER_MOUNTS line, run by bash: one value, '~' as the home, flags joined by '+'."""
    text = render_case("container_pyxis")
    line = next(l for l in text.splitlines() if l.startswith("CLUSTER_MOUNTS="))
    out = subprocess.run(["bash", "-c", line + '\nprintf %s "$CLUSTER_MOUNTS"'], capture_output=True,
                         text=True, env={"HOME": "/home/u", "PATH": os.environ["PATH"]})
    assert out.stdout == ("/home/u/project:/home/u/project,/datasets:/datasets:ro,"
                          "/home/u/ckpt dir:/ckpt:rw+rslave")


@pytest.mark.parametrize("image,want", [
    ("nvcr.io/nvidia/pytorch:24.05-py3", "nvcr.io#nvidia/pytorch:24.05-py3"),
    ("registry.local:5000/team/train:1", "registry.local:5000#team/train:1"),
    ("localhost/train:1", "localhost#train:1"),
    ("pytorch/pytorch:2.3.0", "pytorch/pytorch:2.3.0"),       # Docker Hub user/repo
    ("ubuntu:22.04", "ubuntu:22.04"),
    ("nvcr.io#nvidia/pytorch:24.05-py3", "nvcr.io#nvidia/pytorch:24.05-py3"),
    ("/shared/images/train.sqsh", "/shared/images/train.sqsh"),
])
def test_pyxis_image_names(image: str, want: str) -> None:
    assert pyxis_image(image) == want


def test_a_working_directory_pyxis_cannot_mount_is_refused() -> None:
    inventory, settings, j = CASES["container_pyxis"]
    with pytest.raises(InputError, match="cannot be mounted"):
        render_sbatch(inventory, j, Templates(), settings, cwd="/home/u/a,b")


def step_text(script: str) -> str:
    start = script.index("<<'CLUSTER_STEP_END'")
    start = script.index("\n", start) + 1
    return script[start:script.index("\nCLUSTER_STEP_END\n", start)]


PER_NODE = ("$SLURM_NODEID", "$SLURM_PROCID", "$(hostname)", "$NODE_ADDR", "$IFNAME",
            "SLURM_LOCALID")


@pytest.mark.parametrize("name", sorted(CASES))
def test_per_node_values_only_inside_the_quoted_step(name: str) -> None:
    text = render_case(name)
    step = step_text(text)
    assert "$SLURM_NODEID" in step and "$(hostname)" in step
    assert "<<'CLUSTER_STEP_END'" in text               # quoted heredoc: no expansion here
    outside = "\n".join(line for line in text.replace(step, "").splitlines()
                        if not line.lstrip().startswith("#"))          # code, not comments
    for var in PER_NODE:
        assert var not in outside, f"{var} would expand in the batch shell (same on every node)"
    # the step holds no user data but the setup lines, as written: script, args and env reach
    # it as argv and environment
    inventory, _, _ = CASES[name]
    for _, value in inventory.hosts[0].env:
        assert value not in step


# --- the script, run under fake SLURM programs --------------------------------------------

FAKE_SRUN = r"""#!/bin/bash
# fake srun: run the command once per "node" with that node's SLURM_NODEID, like srun would.
echo "$@" > "$FAKE_DIR/srun.args"
echo $$ > "$FAKE_DIR/srun.pid"
while [ "$1" != bash ]; do shift; done
pids=()
for i in $(seq 0 $((SLURM_NNODES - 1))); do
  SLURM_NODEID=$i SLURM_PROCID=$i SLURM_LOCALID=0 "$@" > "$FAKE_DIR/node$i.out" 2>&1 &
  pids+=($!)
done
trap 'echo TERM > "$FAKE_DIR/srun.signal"; kill "${pids[@]}" 2>/dev/null; exit 143' TERM
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
exit $rc
"""
FAKE_SQUEUE = r"""#!/bin/bash
printf '42.0\n42.batch\n'
"""
FAKE_SCANCEL = r"""#!/bin/bash
# fake scancel --signal=TERM 42.0: the step's tasks get it (here: through the fake srun)
echo "$@" >> "$FAKE_DIR/scancel.args"
kill -TERM "$(cat "$FAKE_DIR/srun.pid")"
"""
FAKE_SCONTROL = r"""#!/bin/bash
case "$1 $2" in
  "show hostnames") printf 'nodeA\nnodeB\n' ;;
  requeue*) # like SLURM: record the requeue, then stop the job's step (SIGTERM to its tasks)
            echo "$@" >> "$FAKE_DIR/scontrol.requeue"
            kill -TERM "$(cat "$FAKE_DIR/srun.pid")" ;;
esac
"""
FAKE_PYTHON = r"""#!/usr/bin/env python3
import json, os, sys
keys = ["SLURM_NODEID", "CLUSTER_NODE_RANK", "CLUSTER_NODE", "MASTER_ADDR", "MASTER_PORT",
        "CLUSTER_RUN_ID", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"]
out = {"argv": sys.argv[1:], "env": {k: os.environ.get(k) for k in keys},
       "user": {k: os.environ.get(k) for k in os.environ if k in %s}}
print(json.dumps(out))
if os.environ.get("FAKE_SLEEP"):
    import time; time.sleep(float(os.environ["FAKE_SLEEP"]))
sys.exit(int(os.environ.get("FAKE_EXIT") or 0))
"""


def fake_slurm(tmp_path: Path, name: str, **host_changes: object) -> tuple[Path, dict[str, str]]:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    keys = [k for k, _ in NASTY] + ["TOKEN", "OTHER"]
    for prog, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL),
                       ("squeue", FAKE_SQUEUE), ("scancel", FAKE_SCANCEL),
                       ("python", FAKE_PYTHON % keys)):
        (bindir / prog).write_text(text)
        (bindir / prog).chmod(0o755)
    inventory, settings, j = CASES[name]
    host = inventory.master.replace(**{"python": str(bindir / "python"), **host_changes})
    inventory = Inventory(hosts=(host,), backend="slurm")
    settings = SlurmSettings(**{**settings.__dict__, "nodes": 2})
    script = tmp_path / "job.sh"
    script.write_text(render_sbatch(inventory, j, Templates(), settings, cwd=str(tmp_path)).script)
    env = {"PATH": f"{bindir}:{os.environ['PATH']}", "FAKE_DIR": str(tmp_path),
           "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "nodeA,nodeB", "SLURM_JOB_ID": "42",
           "SLURM_CPUS_PER_TASK": "32", "HOME": str(tmp_path)}
    return script, env


@pytest.mark.parametrize("name", ["nasty_env", "two_nodes_8_gpus", "one_node"])
def test_script_runs_one_step_per_node_with_its_own_node_id(name: str, tmp_path: Path) -> None:
    script, env = fake_slurm(tmp_path, name)
    out = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    reports = [json.loads((tmp_path / f"node{i}.out").read_text().splitlines()[-1]) for i in (0, 1)]
    assert [r["env"]["SLURM_NODEID"] for r in reports] == ["0", "1"]
    assert [r["env"]["CLUSTER_NODE_RANK"] for r in reports] == ["0", "1"]
    for r in reports:
        assert r["env"]["MASTER_ADDR"] == "nodeA"
        assert r["env"]["CLUSTER_RUN_ID"] == RUN_ID
        assert r["argv"][0] == "-c" and r["argv"][2] == "--nnodes=2"      # torchrun, by runpy
        assert 'runpy.run_module("torch.distributed.run", run_name="__main__"' in r["argv"][1]
        assert "--master_addr=nodeA" in r["argv"] and "--master_port=" + r["env"]["MASTER_PORT"] in r["argv"]
        assert f"--node_rank={r['env']['SLURM_NODEID']}" in r["argv"]
        _, _, j = CASES[name]
        assert r["argv"][-len(j.args) - 1:] == [j.script, *j.args]   # argv arrives intact
    if name == "nasty_env":
        for r in reports:
            assert r["user"] == dict(NASTY)                          # every value intact
            assert r["env"]["NCCL_SOCKET_IFNAME"] == "^docker0,lo"
            assert r["env"]["GLOO_SOCKET_IFNAME"] != "^docker0,lo"    # a list is NCCL-only


VENV_PYTHON = """#!/bin/sh
echo "venv python3, SETUP_RAN=$SETUP_RAN, args: $*"
"""


def test_setup_runs_in_the_step_on_every_node_and_auto_takes_its_python(tmp_path: Path) -> None:
    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "python3").write_text(VENV_PYTHON)
    (venv / "python3").chmod(0o755)
    (venv / "activate").write_text(f'export PATH="{venv}:$PATH"\nexport SETUP_RAN="on $SLURM_NODEID"\n')
    script, env = fake_slurm(tmp_path, "setup_and_extra", python="auto",
                             setup=(f"source {venv}/activate",))
    out = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    for i in (0, 1):
        said = (tmp_path / f"node{i}.out").read_text()
        assert f"SETUP_RAN=on {i}, args: -c import gc, runpy" in said          # per node, in the step
        assert "--monitor-interval=1 --log-dir a b/$(x) train.py" in said          # each arg as one


def test_a_failing_setup_line_stops_the_node_and_says_which(tmp_path: Path) -> None:
    script, env = fake_slurm(tmp_path, "setup_and_extra", setup=("true", "false # on purpose"))
    out = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 2
    said = (tmp_path / "node0.out").read_text()
    assert "cluster: setup line 2 failed (exit 1): false # on purpose" in said
    assert "torch.distributed.run" not in said                                 # nothing started


@pytest.mark.parametrize("restarts,requeued", [("0", True), ("5", False)])
def test_signal_requeues_under_the_cap_else_stops_the_step(restarts: str, requeued: bool,
                                                          tmp_path: Path) -> None:
    script, env = fake_slurm(tmp_path, "requeue_custom_signal")       # TERM, max_requeues 5
    env.update(FAKE_SLEEP="30", SLURM_RESTART_COUNT=restarts)
    proc = subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 20
    while not all((tmp_path / f"node{i}.out").exists() and (tmp_path / f"node{i}.out").read_text()
                  for i in (0, 1)):
        assert time.monotonic() < deadline, "the step did not start"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=20)
    assert (tmp_path / "srun.signal").read_text().strip() == "TERM"   # the step's tasks got it
    assert proc.returncode != 0
    if requeued:   # SLURM stops the step as part of the requeue
        assert (tmp_path / "scontrol.requeue").read_text().split() == ["requeue", "42"]
        assert not (tmp_path / "scancel.args").exists()
        assert "requeueing job 42 (restart 1 of 5)" in err
    else:          # the last restart: the script stops the step itself, gracefully
        assert not (tmp_path / "scontrol.requeue").exists()
        assert (tmp_path / "scancel.args").read_text().split() == ["--signal=TERM", "42.0"]
        assert "not requeueing (restarted 5 of 5 time(s))" in err


# --- the secret environment, from the launcher's private file ---------------------------------

SECRET = "tok $(touch x) 'q' \"d\" `id`\nline2 \\ end"


def with_secrets(tmp_path: Path) -> tuple[Path, dict[str, str], Path]:
    """The script of a run with two secret names, and the file the launcher left for it."""
    script, env = fake_slurm(tmp_path, "one_node", secret_env=("TOKEN", "OTHER"))
    secrets = tmp_path / "slurm-logs" / f".{RUN_ID}.secrets" / "env"
    secrets.parent.mkdir(parents=True, mode=0o700)
    secrets.write_bytes(f"TOKEN={SECRET}\0OTHER=a=b\0".encode())
    return script, env, secrets


def test_secrets_reach_every_node_from_the_file_which_goes_after_success(tmp_path: Path) -> None:
    script, env, secrets = with_secrets(tmp_path)
    assert SECRET not in script.read_text() and str(secrets) in script.read_text()
    out = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    for i in (0, 1):
        report = json.loads((tmp_path / f"node{i}.out").read_text().splitlines()[-1])
        assert report["user"] == {"TOKEN": SECRET, "OTHER": "a=b"}      # as written, not as shell
    assert not secrets.parent.exists()
    assert not (tmp_path / "x").exists()


def test_a_failed_step_keeps_the_secrets_for_a_requeued_attempt(tmp_path: Path) -> None:
    script, env, secrets = with_secrets(tmp_path)
    out = subprocess.run(["bash", str(script)], env={**env, "FAKE_EXIT": "3"},
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 3
    assert secrets.read_bytes().startswith(b"TOKEN=")


def test_a_missing_secrets_file_stops_the_job_before_the_step(tmp_path: Path) -> None:
    script, env, secrets = with_secrets(tmp_path)
    secrets.unlink()
    out = subprocess.run(["bash", str(script)], env={**env, "SLURMD_NODENAME": "nodeA"},
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 1
    assert f"the secret environment's file {secrets} is missing or unreadable on nodeA" in out.stderr
    assert not (tmp_path / "srun.args").exists()
