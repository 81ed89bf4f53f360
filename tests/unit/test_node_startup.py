"""How cluster's interpreter starts on a node (backends/shipping.py): `python -S` (no site-packages,
no .pth files) for every node program but the probe's facts, which say where torch is as the
job's python finds it; and a job started by a supervisor that began under -S still gets the
node's own python and environment. Run for real through the bootloader and bash, as sshd would."""
from __future__ import annotations

import importlib.util
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster.backends import shipping
from cluster.nodes import read_answer, read_answers
from cluster.plan import python_command


def flags(command: str, exe: str) -> list[str]:
    """The words between the interpreter and `-c` of a boot command."""
    words = shlex.split(command)
    start = len(shlex.split(exe))
    return words[start:words.index("-c", start)]


def test_every_program_starts_without_site(tmp_path: Path) -> None:
    exe = python_command("/opt/py/bin/python3")
    every = [shipping.program("probe", "facts", "--dir", str(tmp_path)),
             shipping.program("probe", "listen", "--port", "1"),
             shipping.program("probe", "connect", "--addr", "a", "--port", "1"),
             shipping.program("status", "--dir", str(tmp_path)),
             shipping.program("execute", "x"), shipping.program("clean", "--workdir", "w"),
             shipping.on_disk(str(tmp_path), "stop", str(tmp_path)),
             shipping.start(str(tmp_path), [], b"true\n")]
    for b in every:
        assert flags(shipping.boot_command(exe, b), exe) == ["-S", "-B"], b.run


def test_the_flag_reaches_the_interpreter_through_setup_lines(tmp_path: Path) -> None:
    """With setup lines the words are bash's, which ends in `exec python "$@"`: the flag must
    come after the python, as one of those arguments, and reach it."""
    exe = python_command(sys.executable, ("export CLUSTER_T=1",))
    status = shipping.program("status", "--dir", str(tmp_path / "none"))
    cmd = shipping.boot_command(exe, status)
    assert cmd.startswith("bash -c ") and " cluster-setup -S -B -c " in cmd
    res = subprocess.run(["bash", "-c", cmd], input=status.data, capture_output=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert read_answer(res.stdout)


def test_every_node_program_loads_without_site_packages() -> None:
    """They are standard library only: every module of cluster/remote loads under -S."""
    modules = (*shipping.SUPERVISOR_FILES, "execute", "clean", "status", "torchfind", "health",
               "probe")
    every = {p.stem for p in shipping.REMOTE.glob("*.py")} - {"__init__", "collective"}
    assert set(modules) == every        # collective.py runs under torchrun, with torch
    b = shipping.bundle(["probe", "connect", "--addr", "127.0.0.1", "--port", "9",
                         "--timeout", "0.2"], [shipping.module(m) for m in modules])
    res = subprocess.run(["bash", "-c", shipping.boot_command(sys.executable, b)], input=b.data,
                         capture_output=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "ok" in read_answer(res.stdout)


def probe_torch(python: str, cwd: Path, env: dict | None = None) -> dict | None:
    facts = shipping.program("probe", "facts")
    res = subprocess.run(["bash", "-c", shipping.boot_command(shlex.quote(python), facts)],
                         input=facts.data, capture_output=True, timeout=60, cwd=cwd,
                         env={**os.environ, **(env or {})})
    assert res.returncode == 0, res.stderr
    return read_answer(res.stdout)["torch"]


def job_finds_torch(python: str, cwd: Path, env: dict | None = None) -> str | None:
    """Where the job's python, which starts with site, finds torch (without importing it)."""
    code = "import importlib.util as u; s = u.find_spec('torch'); print(s.origin if s else '')"
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True,
                         cwd=cwd, env={**os.environ, **(env or {})}).stdout.strip()
    return os.path.join(os.path.dirname(out), "distributed", "run.py") if out else None


def fake_torch(where: Path, version: str) -> Path:
    pkg = where / "torch"
    (pkg / "distributed").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "version.py").write_text(f"__version__ = '{version}'\ncuda = None\n")
    (pkg / "distributed" / "run.py").write_text("")
    return pkg / "distributed" / "run.py"


def new_venv(where: Path) -> tuple[str, Path]:
    """A virtual environment without pip (and without the system's packages): its python
    and its site-packages."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    python = str(where / "bin" / "python")
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    return python, Path(purelib)


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch installed")
def test_the_probe_finds_torch_where_the_job_will(tmp_path: Path) -> None:
    torch = probe_torch(sys.executable, tmp_path)
    assert torch and torch["version"], torch
    assert torch["run_py"] == job_finds_torch(sys.executable, tmp_path)


def test_site_is_read_without_running_it_in_the_jobs_order(tmp_path: Path) -> None:
    """A virtual environment whose torch is on a .pth file's path line, beside a .pth file
    whose import line would say if it ran: the probe finds that torch, as the job does,
    without running the line; PYTHONPATH's torch comes first, for both."""
    python, site_dir = new_venv(tmp_path / "venv")
    run_py = fake_torch(tmp_path / "elsewhere", "9.9.9")
    (site_dir / "a-torch.pth").write_text(f"# where torch is\n{tmp_path / 'elsewhere'}\n")
    (site_dir / "b-noisy.pth").write_text(f"import os; open({str(tmp_path / 'ran')!r}, 'w')\n")
    torch = probe_torch(python, tmp_path)
    assert torch == {"run_py": str(run_py), "version": "9.9.9", "cuda": None}, torch
    assert not (tmp_path / "ran").exists(), "the probe ran a .pth file's import line"
    assert job_finds_torch(python, tmp_path) == str(run_py)

    first = fake_torch(tmp_path / "first", "1.1.1")
    env = {"PYTHONPATH": str(tmp_path / "first")}
    assert probe_torch(python, tmp_path, env)["run_py"] == str(first) == job_finds_torch(python, tmp_path, env)


def test_the_users_site_comes_before_the_systems_as_for_the_job(tmp_path: Path) -> None:
    """A venv that sees the system's packages: site's order is the venv's, the user's
    (PYTHONUSERBASE here), the system's; a torch in the user's site is the job's."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages",
                    str(tmp_path / "venv")], check=True)
    python = str(tmp_path / "venv" / "bin" / "python")
    env = {"PYTHONUSERBASE": str(tmp_path / "user")}
    user_site = subprocess.run([python, "-c", "import site; print(site.getusersitepackages())"],
                               capture_output=True, text=True, check=True, env={**os.environ, **env})
    run_py = fake_torch(Path(user_site.stdout.strip()), "3.3.3")
    assert probe_torch(python, tmp_path, env)["run_py"] == str(run_py) == job_finds_torch(python, tmp_path, env)


def test_a_torch_only_an_import_line_finds_is_found_by_running_site(tmp_path: Path) -> None:
    python, site_dir = new_venv(tmp_path / "venv")
    run_py = fake_torch(tmp_path / "hidden", "2.2.2")
    (site_dir / "finder.pth").write_text(f"import sys; sys.path.append({str(tmp_path / 'hidden')!r})\n")
    assert probe_torch(python, tmp_path)["run_py"] == str(run_py) == job_finds_torch(python, tmp_path)
    (site_dir / "finder.pth").unlink()
    assert probe_torch(python, tmp_path) is None and job_finds_torch(python, tmp_path) is None


def test_a_job_started_under_dash_s_gets_the_nodes_python_and_environment(tmp_path: Path) -> None:
    """The supervisor's interpreter skipped site; the job's (started by the node's script,
    with the environment the supervisor passes on) does not, and sees PYTHONPATH."""
    d, extra, out = tmp_path / "run", tmp_path / "extra", tmp_path / "job.json"
    extra.mkdir()
    job = ("import json, sys\n"
           f"json.dump({{'no_site': sys.flags.no_site, 'no_pyc': sys.flags.dont_write_bytecode, "
           f"'path': sys.path}}, open({str(out)!r}, 'w'))\n")
    script = f"{shlex.quote(sys.executable)} -c {shlex.quote(job)}\n".encode()
    start = shipping.start(str(d), ["--run-id", "r1", "--node", "n1", "--detach"], script)
    cmd = shipping.boot_command(shlex.quote(sys.executable), start)
    assert flags(cmd, shlex.quote(sys.executable)) == ["-S", "-B"]
    env = dict(os.environ, PYTHONPATH=str(extra))
    env.pop("PYTHONDONTWRITEBYTECODE", None)      # the node's own choice, not this shell's
    res = subprocess.run(["bash", "-c", cmd], input=start.data + b'{"env": {}}\n', env=env,
                         capture_output=True, timeout=60)
    assert res.returncode == 0, res.stderr
    deadline = time.time() + 30
    while not (out.exists() and out.stat().st_size) and time.time() < deadline:
        time.sleep(0.05)
    seen = json.loads(out.read_text())
    assert seen["no_site"] == 0 and seen["no_pyc"] == 0    # the job writes bytecode as it would
    assert str(extra) in seen["path"]
    assert any(p.endswith("-packages") for p in seen["path"]), seen["path"]


def probe_on_word(tmp_path: Path, port: int) -> subprocess.Popen:
    facts = shipping.program("probe", "facts", "--dir", str(tmp_path / "run"),
                             "--connect", f"127.0.0.1:{port}", "--connect-timeout", "5",
                             "--connect-on-word")
    proc = subprocess.Popen(["bash", "-c", shipping.boot_command(sys.executable, facts)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdin is not None
    proc.stdin.write(facts.data)
    proc.stdin.flush()
    return proc


def test_the_probe_starts_before_the_listener_and_connects_on_the_word(tmp_path: Path) -> None:
    """A launch starts every node's probe while the master's listener starts: the probe holds
    its connect until the launcher's line says the port listens. Nothing listens when the
    probe starts here (a connect then would be refused, which is final); the word comes once
    it does. What follows the word on the input is the bootloader's next bundle, whole."""
    import socket
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    proc = probe_on_word(tmp_path, port)
    time.sleep(0.5)                        # the probe has started and waits for the word
    srv.listen(8)
    after = shipping.program("probe", "connect", "--addr", "127.0.0.1", "--port", str(port))
    out, _ = proc.communicate(b"connect\n" + after.data, timeout=60)
    srv.close()
    said, _ = read_answers(out)
    assert said[0]["reach"]["ok"] is True
    assert said[1]["ok"] is True          # the next bundle ran: nothing eaten
    assert proc.returncode == 0


def test_the_word_skip_leaves_the_reach_unasked(tmp_path: Path) -> None:
    """The master could not listen (its port is taken: the launch tries another): no connect."""
    proc = probe_on_word(tmp_path, 9)
    out, _ = proc.communicate(b"skip\n", timeout=60)
    facts = read_answer(out)
    assert "reach" not in facts and "python" in facts


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_masters_probe_listens_first_and_hands_the_port_over_to_its_start(tmp_path: Path) -> None:
    """The master's probe listens on the master port before anything else and says so; every
    node's connect (its own too) is accepted; when the next bundle comes (the node's start),
    the port is free before that bundle's program runs: here a probe that binds it."""
    import socket
    port = free_port()
    facts = shipping.program("probe", "facts", "--dir", str(tmp_path / "run"), "--listen", str(port),
                             "--listen-seconds", "60", "--connect", f"127.0.0.1:{port}",
                             "--connect-on-word")
    proc = subprocess.Popen(["bash", "-c", shipping.boot_command(sys.executable, facts)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(facts.data)
    proc.stdin.flush()
    assert read_answer(proc.stdout.readline()) == {"listening": True}
    with socket.create_connection(("127.0.0.1", port), timeout=5):
        pass                                           # another node's reach check
    proc.stdin.write(b"connect\n")
    proc.stdin.flush()
    assert read_answer(proc.stdout.readline())["reach"]["ok"] is True     # its own
    after = shipping.program("probe", "facts", "--port", str(port))
    out, _ = proc.communicate(after.data, timeout=60)
    assert read_answer(out)["port_free"] is True
    assert proc.returncode == 0


def test_a_master_port_in_use_is_said_and_every_node_is_told_to_skip(tmp_path: Path) -> None:
    import socket
    port = free_port()
    with socket.socket() as busy:
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        busy.bind(("", port))
        busy.listen(1)
        facts = shipping.program("probe", "facts", "--listen", str(port), "--connect",
                                 f"127.0.0.1:{port}", "--connect-on-word")
        res = subprocess.run(["bash", "-c", shipping.boot_command(sys.executable, facts)],
                             input=facts.data + b"skip\n", capture_output=True, timeout=60)
    (said, answer), noise = read_answers(res.stdout)
    assert noise.strip() == b"", noise
    assert said == {"listening": False,
                    "error": f"cannot listen on port {port}: Address already in use"}, said
    assert "reach" not in answer and res.returncode == 0


def test_a_greeting_that_starts_with_a_brace_is_noise_before_the_probes_word(tmp_path: Path) -> None:
    """A node's shell or python wrapper that prints lines starting with `{` (no JSON, or JSON
    that is no object) before the probe speaks: the launcher reads past them to the facts."""
    from cluster.backends.local import LocalTransport
    from cluster.backends.node import SupervisedNode
    wrapper = tmp_path / "python"
    wrapper.write_text(f"#!/bin/sh\necho '{{broken'\necho '{{\"half\": [1'\necho '[1, 2]'\n"
                       f"exec {shlex.quote(sys.executable)} \"$@\"\n")
    wrapper.chmod(0o755)
    node = SupervisedNode(LocalTransport(), str(wrapper), str(tmp_path))
    ch = node.spawn(shipping.program("probe", "facts"))
    try:
        facts = next(node._answers(ch))
    finally:
        ch.close()
    assert facts["home"] == os.path.expanduser("~"), facts


def greeting_python(tmp_path: Path, greeting: str) -> Path:
    """A node's python behind what a shell's startup files print first (an `echo` in
    ~/.bashrc runs for a non-interactive SSH command too)."""
    wrapper = tmp_path / "python"
    wrapper.write_text(f"#!/bin/sh\necho {shlex.quote(greeting)}\n"
                       f"exec {shlex.quote(sys.executable)} \"$@\"\n")
    wrapper.chmod(0o755)
    return wrapper


def test_a_greeting_that_is_a_json_object_is_never_taken_for_a_programs_answer(tmp_path: Path) -> None:
    """A greeting that is itself a JSON object, one that looks like the probe's facts: the
    launcher reads the program's own answer, framed, whatever came before it: the staged
    probe's facts, a one-shot probe (connect) and the status program."""
    from cluster.backends.local import LocalTransport
    from cluster.backends.node import SupervisedNode
    fake = '{"python": "/fake", "torch": "0.0", "ok": true, "status": {"state": "running"}}'
    wrapper = greeting_python(tmp_path, fake)
    node = SupervisedNode(LocalTransport(), str(wrapper), str(tmp_path / "gone"))
    ch = node.spawn(shipping.program("probe", "facts"))
    try:
        facts = next(node._answers(ch))
    finally:
        ch.close()
    assert facts["python"] == sys.version.split()[0] and facts["torch"] != "0.0", facts
    reach = node.connect("127.0.0.1", 9, 0.2)               # nothing listens on the discard port
    assert reach["ok"] is False, reach
    assert node.status()["state"] == "gone"                  # the run's folder is not there
