"""NCCL socket tuning by measurement: a sweep, a choice, a cache, and its use by `cluster up`.

On nodes without InfiniBand NCCL moves data over TCP sockets, and its defaults for how many
helper threads and sockets per thread a connection uses often leave bandwidth unused (on one
H200 host forced onto sockets: 2.9 GB/s with the defaults, 9.6 GB/s with 2 x 2). The right
values depend on the link, so `cluster doctor --tune-nccl` measures them: the all_reduce of
`cluster doctor --deep` once per setting of a small grid (NCCL reads these variables when a
communicator is made, so each setting is a launch of its own), then keeps the best in a cache
keyed by the nodes. `cluster up` on the same nodes adds the kept values to every node's
environment, where the user's own env does not set them; `--no-tuning` ignores the cache.

The pure parts (grid, choice, key, application) take plain data; `sweep` takes the measuring
function, so tests give it a fake and `cluster doctor` gives it the real collective.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import InputError
from .runs import cache_root, make_private_dir, write_private
from .spec import Host, Inventory

VARIABLES = ("NCCL_SOCKET_NTHREADS", "NCCL_NSOCKS_PERTHREAD")
THREADS = (1, 2, 4, 8)
SOCKETS = (1, 2, 4, 8)
MAX_PRODUCT = 64              # NCCL's own limit on threads x sockets per thread
MIN_GAIN = 0.05               # a setting must beat NCCL's defaults by 5% to be kept (noise)
SIZES = (1 << 20, 16 << 20, 64 << 20)
CACHE_VERSION = 1


def grid(threads: Iterable[int] = THREADS, sockets: Iterable[int] = SOCKETS) -> list[dict[str, str]]:
    """The settings to measure: NCCL's defaults (no variable set) first, then every pair
    whose product NCCL accepts."""
    out: list[dict[str, str]] = [{}]
    for t in threads:
        for s in sockets:
            if t < 1 or s < 1:
                raise InputError(f"NCCL socket settings must be positive: {t} x {s}")
            if t * s <= MAX_PRODUCT:
                out.append({"NCCL_SOCKET_NTHREADS": str(t), "NCCL_NSOCKS_PERTHREAD": str(s)})
    return out


def label(setting: Mapping[str, str]) -> str:
    if not setting:
        return "NCCL defaults"
    return f"{setting['NCCL_SOCKET_NTHREADS']} threads x {setting['NCCL_NSOCKS_PERTHREAD']} sockets"


@dataclass(frozen=True)
class Row:
    """One setting and what it measured: bus bandwidth (GB/s) per message size in bytes."""
    env: Mapping[str, str]
    busbw: Mapping[int, float]

    def at(self, size: int) -> float:
        return self.busbw.get(size, 0.0)

    def to_json(self) -> dict[str, Any]:
        return {"env": dict(self.env), "label": label(self.env),
                "busbw_gbps": {str(k): round(v, 4) for k, v in sorted(self.busbw.items())}}


def sweep(measure: Callable[[Mapping[str, str]], Mapping[str, Any]], settings: Sequence[Mapping[str, str]],
          shown: Callable[[Row], None] | None = None) -> list[Row]:
    """Measure each setting in turn. `measure(env)` runs the collective with env added to
    every node's environment and returns what the collective reports (its "allreduce" list
    of {bytes, busbw_gbps}); `shown(row)` hears each row as it is measured."""
    rows = []
    for setting in settings:
        measured = measure(dict(setting))
        row = Row(dict(setting), {int(m["bytes"]): float(m["busbw_gbps"])
                                  for m in measured.get("allreduce") or ()})
        rows.append(row)
        if shown is not None:
            shown(row)
    return rows


def choose(rows: Sequence[Row], min_gain: float = MIN_GAIN) -> Row:
    """The setting with the most bus bandwidth at the largest message size (where the
    socket settings matter); NCCL's defaults unless the best beats them by min_gain."""
    if not rows:
        raise ValueError("nothing was measured")
    size = max(s for r in rows for s in r.busbw) if any(r.busbw for r in rows) else 0
    best = max(rows, key=lambda r: r.at(size))
    default = next((r for r in rows if not r.env), None)
    if default is not None and best.at(size) < default.at(size) * (1 + min_gain):
        return default
    return best


# --- the cache -----------------------------------------------------------------------------------


def cache_path(environ: Mapping[str, str] = os.environ) -> Path:
    return cache_root(environ) / "nccl-tuning.json"


def node_names(inventory: Inventory) -> list[str]:
    """What identifies the nodes a measurement holds for: each host's login and address."""
    return sorted(f"{h.user + '@' if h.user else ''}{h.address}:{h.port or 22}" for h in inventory.hosts)


def key(inventory: Inventory) -> str:
    return hashlib.sha256("\n".join(node_names(inventory)).encode()).hexdigest()[:16]


class Cache:
    """~/.cache/cluster/nccl-tuning.json: per set of nodes, the chosen setting and the table
    it was chosen from. Private (0600 in a 0700 folder) like every file cluster writes."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def entries(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            raise InputError(f"{self.path}: unreadable NCCL tuning cache ({exc}); remove it "
                             f"and run `cluster doctor --tune-nccl` again") from None
        if not isinstance(data, dict) or data.get("version") != CACHE_VERSION:
            return {}
        return data.get("entries") or {}

    def lookup(self, inventory: Inventory) -> dict[str, Any] | None:
        entry = self.entries().get(key(inventory))
        if not isinstance(entry, dict) or not isinstance(entry.get("env"), dict):
            return None
        if set(entry["env"]) - set(VARIABLES):        # only what this module sets is applied
            return None
        return entry

    def store(self, inventory: Inventory, chosen: Row, rows: Sequence[Row]) -> dict[str, Any]:
        entry = {"nodes": node_names(inventory), "env": dict(chosen.env), "label": label(chosen.env),
                 "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                 "table": [r.to_json() for r in rows]}
        entries = {**self.entries(), key(inventory): entry}
        make_private_dir(self.path.parent)
        tmp = self.path.with_name(self.path.name + f".{os.getpid()}.tmp")
        write_private(tmp, json.dumps({"version": CACHE_VERSION, "entries": entries}, indent=2) + "\n")
        os.replace(tmp, self.path)
        return entry


# --- applied by `cluster up` -------------------------------------------------------------------


def applied(inventory: Inventory, cache: Cache) -> Inventory:
    """The inventory with the cached setting for its nodes added to every host's env, except
    where the host's own env (inventory, env_forward, --env) or secret_env names a variable:
    the user's choice wins. Inventory.tuning records what was added, and from where."""
    entry = cache.lookup(inventory)
    if entry is None or not entry["env"]:
        return inventory
    hosts = tuple(_with(h, entry["env"]) for h in inventory.hosts)
    added: dict[str, str] = {}
    for before, after in zip(inventory.hosts, hosts):
        added.update(after.env[len(before.env):])       # _with appends after the host's own
    if not added:
        return inventory
    note = {"env": added, "label": entry.get("label", ""),
            "measured_at": entry.get("measured_at", ""), "cache": str(cache.path)}
    return dataclasses.replace(inventory, hosts=hosts, tuning=note)


def extended(hosts: Sequence[Host], inventory: Inventory) -> tuple[Host, ...]:
    """Hosts that may join the inventory's nodes later (spares), with the setting applied()
    gave them."""
    env = (inventory.tuning or {}).get("env") or {}
    return tuple(_with(h, env) for h in hosts) if env else tuple(hosts)


def _with(host: Host, env: Mapping[str, str]) -> Host:
    own = dict(host.env)
    extra = [(k, str(v)) for k, v in sorted(env.items()) if k not in own and k not in host.secret_env]
    return host.replace(env=host.env + tuple(extra)) if extra else host


def describe(note: Mapping[str, Any]) -> str:
    pairs = " ".join(f"{k}={v}" for k, v in sorted(note["env"].items()))
    return (f"NCCL socket settings measured by `cluster doctor --tune-nccl` on "
            f"{note.get('measured_at') or 'an earlier day'}: {pairs} (--no-tuning ignores them)")
