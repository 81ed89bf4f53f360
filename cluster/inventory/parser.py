"""An inventory's YAML -> one typed, validated Inventory, by walking the key declarations of
cluster.spec (each field's key(): its check, merge rule and where it may be written).

Everything is checked here, once, at load: nothing downstream looks at raw dicts again. Errors
name the file, the line and the key, and suggest the nearest valid key. Each key is checked on
its own: a problem is noted and the next key checked, so one load reports every problem.
"""
from __future__ import annotations

import dataclasses
import ipaddress
from typing import Any

from ..errors import InventoryError, Problems, did_you_mean
from ..spec import ADD, ALLOCATING, JOB_WIDE, KEY_BY_KEY, MERGE, Host, Inventory, Key, keys_of
from ..texts import HOSTNAME
from .checks import Checks
from .hostfile import check_unique, expand
from .loader import List, Map, compose


def parse_yaml(text: str, source: str) -> Inventory:
    problems = Problems()
    data = compose(text, source, problems)
    parsed: list[Inventory] = []
    with problems.noted():     # a problem the rest of the file depends on ends the load early
        parsed.append(_Parser(source, problems).inventory(data, text))
    problems.check()
    return parsed[0]


def host_keys(scope: str) -> tuple[str, ...]:
    """The host keys one may write under `defaults` (scope JOB_WIDE) or on one host (HOST_ONLY)."""
    return tuple(name for name, k in keys_of(Host).items() if scope in k.scope.split(", "))


HOST_SETTINGS = host_keys(JOB_WIDE)
HOST_KEYS = host_keys("host")
# The same for every node (one rendezvous): set under defaults only, never per host.
JOB_WIDE_KEYS = tuple(name for name, k in keys_of(Host).items() if k.scope == JOB_WIDE)
TOP_KEYS = ("defaults",) + tuple(keys_of(Inventory))


def merged(rule: str, base: Any, value: Any) -> Any:
    """A host's value over the defaults' one, by the key's merge rule."""
    if rule == MERGE:
        return tuple({**dict(base), **dict(value)}.items())
    if rule == ADD:
        return tuple(dict.fromkeys(tuple(base) + tuple(value)))
    return value


class _Parser(Checks):
    """Checks that combine keys run only on a file with no problem so far, so that one mistake
    is not reported twice."""

    def known_keys(self, m: Any, allowed: tuple[str, ...], prefix: str = "") -> None:
        """Each key that is not allowed here is noted (the others are read on their own)."""
        for key in m:
            if key in JOB_WIDE_KEYS and key not in allowed:
                self.problems.found.append(self.fail(m, key, f"'{key}' is the same for every node of a job",
                                                     "set it under 'defaults', not on one host"))
            elif key not in allowed:
                self.problems.found.append(self.fail(m, key, f"unknown key '{prefix}{key}'",
                                                     did_you_mean(key, allowed)))

    def read(self, m: Map, declared: dict[str, Key], base: Any = None,
             allowed: tuple[str, ...] | None = None) -> dict[str, Any]:
        """Each declared (and here allowed) key of m read by its check and merged over base's
        value: one that fails is noted and left out, and the next one is read."""
        out: dict[str, Any] = {}
        for name in m:
            decl = declared.get(name)
            if decl is None or decl.check is None or (allowed is not None and name not in allowed):
                continue
            with self.problems.noted():
                was = getattr(base, name) if base is not None else None
                out[name] = self.value(m, name, decl, was)
        return out

    def value(self, m: Map, name: str, decl: Key, was: Any) -> Any:
        """One key's value: a section is read key by key over the one it replaces."""
        if decl.check == "section":
            raw, short = m[name], getattr(decl.args[0], "SHORTHAND", None)
            if short and not isinstance(raw, (Map, List)):   # gate: deep, gate: {level: deep}
                line = m.lines.get(name, m.line)
                raw = Map({short: raw}, {short: line}, line)
            section = self.mapping(raw, m, name)
            return self.section(section, decl.args[0], was if decl.merge == KEY_BY_KEY else None,
                                f"{name}.")
        value = getattr(self, decl.check or "")(m, name, *decl.args)
        return merged(decl.merge, was, value) if was is not None else value

    def section(self, m: Map, cls: type, base: Any, prefix: str) -> Any:
        """A nested mapping (ssh, slurm, network, container) as its model class."""
        declared = keys_of(cls)
        self.known_keys(m, tuple(declared), prefix)
        fields = {name: getattr(base, name) for name in declared} if base is not None else {}
        before = len(self.problems.found)
        fields.update(self.read(m, declared))
        if len(self.problems.found) > before:
            raise self.problems.found[-1]        # noted already: the section is left out
        for f in dataclasses.fields(cls):
            if f.default is dataclasses.MISSING and f.name not in fields:
                what = prefix.rstrip(".")        # container: a container needs an 'image'
                raise InventoryError(self.source, m.line, what, f"a {what} needs an '{f.name}'",
                                     hint=declared[f.name].example)
        return cls(**fields)

    def inventory(self, data: Any, text: str) -> Inventory:
        if not isinstance(data, Map):
            raise InventoryError(self.source, 1, None, "an inventory is a mapping with 'hosts'")
        self.known_keys(data, TOP_KEYS)
        keys_known = self.clean()
        top = self.read(data, keys_of(Inventory))
        if "hang_auto" in top and top["hang_auto"].floor > top["hang_auto"].cap:
            self.problems.found.append(self.fail(data["hang_auto"], "floor", "the floor "
                                                 f"({top['hang_auto'].floor:g} s) is above the "
                                                 f"cap ({top['hang_auto'].cap:g} s)"))
        if top.get("backend") in ALLOCATING:
            # the launcher's own watchdog; `restarts` a scheduler's batch script spends itself
            for key in ("hang_timeout",):
                if top.get(key):
                    self.problems.found.append(self.fail(
                        data, key, f"is for local and ssh runs; under {top['backend']} a job "
                                   f"requeues itself (--max-requeues)"))
        defaults = Map({}, {}, 1)
        if "defaults" in data:
            with self.problems.noted():
                defaults = self.mapping(data["defaults"], data, "defaults")
        self.known_keys(defaults, HOST_SETTINGS, "defaults.")
        base = self.settings(defaults, Host(name="-", address="-"), HOST_SETTINGS)
        hosts: tuple[Host, ...] = ()
        given = True
        if top.get("backend") in ALLOCATING and not data.get("hosts"):
            # The scheduler allocates the nodes: one placeholder host carries the defaults.
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
        return Inventory(hosts=hosts, source=self.source, text=text, hosts_given=given, **top)

    def hosts(self, value: Any, where: Map, base: Host) -> tuple[Host, ...]:
        if not isinstance(value, List) or not value:
            raise self.fail(where, "hosts", "must be a non-empty list of hosts")
        out: list[Host] = []
        for item, line in zip(value, value.lines):
            with self.problems.noted():
                out.extend(self.host(item, line, base))
        check_unique(tuple(out), self.source)
        return tuple(out)

    def host(self, item: Any, line: int, base: Host) -> list[Host]:
        """One item of `hosts`: a hostlist name makes several hosts."""
        if isinstance(item, str):
            item = Map({"name": item}, {"name": line}, line)
        if not isinstance(item, Map):
            raise InventoryError(self.source, line, "hosts", "each host is a name or a mapping")
        self.known_keys(item, HOST_KEYS)
        if "name" not in item:
            raise self.fail(item, None, "host needs a 'name'", "e.g. {name: gpu-a, address: 10.0.0.11}")
        host = self.settings(item, base, HOST_KEYS)
        names: list[str] = []
        with self.problems.noted():
            names = expand(self.string(item, "name"), self.source, item.lines["name"], "name")
        address = None
        if "address" in item:
            with self.problems.noted():
                if len(names) > 1:
                    raise self.fail(item, "address", "a host list expands to several hosts; "
                                    "they cannot share one address")
                address = self.address(item)
        return [host.replace(name=n, address=address or n, line=item.line) for n in names]

    def settings(self, m: Map, base: Host, allowed: tuple[str, ...]) -> Host:
        """The host settings of one mapping (defaults or a host) applied over `base`: each key
        by its merge rule (env merges, secret_env and env_forward add, container and network
        go key by key, the others replace). Keys not allowed here were noted already."""
        host = base.replace(**self.read(m, keys_of(Host), base, allowed))
        if self.clean():
            with self.problems.noted():
                self.settings_agree(m, host)
        return host

    def settings_agree(self, m: Map, host: Host) -> None:
        """Checks that combine keys (of this mapping and the defaults under it)."""
        if host.python == "auto" and not host.setup:
            raise self.fail(m, "python", "'auto' takes the python that 'setup' leaves on PATH, "
                            "and there is no setup", "add setup lines, or name the interpreter")
        both = sorted(set(host.secret_env) & set(dict(host.env)))
        if both:
            key = "secret_env" if "secret_env" in m else "env"
            raise self.fail(m, key, f"{', '.join(both)} is in both 'env' and 'secret_env'",
                            "a secret's value comes from the launching shell; remove it from 'env'")

    def address(self, m: Map) -> str:
        value = self.string(m, "address")
        try:
            ipaddress.ip_address(value)
            return value
        except ValueError:
            pass
        if not HOSTNAME.match(value):
            raise self.fail(m, "address", f"{value!r} is neither an IP address nor a host name")
        return value

