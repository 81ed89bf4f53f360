"""Property: any env value or script argument reaches the program byte for byte, and nothing
in it is executed by the shell. Real bash runs the rendered script; a stand-in python plays
torchrun and records what it received."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster.inventory import Host, Inventory, Network
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


def run_rendered(tmp: Path, env: dict[str, str], args: list[str]) -> dict:
    out = tmp / "received.json"
    fake = tmp / "fake-python"
    fake.write_text(STAND_IN.format(python=sys.executable, out=str(out)))
    fake.chmod(0o755)
    host = Host(name="n1", address="127.0.0.1", workdir=str(tmp), python=str(fake),
                nproc_per_node=1, network=Network(ifname="lo", ib="off"), env=tuple(env.items()))
    plan = render(Inventory(hosts=(host,)), Job(run_id="prop", script="train.py", args=tuple(args)),
                  Templates())
    script = tmp / "launch.sh"
    script.write_text(plan.nodes[0].script)
    res = subprocess.run(["bash", str(script)], capture_output=True, cwd=tmp,
                         env={"PATH": os.environ["PATH"], "HOME": str(tmp)})
    assert res.returncode == 0, res.stderr.decode(errors="replace")
    return json.loads(out.read_text())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(env=st.dictionaries(env_key, value, max_size=4), args=st.lists(value, max_size=5))
def test_values_arrive_unchanged_and_execute_nothing(tmp_path_factory, env, args) -> None:
    tmp = tmp_path_factory.mktemp("q")
    canary = tmp / "canary"
    env = {k: v.replace("{canary}", str(canary)) for k, v in env.items()}
    args = [a.replace("{canary}", str(canary)) for a in args]
    got = run_rendered(tmp, env, args)
    # argv: -m torch.distributed.run <torchrun options> train.py <args>
    script_at = got["argv"].index("train.py")
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
