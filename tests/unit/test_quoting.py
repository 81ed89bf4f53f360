"""Property: any env value or script argument reaches the program byte for byte, and nothing
in it is executed by the shell. Real bash runs the rendered script; a stand-in python plays
torchrun and records what it received."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster.spec import Host, Inventory, Network
from cluster.plan import Job, Templates, render

NASTY = ["$(touch {canary})", "`touch {canary}`", "'; touch {canary}; '", "\"$HOME\"", "a b\tc",
         "line\nbreak", "64(x2)", "100%", "%s%n", "$((1+1))", "!event", "\\", "*", "~", "-", "--x=1",
         "${IFS}", "\r\n", "é ü 漢字", ""]

text = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
               max_size=40)
value = st.one_of(text, st.sampled_from(NASTY), st.lists(st.sampled_from(NASTY), max_size=4).map("".join))
env_key = st.from_regex(r"[A-Z_][A-Z0-9_]{0,10}", fullmatch=True).filter(
    lambda k: not k.startswith(("CLUSTER_", "NCCL_", "GLOO_", "MASTER_")) and k not in BASH_SPECIAL)
BASH_SPECIAL = {"PATH", "HOME", "IFS", "PWD", "OLDPWD", "SHELLOPTS", "BASHOPTS", "PS4", "BASH_ENV",
                "ENV", "UID", "EUID", "PPID", "SHLVL", "_", "LANG", "LC_ALL", "BASH_XTRACEFD",
                "HOSTNAME", "RANDOM", "SECONDS", "LINENO", "GROUPS", "OPTIND", "OPTARG", "PS1",
                "PS2", "PS3", "HISTFILE", "CDPATH", "GLOBIGNORE", "TMOUT", "POSIXLY_CORRECT",
                "FUNCNAME", "BASH_ARGV0", "SRANDOM", "EPOCHSECONDS", "EPOCHREALTIME", "COLUMNS",
                "LINES", "MAIL", "MAILPATH", "TERM", "EXECIGNORE", "BASHPID", "DIRSTACK", "HOSTTYPE",
                "MACHTYPE", "OSTYPE", "BASH", "BASH_VERSION", "BASH_VERSINFO", "BASH_COMMAND",
                "PIPESTATUS", "BASH_SUBSHELL", "BASH_LINENO", "BASH_SOURCE", "COMP_WORDBREAKS",
                "HISTCMD", "IGNOREEOF", "INPUTRC", "LC_CTYPE", "LC_MESSAGES", "LC_COLLATE",
                "LC_NUMERIC", "PROMPT_COMMAND", "TMPDIR", "BASH_ALIASES", "BASH_CMDS",
                "BASH_REMATCH", "BASH_ARGC", "BASH_ARGV", "COPROC", "FIGNORE", "HISTCONTROL",
                "HISTIGNORE", "HISTSIZE", "HISTFILESIZE", "HISTTIMEFORMAT", "MAILCHECK", "OPTERR",
                "PROMPT_DIRTRIM", "READLINE_LINE", "REPLY", "TIMEFORMAT", "auto_resume",
                "histchars", "CHILD_MAX", "BASH_COMPAT", "BASH_LOADABLES_PATH", "EMACS",
                "HISTFILESIZE", "NPROC", "IFNAME", "LD_PRELOAD", "LD_LIBRARY_PATH", "PYTHONPATH",
                "PYTHONHOME", "PYTHONSTARTUP", "PYTHONINSPECT", "PYTHONWARNINGS", "PYTHONIOENCODING",
                "PYTHONUTF8", "PYTHONSAFEPATH", "PYTHONNOUSERSITE", "PYTHONEXECUTABLE",
                "PYTHONUSERBASE", "PYTHONPLATLIBDIR", "PYTHONDONTWRITEBYTECODE", "PYTHONOPTIMIZE",
                "PYTHONVERBOSE", "PYTHONDEBUG", "PYTHONHASHSEED", "PYTHONMALLOC", "PYTHONCOERCECLOCALE",
                "PYTHONDEVMODE", "PYTHONFAULTHANDLER", "PYTHONTRACEMALLOC", "PYTHONPROFILEIMPORTTIME",
                "PYTHONASYNCIODEBUG", "PYTHONBREAKPOINT", "PYTHONCASEOK", "PYTHONPYCACHEPREFIX",
                "PYTHONWARNDEFAULTENCODING", "PYTHONNODEBUGRANGES", "PYTHONINTMAXSTRDIGITS"}

STAND_IN = """#!{python}
import json, os, sys
json.dump({{"argv": sys.argv[1:], "env": dict(os.environ)}}, open({out!r}, "w"))
"""


def run_rendered(tmp: Path, env: dict[str, str], args: list[str], script: str = "train.py",
                 torchrun_args: tuple[str, ...] = ()) -> dict:
    out = tmp / "received.json"
    fake = tmp / "fake-python"
    fake.write_text(STAND_IN.format(python=sys.executable, out=str(out)))
    fake.chmod(0o755)
    host = Host(name="n1", address="127.0.0.1", workdir=str(tmp), python=str(fake),
                nproc_per_node=1, network=Network(ifname="lo", ib="off"), env=tuple(env.items()),
                torchrun_args=torchrun_args)
    plan = render(Inventory(hosts=(host,)), Job(run_id="prop", script=script, args=tuple(args)),
                  Templates())
    script = tmp / "launch.sh"
    script.write_text(plan.nodes[0].script)
    res = subprocess.run(["bash", str(script)], capture_output=True, cwd=tmp,
                         env={"PATH": os.environ["PATH"], "HOME": str(tmp)})
    assert res.returncode == 0, res.stderr.decode(errors="replace")
    return json.loads(out.read_text())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(env=st.dictionaries(env_key, value, max_size=4), args=st.lists(value, max_size=5),
       script=value.filter(lambda s: not any(ord(c) < 32 or ord(c) == 127 for c in s)),
       torchrun_args=st.lists(value.filter(lambda s: not any(ord(c) < 32 or ord(c) == 127 for c in s)),
                              max_size=3))
def test_values_arrive_unchanged_and_execute_nothing(tmp_path_factory, env, args, script,
                                                     torchrun_args) -> None:
    tmp = tmp_path_factory.mktemp("q")
    canary = tmp / "canary"
    env = {k: v.replace("{canary}", str(canary)) for k, v in env.items()}
    args = [a.replace("{canary}", str(canary)) for a in args]
    script = script.replace("{canary}", str(canary))
    torchrun_args = [a.replace("{canary}", str(canary)) for a in torchrun_args]
    got = run_rendered(tmp, env, args, script, tuple(torchrun_args))
    # argv: -m torch.distributed.run <torchrun options> --local_addr=... <torchrun_args> SCRIPT <args>
    local_at = next(i for i, a in enumerate(got["argv"]) if a.startswith("--local_addr="))
    script_at = local_at + 1 + len(torchrun_args)
    assert got["argv"][local_at + 1:script_at] == torchrun_args
    assert got["argv"][script_at] == script
    assert got["argv"][script_at + 1:] == args
    for key, val in env.items():
        assert got["env"][key] == val
    assert not canary.exists(), "a value was executed by the shell"


def test_each_nasty_value_individually(tmp_path) -> None:
    canary = tmp_path / "canary"
    values = [v.replace("{canary}", str(canary)) for v in NASTY]
    env = {f"V{i}": v for i, v in enumerate(values)}
    got = run_rendered(tmp_path, env, values)
    assert got["argv"][got["argv"].index("train.py") + 1:] == values
    assert all(got["env"][k] == v for k, v in env.items())
    assert not canary.exists()


# --- every field that reaches a script -----------------------------------------------------

import yaml  # noqa: E402

from cluster.errors import InputError, InventoryError  # noqa: E402
from cluster.inventory import parse_yaml  # noqa: E402
from cluster.sbatch import render_sbatch  # noqa: E402
from cluster.spec import SlurmSettings  # noqa: E402

CONTROL = st.sampled_from([chr(c) for c in list(range(0, 32)) + [127]])
# Text fields of the inventory, where each goes in the YAML, and whether it reaches a script.
TEXT_FIELDS = {
    "workdir": "defaults", "python": "defaults", "user": "defaults", "identity_file": "defaults",
    "partition": "slurm", "account": "slurm", "time": "slurm", "constraint": "slurm",
    "job_name": "slurm", "output_dir": "slurm", "signal": "slurm", "config": "ssh",
    "ifname": "network", "address": "host", "name": "host",
    "setup": "defaults-list", "torchrun_args": "defaults-list", "env_forward": "defaults-list",
    "extra": "slurm-extra",
}


def inventory_with(field: str, value: str) -> str:
    where = TEXT_FIELDS[field]
    host = {"name": "a"}
    doc: dict = {"hosts": [host]}
    if where == "host":
        host[field] = value
    elif where == "defaults-list":
        doc["defaults"] = {field: ["ok", value]}
    elif where == "slurm-extra":
        doc["slurm"] = {"extra": {"qos": value}}
    elif where == "network":
        doc["defaults"] = {"network": {field: value}}
    else:
        doc.setdefault(where, {})[field] = value
    return yaml.safe_dump(doc, allow_unicode=True, default_style='"')


@settings(max_examples=150, deadline=None)
@given(field=st.sampled_from(sorted(TEXT_FIELDS)), before=text, bad=CONTROL, after=text)
def test_every_text_field_rejects_control_characters(field: str, before: str, bad: str,
                                                     after: str) -> None:
    source = inventory_with(field, before + bad + after)
    with pytest.raises(InventoryError) as info:
        parse_yaml(source, "inv.yaml")
    assert info.value.key in (field, "name", "qos"), str(info.value)
    assert str(info.value).startswith("inv.yaml:"), str(info.value)


path_part = st.text(alphabet=st.characters(blacklist_categories=("Cs", "Cc"),
                                           blacklist_characters="/\x00"),
                    min_size=1, max_size=20).filter(lambda s: s not in (".", ".."))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(workdir=st.one_of(path_part, st.sampled_from(["$(touch {canary})", "a b", "`id`", "'q'", "-x"])),
       python=st.one_of(path_part, st.sampled_from(["py thon", "$(touch {canary})", "-m"])))
def test_workdir_and_python_reach_the_node_unchanged(tmp_path_factory, workdir: str, python: str) -> None:
    tmp = tmp_path_factory.mktemp("paths")
    canary = tmp / "canary"
    workdir, python = (v.replace("{canary}", str(canary)) for v in (workdir, python))
    wd = tmp / "w" / workdir
    wd.mkdir(parents=True)
    out = tmp / "received.json"
    fake = tmp / "bin" / python
    fake.parent.mkdir(parents=True, exist_ok=True)
    fake.write_text(STAND_IN.format(python=sys.executable, out=str(out)).replace(
        '"env": dict(os.environ)', '"env": dict(os.environ), "cwd": os.getcwd(), "exe": sys.argv[0]'))
    fake.chmod(0o755)
    host = Host(name="n1", address="127.0.0.1", workdir=str(wd), python=str(fake), nproc_per_node=1,
                network=Network(ifname="lo", ib="off"))
    plan = render(Inventory(hosts=(host,)), Job(run_id="prop", script="t.py"), Templates())
    script = tmp / "launch.sh"
    script.write_text(plan.nodes[0].script)
    res = subprocess.run(["bash", str(script)], capture_output=True, cwd=tmp,
                         env={"PATH": os.environ["PATH"], "HOME": str(tmp)})
    assert res.returncode == 0, res.stderr.decode(errors="replace")
    got = json.loads(out.read_text())
    assert got["cwd"] == str(wd) and got["exe"] == str(fake)
    assert not canary.exists()


def sbatch_arguments(line: bytes) -> list[bytes]:
    """The arguments sbatch reads from one '#SBATCH ...' line: a Python transcription of
    _get_argument() in SLURM's src/sbatch/opt.c (22.05). Not a shell: a backslash escapes the
    next byte even inside quotes; an unescaped '#' outside quotes ends the line."""
    assert line.startswith(b"#SBATCH")
    s, i, args = line[len(b"#SBATCH"):], 0, []
    space = b" \t\n\v\f\r"
    while True:
        while i < len(s) and s[i] in space:
            i += 1
        if i >= len(s):
            return args
        arg, quoted, q, escape = bytearray(), False, 0, False
        while i < len(s) and (quoted or s[i] not in space) and s[i] != ord("\n"):
            c = s[i]
            if escape:
                escape = False
            elif c == ord("\\"):
                escape, i = True, i + 1
                continue
            elif quoted:
                if c == q:
                    quoted, i = False, i + 1
                    continue
            elif c in b"\"'":
                quoted, q, i = True, c, i + 1
                continue
            elif c == ord("#"):
                return args + ([bytes(arg)] if arg else [])
            arg.append(c)
            i += 1
        args.append(bytes(arg))


def test_the_sbatch_parser_transcription() -> None:
    assert sbatch_arguments(b'#SBATCH --a=x "b c" \'d\\e\' f#g') == [b"--a=x", b"b c", b"de", b"f"]
    assert sbatch_arguments(b'#SBATCH --p="a#b" # comment') == [b"--p=a#b"]


sbatch_text = st.text(alphabet=st.characters(blacklist_categories=("Cs", "Cc")), min_size=1,
                      max_size=30).filter(lambda s: not any(w in s.lower() for w in ("hetjob", "packjob")))


@settings(max_examples=150, deadline=None)
@given(partition=sbatch_text, account=sbatch_text, time=sbatch_text, constraint=sbatch_text,
       job_name=sbatch_text, qos=sbatch_text)
def test_sbatch_options_round_trip_through_sbatchs_own_parser(partition, account, time,
                                                             constraint, job_name, qos) -> None:
    given_values = {"partition": partition, "account": account, "time": time,
                    "constraint": constraint, "job-name": job_name, "qos": qos}
    settings_ = SlurmSettings(partition=partition, account=account, time=time,
                              constraint=constraint, job_name=job_name, nodes=2,
                              extra=(("qos", qos), ("exclusive", None)))
    inv = Inventory(hosts=(Host(name="slurm", address="slurm"),), backend="slurm")
    script = render_sbatch(inv, Job(run_id="prop", script="t.py"), Templates(), settings_,
                           cwd="/work dir/$(x)").script
    seen: dict[str, str] = {}
    for line in script.encode().splitlines():
        if line.startswith(b"#SBATCH"):
            (arg,) = sbatch_arguments(line)
            key, _, value = arg.decode().removeprefix("--").partition("=")
            seen[key] = value
        elif not line.startswith(b"#") and line.strip():
            break                       # sbatch stops reading options at the first command
    for key, value in given_values.items():
        assert seen[key] == value, (key, value, seen.get(key))
    assert seen["chdir"] == "/work dir/$(x)"
    assert seen["exclusive"] == ""                      # a flag: --exclusive, no value


@pytest.mark.parametrize("field", ["partition", "job_name", "account"])
def test_hetjob_words_are_refused_in_sbatch_values(field: str) -> None:
    inv = Inventory(hosts=(Host(name="slurm", address="slurm"),), backend="slurm")
    with pytest.raises(InputError, match="heterogeneous-job separator"):
        render_sbatch(inv, Job(run_id="p", script="t.py"), Templates(),
                      SlurmSettings(**{field: "my-HetJob-x"}), cwd="/w")


# --- a node in a container (fake runtime on PATH: fake_runtime.py) ------------------------------

from cluster.spec import Mount  # noqa: E402

from .fake_box import FakeBox  # noqa: E402


def run_in_box(tmp: Path, env: dict[str, str], args: list[str], secrets: dict[str, str],
               mounts: tuple[Mount, ...] = (), options: tuple[str, ...] = ()) -> tuple[dict, list[str]]:
    """Run a rendered container node script with bash, as the supervisor would (secrets in its
    environment); return what the stand-in torchrun received and the runtime's arguments."""
    box = FakeBox(tmp)
    work = tmp / "work"
    work.mkdir()
    host = box.host(work, env, tuple(secrets), mounts=mounts, options=options)
    node = box.node(host, Job(run_id="prop", script="train.py", args=tuple(args)))
    d = tmp / "node"
    d.mkdir()
    (d / "launch.sh").write_text(node.script)
    res = subprocess.run(["bash", str(d / "launch.sh")], capture_output=True, cwd=tmp,
                         env={**box.env(), **secrets, "CLUSTER_RUN_ID": "prop", "CLUSTER_NODE": "n1"})
    assert res.returncode == 0, res.stderr.decode(errors="replace")
    (run,) = box.calls("run")
    return box.received(), run["argv"]


# Marked, so that finding one among the runtime's arguments can only mean it leaked there.
secret_value = value.map(lambda v: "~SECRET~" + v)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(env=st.dictionaries(env_key, value, max_size=3), args=st.lists(value, max_size=4),
       secrets=st.dictionaries(env_key, secret_value, max_size=2))
def test_values_reach_a_container_unchanged_and_execute_nothing(tmp_path_factory, env, args,
                                                                 secrets) -> None:
    tmp = tmp_path_factory.mktemp("box")
    canary = tmp / "canary"
    secrets = {k: v.replace("{canary}", str(canary)) for k, v in secrets.items() if k not in env}
    env = {k: v.replace("{canary}", str(canary)) for k, v in env.items()}
    args = [a.replace("{canary}", str(canary)) for a in args]
    got, runtime_argv = run_in_box(tmp, env, args, secrets)
    assert got["argv"][got["argv"].index("train.py") + 1:] == args
    for key, val in {**env, **secrets}.items():
        assert got["env"][key] == val
    for val in secrets.values():
        assert not any(val in word for word in runtime_argv), "a secret on the runtime's command line"
    assert not canary.exists(), "a value was executed by the shell"


mount_path = st.text(alphabet=st.characters(blacklist_categories=("Cs", "Cc"),
                                            blacklist_characters=":,\x00"),
                     min_size=1, max_size=20).map(lambda s: "/" + s)
option = st.text(alphabet=st.characters(blacklist_categories=("Cs", "Cc")), min_size=1,
                 max_size=20).map(lambda s: "--label=" + s)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mounts=st.lists(st.tuples(st.one_of(mount_path, st.sampled_from(["/$(touch {canary})", "/a b"])),
                                 mount_path, st.sampled_from(["", "ro", "rw,z"])), max_size=3),
       options=st.lists(st.one_of(option, st.sampled_from(["--cpus", "4", "$(touch {canary})",
                                                           "`id`", "a b"])), max_size=4))
def test_mounts_and_options_reach_the_runtime_unchanged(tmp_path_factory, mounts, options) -> None:
    tmp = tmp_path_factory.mktemp("boxopts")
    canary = tmp / "canary"
    mounts = [Mount(s.replace("{canary}", str(canary)), t, f) for s, t, f in mounts]
    options = [o.replace("{canary}", str(canary)) for o in options]
    _, argv = run_in_box(tmp, {}, [], {}, tuple(mounts), tuple(options))
    for m in mounts:
        at = argv.index(str(m))
        assert argv[at - 1] == "--volume"
    if options:
        start = argv.index(options[0])
        assert argv[start:start + len(options)] == options
    assert not canary.exists()


CONTAINER_TEXT = {"image": "{value}", "python": "{value}", "mounts": ["/a:/{value}"],
                  "options": ["--label={value}"]}


@settings(max_examples=80, deadline=None)
@given(field=st.sampled_from(sorted(CONTAINER_TEXT)), bad=CONTROL, after=text)
def test_container_fields_reject_control_characters(field: str, bad: str, after: str) -> None:
    box: dict = {"image": "x:1"}
    raw = CONTAINER_TEXT[field]
    bad_value = "v" + bad + after
    box[field] = ([r.replace("{value}", bad_value) for r in raw] if isinstance(raw, list)
                  else raw.replace("{value}", bad_value))
    source = yaml.safe_dump({"defaults": {"container": box}, "hosts": ["a"]}, allow_unicode=True,
                            default_style='"')
    with pytest.raises(InventoryError) as info:
        parse_yaml(source, "inv.yaml")
    assert info.value.key == field, str(info.value)
    assert str(info.value).startswith("inv.yaml:"), str(info.value)
