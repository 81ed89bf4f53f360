"""Bad input never meets a traceback: random inventories and command lines, through the real
CLI (in process, dry runs: nothing is contacted), end in exit 0 or in exit 2 with a message
that names the file, the line and the key (or the option)."""
from __future__ import annotations

import os
import re

import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from cluster.cli import run_cli

NASTY = ["$(touch {canary})", "`touch {canary}`", "a\nb", "x\x00y", "\r", "'", '"', "\\", "-x",
         "--rm", "~", "%s", "{{ 7*7 }}", "é", "", " ", "0", "-1", "65536", "1e9", "auto", "on"]
KEYS = {
    "top": ["defaults", "hosts", "backend", "ssh", "slurm", "stop_grace", "restarts",
            "hang_timeout", "bogus"],
    "host": ["name", "address", "user", "port", "identity_file", "workdir", "python",
             "nproc_per_node", "master_port", "rendezvous", "network", "env", "secret_env",
             "env_forward", "setup", "torchrun_args", "container", "gpus", "adress"],
    "ssh": ["host_key_policy", "connect_timeout", "config", "keepalive", "port"],
    "slurm": ["partition", "account", "time", "nodes", "gpus_per_node", "cpus_per_task",
              "gpu_style", "signal", "max_requeues", "output_dir", "job_name", "constraint", "qos",
              "extra", "nodelist", "exclude"],
    "network": ["ifname", "ib", "mtu"],
    "container": ["runtime", "image", "python", "mounts", "options", "imag"],
}
# Values that are right for some keys, so that generated inventories also get past the first
# check and reach the later ones (setup's bash -n, torchrun_args' owned options, the container).
PLAUSIBLE = ["docker", "podman", "img:1", "/data:/data:ro", "--monitor-interval=1", "--nnodes=2",
             "source ~/venv/bin/activate", "if then", "WANDB_*", "HF_TOKEN", "python: auto"]

scalar = st.one_of(st.none(), st.booleans(), st.integers(-5, 70000), st.floats(allow_nan=False),
                   st.sampled_from(NASTY), st.sampled_from(PLAUSIBLE), st.text(max_size=12))


def mapping(kind: str, depth: int) -> st.SearchStrategy:
    child = value(depth - 1)
    return st.dictionaries(st.sampled_from(KEYS[kind]), child, max_size=5)


def value(depth: int) -> st.SearchStrategy:
    if depth <= 0:
        return scalar
    return st.one_of(scalar, st.lists(scalar, max_size=3),
                     st.dictionaries(st.sampled_from(KEYS["host"] + KEYS["network"] + KEYS["container"]),
                                     st.one_of(scalar, st.lists(scalar, max_size=2)), max_size=3))


hosts = st.lists(st.one_of(st.sampled_from(["a", "b", "gpu[1-2]", "bad name", "-x"]),
                           mapping("host", 2)), max_size=3)
document = st.fixed_dictionaries({}, optional={
    "hosts": hosts, "defaults": mapping("host", 2), "ssh": mapping("ssh", 1),
    "slurm": mapping("slurm", 1), "backend": st.sampled_from(["ssh", "slurm", "local", "x", 3]),
    "stop_grace": scalar, "restarts": scalar, "bogus": scalar})


def check_exit(code: int, err: str, where: str) -> None:
    event(f"exit {code}")
    assert code in (0, 2), f"exit {code}: {err}"
    if code == 2:
        assert err.startswith("cluster: error: ") or err.startswith("Usage:") or "Error:" in err, err
        if where and err.startswith(f"cluster: error: {where}"):
            assert re.match(rf"cluster: error: {re.escape(where)}(:\d+)?(: [^:]+)?: ", err), err


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(doc=document, raw=st.booleans())
def test_random_inventories_never_meet_a_traceback(tmp_path_factory, doc, raw) -> None:
    tmp = tmp_path_factory.mktemp("inv")
    canary = tmp / "canary"
    text = yaml.safe_dump(doc, allow_unicode=True).replace("{canary}", str(canary)) if not raw \
        else "\n".join(f"{k}: {v!r}" for k, v in doc.items())
    path = tmp / "inv.yaml"
    path.write_text(text)
    cwd = os.getcwd()
    os.chdir(tmp)
    try:
        import contextlib
        import io
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = run_cli(["up", "-i", str(path), "--dry-run", "--", "t.py"])
    finally:
        os.chdir(cwd)
    check_exit(code, err.getvalue(), str(path))
    if code == 2 and err.getvalue().startswith(f"cluster: error: {path}"):
        # file:line: key: problem (a YAML syntax error has no key: file:line: problem); only
        # what is wrong with the whole file has no line
        whole_file = r": (the file is empty|no hosts found)"
        assert re.match(rf"cluster: error: {re.escape(str(path))}(:\d+: \S|{whole_file})",
                        err.getvalue()), err.getvalue()
    assert not canary.exists()


OPTIONS = ["--nodes", "--hosts", "--exclude", "--backend", "--nproc-per-node", "--master-port",
           "--env", "--secret-env", "--stop-grace", "--keepalive", "--max-restarts",
           "--restart-after", "--min-nodes", "--hang-timeout", "--partition", "--time",
           "--account", "--max-requeues", "--templates", "--sync-exclude", "--host-key-policy",
           "--env-file", "--sync"]


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(args=st.lists(st.tuples(st.sampled_from(OPTIONS), st.sampled_from(NASTY + ["2", "gpu[1-3]",
                                                                                  "slurm", "A=1"])),
                     max_size=4),
       local=st.booleans())
def test_random_command_lines_never_meet_a_traceback(tmp_path_factory, args, local) -> None:
    tmp = tmp_path_factory.mktemp("cli")
    canary = tmp / "canary"
    argv = ["up", "--dry-run"] + (["--local"] if local else ["--hosts", "n[1-2]"])
    for opt, val in args:
        argv += [opt, val.replace("{canary}", str(canary))]
    argv += ["--", "t.py"]
    cwd = os.getcwd()
    os.chdir(tmp)
    try:
        import contextlib
        import io
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = run_cli(argv)
    finally:
        os.chdir(cwd)
    check_exit(code, err.getvalue(), "")
    if code == 2:
        assert "Invalid value" in err.getvalue() or "error" in err.getvalue().lower(), err.getvalue()
    assert not canary.exists()


def test_record_the_bad_input_suite(reliability) -> None:
    reliability(order=20, fault="bad input: random inventories and command lines",
                does="hypothesis: 150 random YAML inventories (every key, setup, env_forward, "
                     "torchrun_args and container included; nasty values: $(...), backquotes, "
                     "newlines, NUL, quotes, huge numbers) and 150 random command lines, through "
                     "the real CLI's dry run",
                outcome="never a traceback: exit 0, or exit 2 naming file, line and key (or the "
                        "option); no canary file was ever created", exit="0 or 2")
