"""MPI/DeepSpeed hostfiles and SLURM hostlists: `worker-1 slots=4`, `worker-1:4`, `gpu[01-04]`."""
from __future__ import annotations

import hostlist

from ..errors import InventoryError, Problems
from ..spec import Host, Inventory
from ..texts import HOSTNAME


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
        check_unique(tuple(hosts), source)
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
                 gpus=slots) for n in expand(name, source, lineno, "name")]


def _slot_count(value: str, source: str, lineno: int) -> int:
    if not value.isdigit() or int(value) < 1:
        raise InventoryError(source, lineno, "slots", f"must be a whole number >= 1, got {value!r}")
    return int(value)


def expand(expr: str, source: str, lineno: int | None, key: str) -> list[str]:
    """A hostlist's names (gpu[01-02] -> gpu01, gpu02), each a valid host name."""
    try:
        names = hostlist.expand_hostlist(expr)
    except hostlist.BadHostlist as exc:
        raise InventoryError(source, lineno, key, f"{expr!r} is not a valid host list ({exc})") from None
    for n in names:
        if not HOSTNAME.match(n):
            raise InventoryError(source, lineno, key, f"{n!r} is not a valid host name",
                                 hint="letters, digits, '-', '_' and '.'")
    return names


def check_unique(hosts: tuple[Host, ...], source: str | None) -> None:
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
