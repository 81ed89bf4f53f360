"""The readers that check one inventory key each. A key's declaration in cluster.spec names its
reader (`check`) and the reader's arguments; each takes the mapping that holds the key and the
key's name, and returns the key's value or raises InventoryError with the file's line."""
from __future__ import annotations

import re
import subprocess
from collections.abc import Sequence
from typing import Any

from ..container_options import reserved_run_option
from ..errors import InventoryError, Problems
from ..sbatch_options import SBATCH_ALIASES, SBATCH_KEY, SBATCH_OWNED
from ..spec import GATE_LEVELS, Mount, setup_block
from ..texts import (ENV_KEY, address_problem, control_char, env_problem, reserved_env,
                     url_problem)
from ..torchrun_options import owned_torchrun_option
from .loader import List, Map

_MOUNT_FLAGS = re.compile(r"^[A-Za-z0-9]+(,[A-Za-z0-9]+)*\Z")


class Checks:
    """Readers by name (a key's `check`), over one file's problems."""

    def __init__(self, source: str, problems: Problems) -> None:
        self.source, self.problems = source, problems

    def fail(self, where: Any, key: str | None, problem: str, hint: str = "") -> InventoryError:
        line = where.lines.get(key, where.line) if isinstance(where, Map) and key else getattr(where, "line", None)
        return InventoryError(self.source, line, key, problem, hint=hint)

    def clean(self) -> bool:
        """No problem so far: checks that combine keys may run."""
        return not self.problems.found

    def mapping(self, value: Any, where: Any, key: str) -> Map:
        if not isinstance(value, Map):
            got = "list" if isinstance(value, List) else type(value).__name__
            raise self.fail(where, key, f"must be a mapping, got {got}")
        return value

    # -- scalars --

    def string(self, m: Map, key: str) -> str:
        value = m[key]
        if isinstance(value, bool) or not isinstance(value, (str, int, float)) or value == "":
            raise self.fail(m, key, f"must be a non-empty string, got {value!r}")
        bad = control_char(str(value))
        if bad:
            raise self.fail(m, key, f"control character {bad} in {str(value)!r}",
                            "fields that reach a script may not hold newlines or other control characters")
        return str(value)

    def matching(self, m: Map, key: str, pattern: re.Pattern, what: str, example: str) -> str:
        """A string the pattern matches (an interface name, an image reference)."""
        value = self.string(m, key)
        if not pattern.match(value):
            raise self.fail(m, key, f"{value!r} is not {what}", example)
        return value

    def seconds(self, m: Map, key: str) -> float:
        value = m[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise self.fail(m, key, f"must be a positive number of seconds, got {value!r}")
        return float(value)

    def hang_timeout(self, m: Map, key: str) -> float | str:
        """'auto' (learned from the heartbeats) or a positive number of seconds."""
        value = m[key]
        if value == "auto":
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise self.fail(m, key, f"must be 'auto' or a positive number of seconds, got {value!r}")
        return float(value)

    def number(self, m: Map, key: str, minimum: float) -> float:
        value = m[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= minimum:
            raise self.fail(m, key, f"must be a number >= {minimum:g}, got {value!r}")
        return float(value)

    def integer(self, m: Map, key: str, minimum: int) -> int:
        value = m[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.fail(m, key, f"must be a whole number >= {minimum}, got {value!r}")
        return value

    def port(self, m: Map, key: str) -> int:
        value = m[key]
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
            raise self.fail(m, key, f"must be a port number from 1 to 65535, got {value!r}")
        return value

    def listen_port(self, m: Map, key: str) -> int:
        """A port to listen on: 0 is any free one."""
        value = m[key]
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535:
            raise self.fail(m, key, f"must be a port number from 0 to 65535 (0: any free port), "
                            f"got {value!r}")
        return value

    def bind_address(self, m: Map, key: str) -> str:
        """An address this machine listens on: an IP address (0.0.0.0: every interface) or a
        host name (localhost)."""
        value = self.string(m, key)
        why = address_problem(value)
        if why:
            raise self.fail(m, key, why, "e.g. 127.0.0.1, or 0.0.0.0 for every interface")
        return value

    def nproc(self, m: Map, key: str) -> int | str:
        value = m[key]
        if value == "auto":
            return value
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise self.fail(m, key, f"must be 'auto' or a whole number >= 1, got {value!r}")
        return value

    def choice(self, m: Map, key: str, choices: Sequence[str]) -> str:
        value = m[key]
        if value not in choices:
            raise self.fail(m, key, f"must be one of {', '.join(choices)}, got {value!r}")
        return value

    def boolean(self, m: Map, key: str) -> bool:
        value = m[key]
        if not isinstance(value, bool):
            raise self.fail(m, key, f"must be true or false, got {value!r}")
        return value

    def gate_level(self, m: Map, key: str) -> str:
        """off, basic or deep; YAML 1.1 reads a bare off as false, taken as it was meant."""
        raw = m[key]
        value = "off" if raw is False else raw
        if value not in GATE_LEVELS:
            raise self.fail(m, key, f"must be one of {', '.join(GATE_LEVELS)}, got {raw!r}")
        return value

    def switch(self, m: Map, key: str) -> str:
        """auto, on or off; YAML 1.1 reads on/off as booleans, taken as they were meant."""
        raw = m[key]
        value = {True: "on", False: "off"}.get(raw, raw)
        if value not in ("auto", "on", "off"):
            raise self.fail(m, key, f"must be auto, on or off, got {raw!r}")
        return value

    # -- lists --

    def strings(self, m: Map, key: str, example: str) -> list[tuple[str, int]]:
        """A list of strings (each checked for control characters), with each item's line."""
        value = m[key]
        if not isinstance(value, List) or not all(isinstance(v, (str, int, float)) and
                                                  not isinstance(v, bool) for v in value):
            raise self.fail(m, key, "must be a list of strings", f"e.g. {example}")
        for item, line in zip(value, value.lines):
            bad = control_char(str(item))
            if bad:
                raise InventoryError(self.source, line, key, f"control character {bad} in {str(item)!r}")
        return [(str(v), line) for v, line in zip(value, value.lines)]

    def forward_names(self, m: Map, key: str) -> list[str]:
        items = self.strings(m, key, "[WANDB_API_KEY, 'NCCL_*']")
        for name, line in items:
            if not re.match(r"^[A-Za-z_*?][A-Za-z0-9_*?]*\Z", name):
                raise InventoryError(self.source, line, key,
                                     f"{name!r} is not an environment variable name or glob")
            why = reserved_env(name) if "*" not in name and "?" not in name else None
            if why:
                raise InventoryError(self.source, line, key, why)
        return [name for name, _ in items]

    def secret_names(self, m: Map, key: str) -> list[str]:
        value = m[key]
        if not isinstance(value, List) or not all(isinstance(v, str) for v in value):
            raise self.fail(m, key, "must be a list of environment variable names",
                            "e.g. [HF_TOKEN, WANDB_API_KEY]")
        for name, line in zip(value, value.lines):
            if not ENV_KEY.match(name):
                raise InventoryError(self.source, line, key,
                                     f"{name!r} is not a valid environment variable name")
            why = reserved_env(name)
            if why:
                raise InventoryError(self.source, line, key, why)
        return list(value)

    def urls(self, m: Map, key: str) -> tuple[str, ...]:
        """http(s) URLs (notify), each shown redacted in a problem: its path may be a token."""
        value = m[key]
        example = "e.g. [https://hooks.slack.com/services/T000/B000/XXXX]"
        if not isinstance(value, List) or not all(isinstance(v, str) for v in value):
            raise self.fail(m, key, "must be a list of URLs", example)
        for url, line in zip(value, value.lines):
            why = url_problem(url)
            if why:
                raise InventoryError(self.source, line, key, why, hint=example)
        return tuple(dict.fromkeys(value))

    def setup(self, m: Map, key: str) -> tuple[str, ...]:
        """Shell lines, as written; `bash -n` finds a syntax error at load, with its line."""
        items = self.strings(m, key, "['module load cuda/12.4', 'source ~/venvs/a/bin/activate']")
        problem = bash_syntax([line for line, _ in items])
        if problem:
            index, text = problem
            line = items[index][1] if index is not None and index < len(items) else m.lines[key]
            raise InventoryError(self.source, line, key, f"not valid shell: {text}")
        return tuple(line for line, _ in items)

    def torchrun_args(self, m: Map, key: str) -> tuple[str, ...]:
        items = self.strings(m, key, "['--monitor-interval=1', '--log-dir=logs']")
        for arg, line in items:
            option = owned_torchrun_option(arg)
            if option:
                raise InventoryError(self.source, line, key,
                                     f"{option} is set by cluster itself (nodes, ranks and the "
                                     f"rendezvous are its own)")
        return tuple(arg for arg, _ in items)

    def mounts(self, m: Map, key: str) -> tuple[Mount, ...]:
        return tuple(self.mount(text, line) for text, line
                     in self.strings(m, key, "[/datasets:/datasets:ro]"))

    def mount(self, text: str, line: int) -> Mount:
        parts = text.split(":")
        problem = ""
        if len(parts) not in (2, 3):
            problem = "is not SRC:DST or SRC:DST:FLAGS (paths may not hold ':')"
        elif not (parts[0].startswith(("/", "~")) and parts[1].startswith("/")):
            problem = "needs an absolute source (or ~/...) and an absolute target"
        elif any("," in p for p in parts[:2]):
            problem = "paths may not hold ',' (docker's --mount and pyxis split on it)"
        elif len(parts) == 3 and not _MOUNT_FLAGS.match(parts[2]):
            problem = f"flags {parts[2]!r} are not comma-separated words (ro, rw, z, ...)"
        if problem:
            raise InventoryError(self.source, line, "mounts", f"{text!r} {problem}",
                                 hint="e.g. /data:/data:ro")
        return Mount(*parts)

    def run_options(self, m: Map, key: str) -> tuple[str, ...]:
        example = "one word each, e.g. [--ulimit, stack=67108864]"
        options = self.strings(m, key, example)
        for text, line in options:
            if not text:
                raise InventoryError(self.source, line, key, "an empty option", hint=example)
            why = reserved_run_option(text)
            if why:
                raise InventoryError(self.source, line, key, f"{text!r} is not allowed: {why}")
        return tuple(text for text, _ in options)

    # -- mappings --

    def env(self, m: Map, key: str) -> dict[str, str]:
        env = self.mapping(m[key], m, key)
        out: dict[str, str] = {}
        for name, value in env.items():
            with self.problems.noted():
                out[name] = self.env_value(env, name, value)
        return out

    def env_value(self, m: Map, key: str, value: Any) -> str:
        if not isinstance(key, str) or value is None or isinstance(value, (Map, List)):
            raise self.fail(m, key, "environment values must be strings or numbers")
        if isinstance(value, bool):
            value = "1" if value else "0"
        why = env_problem(key, str(value))
        if why:
            raise self.fail(m, key, why)
        return str(value)

    # -- slurm --

    def slurm_signal(self, m: Map, key: str) -> str:
        signal = self.string(m, key)
        if not re.match(r"^(B:)?[A-Z0-9]+(@\d+)?\Z", signal):
            raise self.fail(m, key, f"{signal!r} is not a SLURM --signal value",
                            "e.g. USR2@90 or B:USR2@90")
        if signal.removeprefix("B:").split("@")[0] in ("USR1", "SIGUSR1"):
            raise self.fail(m, key, "USR1 is used by NCCL; pick another signal", "e.g. USR2@90")
        return signal

    def slurm_extra(self, m: Map, key: str) -> tuple[tuple[str, str | None], ...]:
        extra = self.mapping(m[key], m, key)
        out: list[tuple[str, str | None]] = []
        for name, value in sorted(extra.items()):
            if not SBATCH_KEY.match(name):
                raise self.fail(extra, name, f"{name!r} is not an sbatch option name",
                                "the long option without its dashes, e.g. qos, mem, reservation")
            if name in SBATCH_OWNED:
                own = SBATCH_OWNED[name]
                raise self.fail(extra, name, f"--{name} is " + (f"set with slurm.{own}" if own else
                                                                "written by cluster itself"))
            if SBATCH_ALIASES.get(name) in m:
                raise self.fail(extra, name, f"--{name} is set twice: here and as "
                                f"slurm.{SBATCH_ALIASES[name]}", "keep one")
            if value is True or value is None:
                out.append((name, None))                 # a flag: --exclusive
            elif value is False:
                continue
            elif isinstance(value, (str, int, float)):
                text = str(value)
                bad = control_char(text)
                if bad:
                    raise self.fail(extra, name, f"control character {bad} in {text!r}")
                out.append((name, text))
            else:
                raise self.fail(extra, name, "must be a string, a number or true (a flag)")
        return tuple(out)


def bash_syntax(lines: list[str]) -> tuple[int | None, str] | None:
    """bash -n of the setup lines as the node will run them (spec.setup_block): None when they
    parse, else (the index of the line bash names, its message)."""
    try:
        res = subprocess.run(["bash", "-n"], input=setup_block(lines) + "\n", capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None                      # no bash here: the node will say so
    if res.returncode == 0:
        return None
    m = re.search(r"line (\d+): (.*)", res.stderr)
    if not m:
        return None, res.stderr.strip()
    # Line 1 is `set +u`; each setup line then takes two: `{ line` and its failure handler.
    return max(0, (int(m.group(1)) - 2) // 2), m.group(2).strip()
