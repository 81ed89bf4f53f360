"""A node's torchrun in a container, on this machine with a fake runtime (fake_runtime.py as
`podman`/`docker` on PATH) and the real supervisor: what reaches the program, what the
runtime is given, and stopping by the container's name. The real runtime is exercised by
tests/integration/test_containers.py."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster.nodes import read_answer
from cluster.backends.shipping import SUPERVISOR
from cluster.plan import Job
from cluster.spec import container_name

from .fake_box import FakeBox

RUN_ID = f"unit-box-{os.getpid()}"
SECRET = "s3cr3t $(touch /tmp/x) 'q'\nline two"
ENV = {"NASTY": "$(id) `id` \"dq\" 's' 64(x2)\nsecond", "EMPTY": "", "EQ": "a=b=c"}


def tagged(run_id: str) -> list[int]:
    want = f"CLUSTER_RUN_ID={run_id}".encode()
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if want in Path(f"/proc/{name}/environ").read_bytes().split(b"\0"):
                    state = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()[0]
                    if state != "Z":
                        found.append(int(name))
            except OSError:
                continue
    return found


def wait_for(cond, timeout: float = 15.0) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return bool(cond())


def node_dir(tmp_path: Path, box: FakeBox, *, args: tuple[str, ...] = ("--lr", "0.1 $(x)"),
             secret_env: tuple[str, ...] = ("TOKEN",)) -> Path:
    """A node's run directory as the launcher leaves it: launch.sh and container.json."""
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    node = box.node(box.host(work, ENV, secret_env), Job(run_id=RUN_ID, script="train.py", args=args))
    d = tmp_path / "node"
    d.mkdir()
    (d / "launch.sh").write_text(node.script)
    (d / "container.json").write_text(json.dumps({"runtime": box.runtime, "name": node.container}))
    return d


def start(d: Path, box: FakeBox, mode: str, secrets: dict[str, str]) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, str(SUPERVISOR), "run", str(d), "--run-id", RUN_ID,
                          "--node", "n1", "--grace", "5"], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=box.env(mode),
                         start_new_session=True)
    p.stdin.write((json.dumps({"env": secrets}) + "\n").encode())
    p.stdin.flush()
    return p


def finish(p: subprocess.Popen) -> bytes:
    """The supervisor's output to its end, its input left open (closed means: launcher gone)."""
    out = p.stdout.read()
    p.wait(timeout=60)
    return out


def stop(d: Path, box: FakeBox, grace: float = 5) -> dict:
    out = subprocess.run([sys.executable, str(SUPERVISOR), "stop", str(d), "--grace", str(grace)],
                         capture_output=True, env=box.env())
    said = read_answer(out.stdout)
    assert said is not None, out
    return said


@pytest.mark.parametrize("runtime", ["podman", "docker"])
def test_values_reach_the_container_and_never_its_command_line(tmp_path: Path, runtime: str) -> None:
    box = FakeBox(tmp_path, runtime)
    d = node_dir(tmp_path, box)
    p = start(d, box, "exit", {"TOKEN": SECRET})
    out = finish(p)
    assert p.returncode == 0, out.decode(errors="replace")
    got = box.received()
    # the program: its arguments, the node's env and the secret byte for byte, the identity
    assert got["argv"][-3:] == ["train.py", "--lr", "0.1 $(x)"]
    assert all(got["env"][k] == v for k, v in ENV.items())
    assert got["env"]["TOKEN"] == SECRET
    assert got["env"]["CLUSTER_RUN_ID"] == RUN_ID and got["env"]["CLUSTER_NODE"] == "n1"
    assert got["env"]["CLUSTER_HEARTBEAT_FILE"] == str(d / "heartbeat")
    assert got["cwd"] == str(tmp_path / "work") and got["stdin"] == "/dev/null"
    assert "FAKE_RUNTIME_DIR" not in got["env"], "the node's own environment stays outside"
    # the runtime: no value in its arguments; no identity or secret in its environment
    (run,) = box.calls("run")
    words = "\0".join(run["argv"])
    for value in [SECRET, *[v for v in ENV.values() if v]]:
        assert value not in words
    assert "TOKEN" not in run["env"] and "CLUSTER_RUN_ID" not in run["env"]
    assert run["argv"][run["argv"].index("--name") + 1] == container_name(RUN_ID, "n1")
    for option in ("--network", "--ipc"):
        assert run["argv"][run["argv"].index(option) + 1] == "host"
    assert ["--volume", f"{d}:{d}"] == run["argv"][run["argv"].index(f"{d}:{d}") - 1:][:2]
    assert ("--user" in run["argv"]) == (runtime == "docker")
    # the env file: private, in the run directory, every value but no secret
    env_file = d / "container.env"
    assert stat.S_IMODE(env_file.stat().st_mode) == 0o600
    data = env_file.read_bytes()
    assert f"NASTY={ENV['NASTY']}\0".encode() in data and SECRET.encode() not in data


def test_stop_goes_through_the_runtime_by_name_with_one_term(tmp_path: Path) -> None:
    box = FakeBox(tmp_path)
    d = node_dir(tmp_path, box)
    p = start(d, box, "sleep", {"TOKEN": SECRET})
    assert wait_for(box.out.exists), p.stdout.read1().decode(errors="replace") if p.poll() else ""
    report = stop(d, box, grace=5)
    finish(p)
    assert report["left"] == [] and report["signalled"], report
    name = container_name(RUN_ID, "n1")
    stops = box.calls("stop")
    assert stops and stops[0]["argv"] == ["stop", "-t", "5", name]
    assert Path(str(box.out) + ".term").read_text() == "1", "torchrun got exactly one SIGTERM"
    assert wait_for(lambda: not tagged(RUN_ID), 5)


def test_a_runtime_that_cannot_stop_still_leaves_nothing(tmp_path: Path) -> None:
    """The runtime's stop fails (its daemon is down, say): what of the run this user can see is
    stopped by identity, and the container's absence is still checked."""
    box = FakeBox(tmp_path)
    d = node_dir(tmp_path, box)
    p = start(d, box, "sleep", {"TOKEN": SECRET})
    assert wait_for(box.out.exists)
    broken = box.bin / "podman"              # from now on the runtime answers nothing useful
    broken.unlink()
    broken.write_text("#!/bin/sh\necho 'Error: cannot connect to the service' >&2\nexit 125\n")
    broken.chmod(0o755)
    report = stop(d, box, grace=1)
    finish(p)
    assert wait_for(lambda: not tagged(RUN_ID), 5)
    assert report["left"] == [f"container {container_name(RUN_ID, 'n1')} (podman did not answer)"]
