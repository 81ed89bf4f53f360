"""Bad input never meets a traceback: random inventories and command lines, through the real
CLI (in process, dry runs: nothing is contacted), end in exit 0 or in exit 2 with a message
that names the file, the line and the key (or the option)."""
from __future__ import annotations

import contextlib
import io
import os
import re
from collections import Counter
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, event, example as known, given, settings
from hypothesis import strategies as st

from cluster.cli import run_cli

NASTY = ["$(touch {canary})", "`touch {canary}`", "a\nb", "x\x00y", "\r", "'", '"', "\\", "-x",
         "--rm", "~", "%s", "{{ 7*7 }}", "é", "", " ", "0", "-1", "65536", "1e9", "auto", "on"]
KEYS = {
    "top": ["defaults", "hosts", "backend", "ssh", "slurm", "stop_grace", "restarts",
            "hang_timeout", "hang_auto", "slow_node", "bogus"],
    "hang_auto": ["startup", "multiple", "floor", "cap", "flor"],
    "slow_node": ["ratio", "window", "windw"],
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
    "stop_grace": scalar, "restarts": scalar, "hang_timeout": scalar,
    "hang_auto": mapping("hang_auto", 1), "slow_node": mapping("slow_node", 1),
    "bogus": scalar})


# What each property test saw, filled in only when every one of its examples passed: the record
# below reports these counts, and refuses to record a suite that failed or did not run.
PASSED: dict[str, Counter] = {}
EXAMPLES = 150


def run_quietly(argv: list[str], cwd: Path) -> tuple[int, str]:
    """The real CLI in process, in `cwd`: (exit code, what it wrote to stderr)."""
    err = io.StringIO()
    old = os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = run_cli(argv)
    finally:
        os.chdir(old)
    return code, err.getvalue()


def check_inventory_error(code: int, err: str, path: Path) -> None:
    """Exit 0, or exit 2 with `cluster: error: FILE:LINE: key: problem` (a YAML syntax error
    has no key: FILE:LINE: problem); only what is wrong with the whole file has no line."""
    assert code in (0, 2), f"exit {code}: {err}"
    if code == 2:
        whole_file = r": (the file is empty|no hosts found)"
        assert re.match(rf"cluster: error: {re.escape(str(path))}(:\d+: \S|{whole_file})", err), err


# --sync-exclude refines --sync: the error about both, on a backend without sync, names --sync.
NAMED_BY = {"--sync-exclude": "--sync"}


def check_option_error(code: int, err: str, argv: list[str]) -> None:
    """Exit 0, or exit 2 with one line of ours or click's that names an option of this command
    line."""
    assert code in (0, 2), f"exit {code}: {err}"
    if code == 2:
        assert err.startswith(("cluster: error: ", "Usage:", "Error: ")) or "\nError: " in err, err
        given = {a.split("=", 1)[0] for a in argv[:argv.index("--")] if a.startswith("--")}
        named = given | {NAMED_BY[o] for o in given if o in NAMED_BY}
        assert any(re.search(rf"{re.escape(o)}\b(?!-)", err) for o in named), (argv, err)


def test_random_inventories_never_meet_a_traceback(tmp_path_factory) -> None:
    exits: Counter = Counter()

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
    @given(doc=document, raw=st.booleans())
    # Valid inventories are rare among random ones (150 examples can all be refused): these
    # make sure the exit-0 outcome is reached, so a checker that refuses everything fails.
    @known(doc={"hosts": ["a", "b"]}, raw=False)
    @known(doc={"hosts": [{"name": "g", "address": "10.0.0.1", "nproc_per_node": 2}],
                "defaults": {"env": {"A": "1"}}}, raw=False)
    def example(doc, raw) -> None:
        tmp = tmp_path_factory.mktemp("inv")
        canary = tmp / "canary"
        text = yaml.safe_dump(doc, allow_unicode=True).replace("{canary}", str(canary)) if not raw \
            else "\n".join(f"{k}: {v!r}" for k, v in doc.items())
        path = tmp / "inv.yaml"
        path.write_text(text)
        code, err = run_quietly(["up", "-i", str(path), "--dry-run", "--", "t.py"], tmp)
        event(f"exit {code}")
        check_inventory_error(code, err, path)
        assert not canary.exists()
        exits[code] += 1

    example()
    PASSED["inventories"] = exits


OPTIONS = ["--nodes", "--hosts", "--exclude", "--backend", "--nproc-per-node", "--master-port",
           "--env", "--secret-env", "--stop-grace", "--keepalive", "--max-restarts",
           "--restart-after", "--min-nodes", "--hang-timeout", "--partition", "--time",
           "--account", "--max-requeues", "--templates", "--sync-exclude", "--host-key-policy",
           "--env-file", "--sync"]


def test_random_command_lines_never_meet_a_traceback(tmp_path_factory) -> None:
    exits: Counter = Counter()

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
    @given(args=st.lists(st.tuples(st.sampled_from(OPTIONS),
                                   st.sampled_from(NASTY + ["2", "gpu[1-3]", "slurm", "A=1"])),
                         max_size=4),
           local=st.booleans())
    @known(args=[], local=True)
    @known(args=[("--nodes", "2")], local=False)
    def example(args, local) -> None:
        tmp = tmp_path_factory.mktemp("cli")
        canary = tmp / "canary"
        argv = ["up", "--dry-run"] + (["--local"] if local else ["--hosts", "n[1-2]"])
        for opt, val in args:
            argv += [opt, val.replace("{canary}", str(canary))]
        argv += ["--", "t.py"]
        code, err = run_quietly(argv, tmp)
        event(f"exit {code}")
        check_option_error(code, err, argv)
        assert not canary.exists()
        exits[code] += 1

    example()
    PASSED["command lines"] = exits


def test_a_message_without_file_line_or_option_fails_the_checks(tmp_path: Path) -> None:
    """The checks above can fail: an exit 2 that does not name the file and line, or no option
    of its command line, is caught; and so is a traceback's exit 1."""
    path = tmp_path / "inv.yaml"
    for code, err in [(2, "cluster: error: something is wrong\n"),
                      (2, f"cluster: error: {tmp_path}/other.yaml:3: hosts: bad\n"),
                      (1, "Traceback (most recent call last):\n")]:
        with pytest.raises(AssertionError):
            check_inventory_error(code, err, path)
    check_inventory_error(2, f"cluster: error: {path}:3: hosts[0].port: not a number\n", path)
    argv = ["up", "--dry-run", "--local", "--nodes", "x", "--", "t.py"]
    for code, err in [(2, "cluster: error: an error\n"), (2, "cluster: error: --env is bad\n"),
                      (2, "cluster: error: --nodes-per-rack is bad\n"), (1, "Traceback\n")]:
        with pytest.raises(AssertionError):
            check_option_error(code, err, argv)
    check_option_error(2, "cluster: error: Invalid value for --nodes: not a number\n", argv)


def test_record_the_bad_input_suite(reliability) -> None:
    """Records the row only from what the property tests above saw, and only if both ran in
    this session and passed."""
    missing = [name for name in ("inventories", "command lines") if name not in PASSED]
    assert not missing, (f"the {' and '.join(missing)} property test(s) did not pass in this "
                         f"session (or were not run): nothing to record")
    for name, exits in PASSED.items():
        assert sum(exits.values()) >= EXAMPLES * 0.9, (name, exits)
        assert exits[0] and exits[2], f"{name}: both outcomes must be reached: {dict(exits)}"
    seen = {f"{name}, exit 0 / exit 2": f"{exits[0]} / {exits[2]}" for name, exits in PASSED.items()}
    reliability(order=20, fault="bad input: random inventories and command lines",
                does=f"hypothesis: {EXAMPLES} random YAML inventories (every key, setup, "
                     "env_forward, torchrun_args and container included; nasty values: $(...), "
                     f"backquotes, newlines, NUL, quotes, huge numbers) and {EXAMPLES} random "
                     "command lines, through the real CLI's dry run",
                outcome="never a traceback: exit 0, or exit 2 naming file, line and key (or an "
                        "option of the command line); no canary file was ever created",
                exit="0 or 2", figures=seen)


# --- a validator's end anchor -----------------------------------------------------------------

def test_no_validation_pattern_ends_with_a_dollar() -> None:
    """`$` also matches before a trailing newline: 'FOO\\n' passed the name check and broke the
    script. Every anchored pattern of cluster/ ends with \\Z (or is used with fullmatch)."""
    import ast
    root = Path(__file__).resolve().parents[2] / "cluster"
    found = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("compile", "match") and node.args
                    and isinstance(node.args[0], ast.Constant)
                    and isinstance(node.args[0].value, (str, bytes))):
                text = node.args[0].value
                text = text.decode() if isinstance(text, bytes) else text
                flags = ast.unparse(node.args[1]) if len(node.args) > 1 else ""
                if text.startswith("^") and text.endswith("$") and "re.S" not in flags:
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno}: {text}")
    assert found == []


def test_the_validators_refuse_a_trailing_newline() -> None:
    from cluster import network, sbatch, sbatch_options, spec, texts
    for pattern, good in ((texts.HOSTNAME, "node1"), (texts.ENV_KEY, "FOO"), (spec.IFNAME, "eth0"),
                          (spec.IMAGE, "img:1"), (sbatch.SBATCH_BARE, "gpu"),
                          (sbatch_options.SBATCH_KEY, "qos"), (network.PLAIN_IFNAME, "eth0")):
        assert pattern.match(good) and not pattern.match(good + "\n"), pattern.pattern


@pytest.mark.parametrize("argv", [["--env", "FOO\n=bar"], ["--secret-env", "FOO\n"]])
def test_a_name_with_a_trailing_newline_is_refused(tmp_path: Path, argv: list[str]) -> None:
    (tmp_path / "t.py").write_text("print(1)\n")
    code, err = run_quietly(["up", "--local", "--dry-run", *argv, "--", "t.py"], tmp_path)
    assert code == 2 and "Invalid value for --" in err, err


# Control characters in an environment value (each pair is written into the node's script):
# refused at every way in, each named where it was given.
CONTROL_VALUES = ["a\nb", "a\rb", "a\x1bb", "a\tb", "a\x00b"]


@pytest.mark.parametrize("value", CONTROL_VALUES)
def test_an_env_value_with_a_control_character_is_refused_on_the_command_line(
        tmp_path: Path, value: str) -> None:
    (tmp_path / "t.py").write_text("print(1)\n")
    code, err = run_quietly(["up", "--local", "--dry-run", "--env", f"FOO={value}", "--", "t.py"],
                            tmp_path)
    assert code == 2 and "Invalid value for --env" in err and "control character" in err, err
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("value", CONTROL_VALUES[:3])
def test_an_env_value_with_a_control_character_is_refused_in_the_inventory(
        tmp_path: Path, value: str) -> None:
    (tmp_path / "t.py").write_text("print(1)\n")
    inv = tmp_path / "inv.yaml"
    inv.write_text(yaml.safe_dump({"hosts": [{"address": "127.0.0.1", "name": "a",
                                              "env": {"OK": "1", "FOO": value}}]}))
    code, err = run_quietly(["up", "-i", str(inv), "--dry-run", "--", "t.py"], tmp_path)
    check_inventory_error(code, err, inv)
    assert code == 2 and re.search(rf"{re.escape(str(inv))}:\d+: FOO: control character", err), err


@pytest.mark.parametrize("escape", ["\\n", "\\r", "\\t"])
def test_an_env_file_value_with_an_escaped_control_character_is_refused(
        tmp_path: Path, escape: str) -> None:
    (tmp_path / "t.py").write_text("print(1)\n")
    (tmp_path / ".env").write_text(f'OK=1\nFOO="a{escape}b"\n')
    code, err = run_quietly(["up", "--local", "--dry-run", "--env-file", ".env", "--", "t.py"],
                            tmp_path)
    assert code == 2 and re.search(r"\.env:2: FOO: control character", err), err


@pytest.mark.parametrize("env,why", [({"FOO": "a\nb"}, "control character '\\\\n'"),
                                     ({"BAD NAME": "x"}, "not a valid identifier"),
                                     ({"CLUSTER_RUN_ID": "x"}, "set by cluster itself")])
def test_the_python_apis_env_is_checked_as_the_command_lines(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, env: dict, why: str) -> None:
    from cluster import api
    from cluster.errors import InputError
    (tmp_path / "t.py").write_text("print(1)\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InputError, match=rf"Invalid value for --env \(env=\): .*{why}"):
        api.prepare(api.Request(command=("t.py",), env=env))


def test_env_forward_refuses_a_named_value_with_a_control_character_and_a_glob_skips_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from cluster import inventory
    from cluster.errors import InputError
    from cluster.inventory.environment import forward_env
    inv = tmp_path / "inv.yaml"
    inv.write_text(yaml.safe_dump({"hosts": [{"address": "127.0.0.1", "name": "a",
                                              "env_forward": ["MYAPP_*"]}]}))
    environ = {"MYAPP_OK": "1", "MYAPP_PEM": "line1\nline2"}
    env = dict(forward_env(inventory.load(inv), environ).hosts[0].env)
    assert env.get("MYAPP_OK") == "1" and "MYAPP_PEM" not in env
    inv.write_text(yaml.safe_dump({"hosts": [{"address": "127.0.0.1", "name": "a",
                                              "env_forward": ["MYAPP_PEM"]}]}))
    with pytest.raises(InputError, match=r"inv.yaml:\d+: env_forward: control character '\\n' at position 5 in the value of MYAPP_PEM"):
        forward_env(inventory.load(inv), environ)


def test_a_script_argument_with_a_control_character_is_refused(tmp_path: Path) -> None:
    (tmp_path / "t.py").write_text("print(1)\n")
    code, err = run_quietly(["up", "--local", "--dry-run", "--", "t.py", "--name", "a\nb"], tmp_path)
    assert code == 2 and "the script's argument 2: control character '\\n'" in err, err
