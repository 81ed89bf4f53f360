"""Inventory: YAML, MPI/DeepSpeed hostfiles and SLURM hostlists -> one typed, validated Inventory.

Everything is checked here, once, at load: nothing downstream looks at raw dicts again. Errors
name the file, the line and the key, and suggest the nearest valid key.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import ipaddress
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import hostlist
import yaml

from .errors import InputError, InventoryError, Problems, did_you_mean
from .spec import (CONTAINER_RUNTIMES, DEFAULT_STOP_GRACE, ENV_KEY, HOSTNAME, Container, Host,
                   Inventory, Mount, Network, SlurmSettings, SshSettings, control_char, dump,
                   expand_names, host_from_dict, reserved_env, setup_block, slurm_from_dict,
                   ssh_from_dict)

HOST_SETTINGS = ("user", "port", "identity_file", "workdir", "python", "nproc_per_node",
                 "master_port", "rendezvous", "network", "env", "secret_env", "env_forward",
                 "setup", "torchrun_args", "gpus", "container")
# The same for every node (one rendezvous): set under defaults only, never per host.
JOB_WIDE = ("master_port", "rendezvous")
HOST_KEYS = ("name", "address") + tuple(k for k in HOST_SETTINGS if k not in JOB_WIDE)
TOP_KEYS = ("defaults", "hosts", "backend", "ssh", "slurm", "stop_grace", "restarts", "hang_timeout")
NETWORK_KEYS = ("ifname", "ib")
CONTAINER_KEYS = ("runtime", "image", "python", "mounts", "options")
SSH_KEYS = ("host_key_policy", "connect_timeout", "config", "keepalive")
SLURM_KEYS = ("partition", "account", "time", "nodes", "gpus_per_node", "cpus_per_task",
              "gpu_style", "signal", "max_requeues", "output_dir", "job_name", "constraint",
              "extra")
# torchrun options cluster decides itself (both spellings); torchrun_args may not set them.
TORCHRUN_OWNED = frozenset(o for name in ("nnodes", "nproc_per_node", "node_rank", "rdzv_backend",
                                          "rdzv_endpoint", "rdzv_id", "master_addr", "master_port",
                                          "local_addr", "standalone")
                           for o in (f"--{name}", f"--{name.replace('_', '-')}"))
# #SBATCH options slurm.extra may not hold: ones cluster writes itself (None), or ones that
# change what it renders, set with a slurm setting of their own.
SBATCH_OWNED = {"chdir": None, "output": None, "error": None, "open-mode": None, "ntasks": None,
                "ntasks-per-node": None, "array": None, "wrap": None, "hetjob": None,
                "packjob": None, "export": None, "parsable": None, "wait": None, "test-only": None,
                "signal": "signal", "requeue": "max_requeues", "no-requeue": "max_requeues",
                "nodes": "nodes", "gpus-per-node": "gpus_per_node", "gres": "gpus_per_node",
                "cpus-per-task": "cpus_per_task"}
# Options that are also a slurm setting, passed through as they are: one of the two, not both.
SBATCH_ALIASES = {"time": "time", "partition": "partition", "account": "account",
                  "constraint": "constraint", "job-name": "job_name"}
_SBATCH_KEY = re.compile(r"^[a-z][a-z0-9-]*$")
BACKENDS = ("ssh", "slurm", "local")
HOST_KEY_POLICIES = ("strict", "accept-new", "off")

_IFNAME = re.compile(r"^[=^]?[A-Za-z0-9_.:@-]+(,[A-Za-z0-9_.:@-]+)*$")
# An image reference as docker and podman take it (registry/path:tag@digest), or pyxis's
# forms (registry#path, a squashfs file): never a word the runtime would read as an option.
_IMAGE = re.compile(r"^[A-Za-z0-9/.][A-Za-z0-9._/:@#+-]*$")
_MOUNT_FLAGS = re.compile(r"^[A-Za-z0-9]+(,[A-Za-z0-9]+)*$")
# `RUNTIME run` options that would undo what cluster sets itself, and why. Matched on the
# option's name, alone or with '=value'; short ones also when combined (-it, -dit).
RESERVED_RUN_OPTIONS = {
    "--network": "host networking keeps the interface choice and MASTER_ADDR valid",
    "--net": "host networking keeps the interface choice and MASTER_ADDR valid",
    "--ipc": "host IPC gives NCCL and DataLoader workers the node's shared memory",
    "--shm-size": "with host IPC the container uses the node's /dev/shm (podman refuses both)",
    "--name": "the container is named after the run and node, which is how it is stopped",
    "--rm": "cluster removes the container itself",
    "--detach": "the node's supervisor follows the container to its end",
    "--interactive": "standard input carries the secret environment",
    "--tty": "standard input carries the secret environment",
    "--env": "values on a command line are visible in ps: use env or secret_env",
    "--env-file": "cluster writes the environment file itself: use env or secret_env",
    "--env-host": "the node's whole environment would leak into the container: use env",
}
RESERVED_SHORT_OPTIONS = {"d": "--detach", "i": "--interactive", "t": "--tty", "e": "--env"}
SHORT_BOOLEANS = "dit" + "P"          # docker's short flags that take no value: they combine


# --- loading -------------------------------------------------------------------------------


def load(path: str | Path) -> Inventory:
    """Read an inventory file: YAML (a mapping with 'hosts') or an MPI/DeepSpeed hostfile."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise InputError(f"cannot read inventory {path}: {exc.strerror}") from None
    if _looks_like_yaml(path, text):
        return parse_yaml(text, str(path))
    return parse_hostfile(text, str(path))


def from_hostnames(expr: str) -> Inventory:
    """`--hosts gpu[01-04]` with no inventory: SSH hosts with every setting at its default."""
    hosts = tuple(Host(name=n, address=n) for n in expand_names(expr, "--hosts"))
    _check_unique(hosts, "--hosts")
    return Inventory(hosts=hosts, source="--hosts")


def _looks_like_yaml(path: Path, text: str) -> bool:
    if path.suffix in (".yaml", ".yml"):
        return True
    if path.suffix in (".txt", ".hostfile") or path.name == "hostfile":
        return False
    return bool(re.search(r"^(hosts|defaults)\s*:", text, re.M))


def parse_hostfile(text: str, source: str) -> Inventory:
    """`worker-1 slots=4` (DeepSpeed, Open MPI) or `worker-1:4` (MPICH); `#` starts a comment.
    Every line is checked: all the problems are reported together."""
    hosts: list[Host] = []
    problems = Problems()
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if line:
            with problems.noted():
                hosts.extend(_hostfile_line(line, source, lineno))
    if not hosts and not problems.found:
        raise InventoryError(source, None, None, "no hosts found")
    with problems.noted():
        _check_unique(tuple(hosts), source)
    problems.check()
    return Inventory(hosts=tuple(hosts), source=source, text=text)


def _hostfile_line(line: str, source: str, lineno: int) -> list[Host]:
    words = line.split()
    name, slots = words[0], None
    if ":" in name:
        name, _, count = name.partition(":")
        slots = _slot_count(count, source, lineno)
    for word in words[1:]:
        key, eq, value = word.partition("=")
        if key == "slots" and eq:
            slots = _slot_count(value, source, lineno)
        elif key not in ("max_slots", "max-slots") or not eq:
            raise InventoryError(source, lineno, key, f"unknown hostfile field {word!r}",
                                 hint="expected 'NAME slots=N'")
    return [Host(name=n, address=n, line=lineno, nproc_per_node=slots if slots is not None else "auto",
                 gpus=slots) for n in _expand(name, source, lineno, "name")]


def _slot_count(value: str, source: str, lineno: int) -> int:
    if not value.isdigit() or int(value) < 1:
        raise InventoryError(source, lineno, "slots", f"must be a whole number >= 1, got {value!r}")
    return int(value)


def _expand(expr: str, source: str, lineno: int | None, key: str) -> list[str]:
    try:
        names = hostlist.expand_hostlist(expr)
    except hostlist.BadHostlist as exc:
        raise InventoryError(source, lineno, key, f"{expr!r} is not a valid host list ({exc})") from None
    for n in names:
        if not HOSTNAME.match(n):
            raise InventoryError(source, lineno, key, f"{n!r} is not a valid host name",
                                 hint="letters, digits, '-', '_' and '.'")
    return names


class _Located:
    """A YAML node turned into Python values, remembering the line of every key and item.
    A key that is not a string, or that is there twice, is noted and left out."""

    def __init__(self, source: str, problems: Problems) -> None:
        self.source, self.problems = source, problems
        self._loader = yaml.SafeLoader("")

    def value(self, node: yaml.Node) -> Any:
        if isinstance(node, yaml.MappingNode):
            out: dict[str, Any] = {}
            lines: dict[str, int] = {}
            for knode, vnode in node.value:
                key = self._loader.construct_object(knode, deep=True)
                line = knode.start_mark.line + 1
                problem = ("keys must be strings" if not isinstance(key, str) else
                           "duplicate key" if key in out else None)
                if problem:
                    self.problems.found.append(InventoryError(self.source, line, str(key), problem))
                    continue
                out[key] = self.value(vnode)
                lines[key] = line
            return _Map(out, lines, node.start_mark.line + 1)
        if isinstance(node, yaml.SequenceNode):
            return _List([self.value(n) for n in node.value],
                         [n.start_mark.line + 1 for n in node.value], node.start_mark.line + 1)
        return self._loader.construct_object(node, deep=True)


class _Map(dict):
    def __init__(self, data: dict, lines: dict[str, int], line: int) -> None:
        super().__init__(data)
        self.lines, self.line = lines, line


class _List(list):
    def __init__(self, data: list, lines: list[int], line: int) -> None:
        super().__init__(data)
        self.lines, self.line = lines, line


def parse_yaml(text: str, source: str) -> Inventory:
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        raise InventoryError(source, mark.line + 1 if mark else None, None,
                             f"not valid YAML: {getattr(exc, 'problem', exc)}") from None
    if root is None:
        raise InventoryError(source, None, None, "the file is empty")
    problems = Problems()
    data = _Located(source, problems).value(root)
    parsed: list[Inventory] = []
    with problems.noted():     # a problem the rest of the file depends on ends the load early
        parsed.append(_Parser(source, problems).inventory(data, text))
    problems.check()
    return parsed[0]


class _Parser:
    """Each key is checked on its own: a problem is noted (self.problems) and the next key
    checked, so one load reports every problem. Checks that combine keys run only on a file
    with no problem so far, so that one mistake is not reported twice."""

    def __init__(self, source: str, problems: Problems) -> None:
        self.source, self.problems = source, problems

    def fail(self, where: Any, key: str | None, problem: str, hint: str = "") -> InventoryError:
        line = where.lines.get(key, where.line) if isinstance(where, _Map) and key else getattr(where, "line", None)
        return InventoryError(self.source, line, key, problem, hint=hint)

    def known_keys(self, m: Any, allowed: Sequence[str], prefix: str = "") -> None:
        """Each key that is not allowed here is noted (the others are read on their own)."""
        for key in m:
            if key in JOB_WIDE and key not in allowed:
                self.problems.found.append(self.fail(m, key, f"'{key}' is the same for every node of a job",
                                                     "set it under 'defaults', not on one host"))
            elif key not in allowed:
                self.problems.found.append(self.fail(m, key, f"unknown key '{prefix}{key}'",
                                                     did_you_mean(key, allowed)))

    def read(self, m: _Map, readers: Mapping[str, Callable[[str], Any]]) -> dict[str, Any]:
        """Each key of m that has a reader, read on its own: one that fails is noted and left
        out, and the next one is read."""
        out: dict[str, Any] = {}
        for key in m:
            if key in readers:
                with self.problems.noted():
                    out[key] = readers[key](key)
        return out

    def clean(self) -> bool:
        """No problem so far: checks that combine keys may run."""
        return not self.problems.found

    def mapping(self, value: Any, where: Any, key: str) -> _Map:
        if not isinstance(value, _Map):
            raise self.fail(where, key, f"must be a mapping, got {type(value).__name__}")
        return value

    def inventory(self, data: Any, text: str) -> Inventory:
        if not isinstance(data, _Map):
            raise InventoryError(self.source, 1, None, "an inventory is a mapping with 'hosts'")
        self.known_keys(data, TOP_KEYS)
        keys_known = self.clean()
        top = self.read(data, {
            "backend": lambda k: self.choice(data, k, BACKENDS),
            "defaults": lambda k: self.mapping(data[k], data, k),
            "ssh": lambda k: self.ssh(self.mapping(data[k], data, k)),
            "slurm": lambda k: self.slurm(self.mapping(data[k], data, k)),
            "stop_grace": lambda k: self.seconds(data, k),
            "restarts": lambda k: self.integer(data, k, minimum=0),
            "hang_timeout": lambda k: self.seconds(data, k)})
        defaults = top.get("defaults", _Map({}, {}, 1))
        self.known_keys(defaults, HOST_SETTINGS, "defaults.")
        base = self.settings(defaults, Host(name="-", address="-"), HOST_SETTINGS)
        hosts: tuple[Host, ...] = ()
        given = True
        if top.get("backend") == "slurm" and not data.get("hosts"):
            # SLURM chooses the nodes: one placeholder host carries the defaults.
            hosts, given = (base.replace(name="slurm", address="slurm"),), False
        elif "hosts" not in data:
            # Not after a misspelt key (it may be 'hosts') or a bad backend (slurm needs none).
            if keys_known and ("backend" in top or "backend" not in data):
                self.problems.found.append(InventoryError(self.source, data.line, "hosts",
                                                          "missing required key 'hosts'"))
        else:
            with self.problems.noted():
                hosts = self.hosts(data["hosts"], data, base)
        self.problems.check()
        return Inventory(hosts=hosts, source=self.source, backend=top.get("backend", "ssh"),
                         ssh=top.get("ssh", SshSettings()), slurm=top.get("slurm", SlurmSettings()),
                         stop_grace=top.get("stop_grace", DEFAULT_STOP_GRACE),
                         restarts=top.get("restarts", 0), hang_timeout=top.get("hang_timeout", 0.0),
                         text=text, hosts_given=given)

    def hosts(self, value: Any, where: _Map, base: Host) -> tuple[Host, ...]:
        if not isinstance(value, _List) or not value:
            raise self.fail(where, "hosts", "must be a non-empty list of hosts")
        out: list[Host] = []
        for item, line in zip(value, value.lines):
            with self.problems.noted():
                out.extend(self.host(item, line, base))
        _check_unique(tuple(out), self.source)
        return tuple(out)

    def host(self, item: Any, line: int, base: Host) -> list[Host]:
        """One item of `hosts`: a hostlist name makes several hosts."""
        if isinstance(item, str):
            item = _Map({"name": item}, {"name": line}, line)
        if not isinstance(item, _Map):
            raise InventoryError(self.source, line, "hosts", "each host is a name or a mapping")
        self.known_keys(item, HOST_KEYS)
        if "name" not in item:
            raise self.fail(item, None, "host needs a 'name'", "e.g. {name: gpu-a, address: 10.0.0.11}")
        host = self.settings(item, base, HOST_KEYS)
        names: list[str] = []
        with self.problems.noted():
            names = _expand(self.string(item, "name"), self.source, item.lines["name"], "name")
        address = None
        if "address" in item:
            with self.problems.noted():
                if len(names) > 1:
                    raise self.fail(item, "address", "a host list expands to several hosts; "
                                    "they cannot share one address")
                address = self.address(item)
        return [host.replace(name=n, address=address or n, line=item.line) for n in names]

    def settings(self, m: _Map, base: Host, allowed: Sequence[str]) -> Host:
        """The host-level keys of one mapping (defaults or a host) applied over `base`."""
        string, port = (lambda k: self.string(m, k)), (lambda k: self.port(m, k))
        readers: dict[str, Callable[[str], Any]] = {
            "user": string, "port": port, "master_port": port, "identity_file": string,
            "workdir": string, "python": string, "nproc_per_node": lambda k: self.nproc(m),
            "rendezvous": lambda k: self.choice(m, k, ("c10d", "static")),
            "gpus": lambda k: self.integer(m, k, minimum=0),
            "network": lambda k: self.network(self.mapping(m[k], m, k), base.network),
            "container": lambda k: self.container(self.mapping(m[k], m, k), base.container),
            "env": lambda k: tuple({**dict(base.env), **self.env(self.mapping(m[k], m, k))}.items()),
            "secret_env": lambda k: tuple(dict.fromkeys(base.secret_env + tuple(self.secret_names(m)))),
            # added to the defaults' names, like env
            "env_forward": lambda k: tuple(dict.fromkeys(base.env_forward + tuple(self.forward_names(m)))),
            "setup": lambda k: self.setup(m),       # a host's own setup replaces the defaults'
            "torchrun_args": lambda k: self.torchrun_args(m)}
        changes = self.read(m, {k: read for k, read in readers.items() if k in allowed})
        host = base.replace(**changes)
        if self.clean():
            with self.problems.noted():
                self.settings_agree(m, host)
        return host

    def settings_agree(self, m: _Map, host: Host) -> None:
        """Checks that combine keys (of this mapping and the defaults under it)."""
        if host.python == "auto" and not host.setup:
            raise self.fail(m, "python", "'auto' takes the python that 'setup' leaves on PATH, "
                            "and there is no setup", "add setup lines, or name the interpreter")
        both = sorted(set(host.secret_env) & set(dict(host.env)))
        if both:
            key = "secret_env" if "secret_env" in m else "env"
            raise self.fail(m, key, f"{', '.join(both)} is in both 'env' and 'secret_env'",
                            "a secret's value comes from the launching shell; remove it from 'env'")

    def strings(self, m: _Map, key: str, example: str) -> list[tuple[str, int]]:
        """A list of strings (each checked for control characters), with each item's line."""
        value = m[key]
        if not isinstance(value, _List) or not all(isinstance(v, (str, int, float)) and
                                                   not isinstance(v, bool) for v in value):
            raise self.fail(m, key, "must be a list of strings", f"e.g. {example}")
        for item, line in zip(value, value.lines):
            bad = control_char(str(item))
            if bad:
                raise InventoryError(self.source, line, key, f"control character {bad} in {str(item)!r}")
        return [(str(v), line) for v, line in zip(value, value.lines)]

    def forward_names(self, m: _Map) -> list[str]:
        items = self.strings(m, "env_forward", "[WANDB_API_KEY, 'NCCL_*']")
        for name, line in items:
            if not re.match(r"^[A-Za-z_*?][A-Za-z0-9_*?]*$", name):
                raise InventoryError(self.source, line, "env_forward",
                                     f"{name!r} is not an environment variable name or glob")
            why = reserved_env(name) if "*" not in name and "?" not in name else None
            if why:
                raise InventoryError(self.source, line, "env_forward", why)
        return [name for name, _ in items]

    def setup(self, m: _Map) -> tuple[str, ...]:
        """Shell lines, as written; `bash -n` finds a syntax error at load, with its line."""
        items = self.strings(m, "setup", "['module load cuda/12.4', 'source ~/venvs/a/bin/activate']")
        problem = bash_syntax([line for line, _ in items])
        if problem:
            index, text = problem
            line = items[index][1] if index is not None and index < len(items) else m.lines["setup"]
            raise InventoryError(self.source, line, "setup", f"not valid shell: {text}")
        return tuple(line for line, _ in items)

    def torchrun_args(self, m: _Map) -> tuple[str, ...]:
        items = self.strings(m, "torchrun_args", "['--monitor-interval=1', '--log-dir=logs']")
        for arg, line in items:
            option = arg.split("=", 1)[0]
            if option in TORCHRUN_OWNED:
                raise InventoryError(self.source, line, "torchrun_args",
                                     f"{option} is set by cluster itself (nodes, ranks and the "
                                     f"rendezvous are its own)")
        return tuple(arg for arg, _ in items)

    def slurm_extra(self, m: _Map) -> tuple[tuple[str, str | None], ...]:
        extra = self.mapping(m["extra"], m, "extra")
        out: list[tuple[str, str | None]] = []
        for key, value in sorted(extra.items()):
            if not _SBATCH_KEY.match(key):
                raise self.fail(extra, key, f"{key!r} is not an sbatch option name",
                                "the long option without its dashes, e.g. qos, mem, reservation")
            if key in SBATCH_OWNED:
                own = SBATCH_OWNED[key]
                raise self.fail(extra, key, f"--{key} is " + (f"set with slurm.{own}" if own else
                                                              "written by cluster itself"))
            if SBATCH_ALIASES.get(key) in m:
                raise self.fail(extra, key, f"--{key} is set twice: here and as "
                                f"slurm.{SBATCH_ALIASES[key]}", "keep one")
            if value is True or value is None:
                out.append((key, None))                 # a flag: --exclusive
            elif value is False:
                continue
            elif isinstance(value, (str, int, float)):
                text = str(value)
                bad = control_char(text)
                if bad:
                    raise self.fail(extra, key, f"control character {bad} in {text!r}")
                out.append((key, text))
            else:
                raise self.fail(extra, key, "must be a string, a number or true (a flag)")
        return tuple(out)

    def secret_names(self, m: _Map) -> list[str]:
        value = m["secret_env"]
        if not isinstance(value, _List) or not all(isinstance(v, str) for v in value):
            raise self.fail(m, "secret_env", "must be a list of environment variable names",
                            "e.g. [HF_TOKEN, WANDB_API_KEY]")
        for name, line in zip(value, value.lines):
            if not ENV_KEY.match(name):
                raise InventoryError(self.source, line, "secret_env",
                                     f"{name!r} is not a valid environment variable name")
            why = reserved_env(name)
            if why:
                raise InventoryError(self.source, line, "secret_env", why)
        return list(value)

    def network(self, m: _Map, base: Network) -> Network:
        self.known_keys(m, NETWORK_KEYS, "network.")
        ifname, ib = base.ifname, base.ib
        if "ifname" in m:
            ifname = self.string(m, "ifname")
            if not _IFNAME.match(ifname):
                raise self.fail(m, "ifname", f"{ifname!r} is not an interface name or NCCL list",
                                "e.g. eth0, ib0, ^docker0,lo")
        if "ib" in m:
            raw = m["ib"]
            ib = {True: "on", False: "off"}.get(raw, raw)  # YAML 1.1 reads on/off as booleans
            if ib not in ("auto", "on", "off"):
                raise self.fail(m, "ib", f"must be auto, on or off, got {raw!r}")
        return Network(ifname=ifname, ib=ib)

    def container(self, m: _Map, base: Container | None) -> Container:
        """`container:` over the defaults' one, key by key (a host may change the image alone)."""
        self.known_keys(m, CONTAINER_KEYS, "container.")
        fields: dict[str, Any] = {}
        if base is not None:
            fields.update(image=base.image, runtime=base.runtime, python=base.python,
                          mounts=base.mounts, options=base.options)
        if "runtime" in m:
            fields["runtime"] = self.choice(m, "runtime", CONTAINER_RUNTIMES)
        if "image" in m:
            fields["image"] = self.string(m, "image")
            if not _IMAGE.match(fields["image"]):
                raise self.fail(m, "image", f"{fields['image']!r} is not an image reference",
                                "e.g. nvcr.io/nvidia/pytorch:24.05-py3")
        if "python" in m:
            fields["python"] = self.string(m, "python")
        if "mounts" in m:
            fields["mounts"] = tuple(self.mount(text, line) for text, line
                                     in self.strings(m, "mounts", "[/datasets:/datasets:ro]"))
        if "options" in m:
            options = self.strings(m, "options", "one word each, e.g. [--ulimit, stack=67108864]")
            for text, line in options:
                self.run_option(text, line)
            fields["options"] = tuple(text for text, _ in options)
        if "image" not in fields:
            raise InventoryError(self.source, m.line, "container", "a container needs an 'image'",
                                 hint="e.g. container: {runtime: docker, image: "
                                 "nvcr.io/nvidia/pytorch:24.05-py3}")
        return Container(**fields)

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

    def run_option(self, text: str, line: int) -> None:
        if not text:
            raise InventoryError(self.source, line, "options", "an empty option",
                                 hint="one word each, e.g. [--ulimit, stack=67108864]")
        name = text.split("=", 1)[0] if text.startswith("--") else _short_reserved(text)
        why = RESERVED_RUN_OPTIONS.get(name or "")
        if why:
            raise InventoryError(self.source, line, "options",
                                 f"{text!r} is not allowed: {why}")

    def env(self, m: _Map) -> dict[str, str]:
        out: dict[str, str] = {}
        for key, value in m.items():
            with self.problems.noted():
                out[key] = self.env_value(m, key, value)
        return out

    def env_value(self, m: _Map, key: str, value: Any) -> str:
        if not ENV_KEY.match(key):
            raise self.fail(m, key, f"environment variable name {key!r} is not a valid identifier",
                            "letters, digits and '_', not starting with a digit")
        why = reserved_env(key)
        if why:
            raise self.fail(m, key, why)
        if value is None or isinstance(value, (_Map, _List)):
            raise self.fail(m, key, "environment values must be strings or numbers")
        if isinstance(value, bool):
            value = "1" if value else "0"
        return str(value)

    def ssh(self, m: _Map) -> SshSettings:
        self.known_keys(m, SSH_KEYS, "ssh.")
        return SshSettings(**self.read(m, {
            "host_key_policy": lambda k: self.choice(m, k, HOST_KEY_POLICIES),
            "connect_timeout": lambda k: self.seconds(m, k), "config": lambda k: self.string(m, k),
            "keepalive": lambda k: self.seconds(m, k)}))

    def slurm(self, m: _Map) -> SlurmSettings:
        self.known_keys(m, SLURM_KEYS, "slurm.")
        readers: dict[str, Callable[[str], Any]] = {
            key: (lambda k: self.string(m, k)) for key in
            ("partition", "account", "time", "output_dir", "job_name", "constraint")}
        readers.update({key: (lambda k: self.integer(m, k, minimum=1))
                        for key in ("nodes", "gpus_per_node", "cpus_per_task")})
        readers.update(max_requeues=lambda k: self.integer(m, k, minimum=0),
                       gpu_style=lambda k: self.choice(m, k, ("gpus", "gres")),
                       extra=lambda k: self.slurm_extra(m), signal=lambda k: self.slurm_signal(m))
        return SlurmSettings(**self.read(m, readers))

    def slurm_signal(self, m: _Map) -> str:
        signal = self.string(m, "signal")
        if not re.match(r"^(B:)?[A-Z0-9]+(@\d+)?$", signal):
            raise self.fail(m, "signal", f"{signal!r} is not a SLURM --signal value",
                            "e.g. USR2@90 or B:USR2@90")
        if signal.removeprefix("B:").split("@")[0] in ("USR1", "SIGUSR1"):
            raise self.fail(m, "signal", "USR1 is used by NCCL; pick another signal", "e.g. USR2@90")
        return signal

    # -- scalars --

    def string(self, m: _Map, key: str) -> str:
        value = m[key]
        if isinstance(value, bool) or not isinstance(value, (str, int, float)) or value == "":
            raise self.fail(m, key, f"must be a non-empty string, got {value!r}")
        bad = control_char(str(value))
        if bad:
            raise self.fail(m, key, f"control character {bad} in {str(value)!r}",
                            "fields that reach a script may not hold newlines or other control characters")
        return str(value)

    def seconds(self, m: _Map, key: str) -> float:
        value = m[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise self.fail(m, key, f"must be a positive number of seconds, got {value!r}")
        return float(value)

    def integer(self, m: _Map, key: str, minimum: int) -> int:
        value = m[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.fail(m, key, f"must be a whole number >= {minimum}, got {value!r}")
        return value

    def port(self, m: _Map, key: str) -> int:
        value = m[key]
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
            raise self.fail(m, key, f"must be a port number from 1 to 65535, got {value!r}")
        return value

    def nproc(self, m: _Map) -> int | str:
        value = m["nproc_per_node"]
        if value == "auto":
            return value
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise self.fail(m, "nproc_per_node", f"must be 'auto' or a whole number >= 1, got {value!r}")
        return value

    def choice(self, m: _Map, key: str, choices: Sequence[str]) -> str:
        value = m[key]
        if value not in choices:
            raise self.fail(m, key, f"must be one of {', '.join(choices)}, got {value!r}")
        return value

    def address(self, m: _Map) -> str:
        value = self.string(m, "address")
        try:
            ipaddress.ip_address(value)
            return value
        except ValueError:
            pass
        if not HOSTNAME.match(value):
            raise self.fail(m, "address", f"{value!r} is neither an IP address nor a host name")
        return value


def bash_syntax(lines: list[str]) -> tuple[int | None, str] | None:
    """bash -n of the setup lines as the node will run them (spec.setup_block): None when they
    parse, else (the index of the line bash names, its message)."""
    import subprocess
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


def _short_reserved(word: str) -> str | None:
    """The reserved long option a short-option word sets (-it: --interactive), else None.
    Boolean letters combine; the first letter that takes a value ends the word (-v/data:/d)."""
    if not word.startswith("-"):
        return None
    for letter in word[1:]:
        if letter in RESERVED_SHORT_OPTIONS:
            return RESERVED_SHORT_OPTIONS[letter]
        if letter not in SHORT_BOOLEANS:
            return None
    return None


def _check_unique(hosts: tuple[Host, ...], source: str | None) -> None:
    """Every host named twice, or at an address another host has, reported together."""
    problems = Problems()
    seen_names: dict[str, Host] = {}
    seen_addrs: dict[str, Host] = {}
    for h in hosts:
        if h.name in seen_names:
            problems.found.append(InventoryError(source, h.line, "name", f"duplicate host name "
                                                 f"{h.name!r} (first defined on line {seen_names[h.name].line})"))
        elif h.address in seen_addrs:
            problems.found.append(InventoryError(source, h.line, "address", f"duplicate address "
                                                 f"{h.address!r} (also host {seen_addrs[h.address].name!r})"))
        seen_names.setdefault(h.name, h)
        seen_addrs.setdefault(h.address, h)
    problems.check()


__all__ = ["Host", "Inventory", "Network", "SlurmSettings", "SshSettings", "load", "parse_yaml",
           "parse_hostfile", "from_hostnames", "expand_names", "dump", "host_from_dict",
           "ssh_from_dict", "slurm_from_dict"]


# --- values from the launching shell ----------------------------------------------------------


def forward_env(inventory: Inventory, environ: Mapping[str, str]) -> Inventory:
    """Each host's env_forward names and globs, copied from the launching shell into its env
    (over the inventory's own values). A plain name that is not set is an error; a glob may
    match nothing. Never the secret names (their values go over the connection), never a name
    cluster sets itself."""
    hosts = []
    for host in inventory.hosts:
        if not host.env_forward:
            hosts.append(host)
            continue
        where = f"{inventory.source or 'inventory'}" + (f":{host.line}" if host.line else "")
        values: dict[str, str] = {}
        for pattern in host.env_forward:
            if not any(c in pattern for c in "*?"):
                if pattern in host.secret_env:
                    raise InputError(f"{where}: env_forward: {pattern} is also a secret_env name; "
                                     "keep it in secret_env only (never written to a file)")
                if pattern not in environ:
                    raise InputError(f"{where}: env_forward: {pattern} is not set in this shell "
                                     f"(host {host.name}); export it, or take it out of env_forward")
                values[pattern] = environ[pattern]
                continue
            for name in sorted(environ):
                if (fnmatch.fnmatchcase(name, pattern) and ENV_KEY.match(name)
                        and name not in host.secret_env and not reserved_env(name)):
                    values[name] = environ[name]
        hosts.append(host.replace(env=tuple({**dict(host.env), **values}.items())))
    return dataclasses.replace(inventory, hosts=tuple(hosts))


_DOTENV = re.compile(r"^\s*(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)\s*=\s*(.*?)\s*$")
_DOUBLE_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", '"': '"', "\\": "\\", "$": "$"}


def load_env_file(path: str | Path) -> dict[str, str]:
    """A dotenv file: KEY=VALUE lines (`export ` allowed), # comments, blank lines; a value is
    as written, or in '…' (literal) or "…" (with \\n \\t \\" \\\\ escapes); nothing is expanded,
    so $HOME stays $HOME. Errors name the file and line."""
    source = str(path)
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"Invalid value for --env-file: cannot read {source}: {exc}") from None
    out: dict[str, str] = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        m = _DOTENV.match(line)
        if not m:
            raise InventoryError(source, lineno, None, "expected KEY=VALUE (KEY letters, digits "
                                 "and '_', not starting with a digit)")
        key, raw = m.groups()
        why = reserved_env(key)
        if why:
            raise InventoryError(source, lineno, key, why)
        out[key] = _dotenv_value(raw, source, lineno, key)
    return out


def _dotenv_value(raw: str, source: str, lineno: int, key: str) -> str:
    if raw[:1] in ("'", '"'):
        quote = raw[0]
        end = _closing_quote(raw, quote)
        rest = raw[end + 1:].strip() if end is not None else ""
        if end is None or (rest and not rest.startswith("#")):
            raise InventoryError(source, lineno, key, f"unterminated or trailing text after {quote}…{quote}")
        body = raw[1:end]
        if quote == "'":
            return body
        return re.sub(r"\\(.)", lambda e: _DOUBLE_ESCAPES.get(e.group(1), "\\" + e.group(1)), body)
    value = re.split(r"\s+#", raw, maxsplit=1)[0]         # an unquoted value ends at ' #'
    bad = control_char(value)
    if bad:
        raise InventoryError(source, lineno, key, f"control character {bad}")
    return value


def _closing_quote(raw: str, quote: str) -> int | None:
    i = 1
    while i < len(raw):
        if raw[i] == "\\" and quote == '"':
            i += 2
            continue
        if raw[i] == quote:
            return i
        i += 1
    return None
