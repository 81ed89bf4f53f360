"""~/.ssh/config for an inventory host, which has a name and an address.

Host blocks are matched against the name first, then against the address for the options the
name's blocks left unset (as OpenSSH reads the config a second time, for the canonical name,
under CanonicalizeHostname): for each option the first value found wins, and IdentityFile lines
add up, the name's first. So with `name: gpu-a, address: 10.0.0.11` a `Host gpu-a` block applies
as it would to `ssh gpu-a`, and a `Host 10.0.0.11` block fills in what that leaves unset (a
`Host *` block read for the name counts as the name's: put a node's options in a block naming it).

The destination is the inventory's address when it differs from the name: the inventory wrote it
down for this host, and the other nodes reach the host by it too, so a HostName from the config
is set aside (and reported). When the inventory gives no address (it is then the name), the
config's HostName is the destination, as for `ssh <name>`. The inventory's user, port and
identity_file win over the config's (transport.py).

A lookup reads only the blocks that can apply to the host (IndexedSSHConfig): a config with a
Host block per node (as generated configs have) made each of a launch's lookups read all of
them, and a launch of N nodes N-squared blocks (at 1,000 nodes most of its check).
"""
from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from paramiko.config import SSHConfig, SSHConfigDict

# What makes a Host pattern more than a plain name (fnmatch's wildcards; '!' negates).
WILDCARDS = frozenset("*?[")


class IndexedSSHConfig(SSHConfig):
    """paramiko's SSHConfig, whose lookup hands paramiko only the blocks that can apply to the
    host, in their order: every block but a Host block of plain names that does not name it.
    Such a block matches only a host spelled as one of its names (fnmatch of a pattern without
    wildcards is string equality), so leaving it out changes nothing; Match blocks, wildcard and
    negated patterns are always read. A config that canonicalizes host names (the name looked
    up changes midway) is read whole. Uses paramiko's block list (`_config`, in this class
    alone); tests/unit/test_sshconfig.py holds it to paramiko's own lookup."""

    def __init__(self) -> None:
        super().__init__()
        self._indexed = -1                       # the block count the index was built for
        self._always: list[int] = []
        self._by_name: dict[str, list[int]] = {}
        self._whole = False

    @classmethod
    def from_files(cls, paths: Iterable[str]) -> "IndexedSSHConfig":
        """The files' blocks in order (missing files are skipped, as Fabric does)."""
        config = cls()
        for path in paths:
            if os.path.isfile(path):
                with open(path) as f:
                    config.parse(f)
        return config

    def lookup(self, hostname: str) -> SSHConfigDict:
        blocks: list[dict[str, Any]] = self._config  # type: ignore[attr-defined]
        if len(blocks) != self._indexed:
            self._index(blocks)
        if self._whole:
            return super().lookup(hostname)
        picked = sorted(self._always + self._by_name.get(hostname, []))
        some = SSHConfig()
        some._config = [blocks[i] for i in picked]  # type: ignore[attr-defined]
        return some.lookup(hostname)

    def _index(self, blocks: list[dict[str, Any]]) -> None:
        self._always, self._by_name, self._indexed = [], {}, len(blocks)
        self._whole = any("canonicalizehostname" in b["config"] for b in blocks)
        for i, block in enumerate(blocks):
            names = block.get("host")           # a Match block has none: always read
            if not names or any(n.startswith("!") or WILDCARDS.intersection(n) for n in names):
                self._always.append(i)
                continue
            for name in dict.fromkeys(names):
                self._by_name.setdefault(name, []).append(i)


@dataclass(frozen=True)
class HostConfig:
    options: SSHConfigDict          # the merged options; options["hostname"] is the destination
    destination: str
    set_aside: str | None = None    # a HostName the config gave that the inventory address beat


def merged_lookup(config: SSHConfig, name: str, address: str) -> SSHConfigDict:
    """The options for name, then those for address that name's blocks leave unset."""
    by_name = config.lookup(name)
    if address == name:
        return by_name
    by_address = config.lookup(address)
    merged = SSHConfigDict(by_address)
    merged.update(by_name)
    keys = list(dict.fromkeys(identity_files(by_name) + identity_files(by_address)))
    if keys:
        # A list, as paramiko keeps this option; its stubs type every value as a str.
        merged["identityfile"] = keys  # type: ignore[assignment]
    return merged


def identity_files(options: SSHConfigDict) -> list[str]:
    """The IdentityFile lines: paramiko keeps them as a list (the option may come many times),
    though its stubs type every option as a str."""
    value: object = options.get("identityfile")
    return list(value) if isinstance(value, list) else []


def host_config(config: SSHConfig, name: str, address: str) -> HostConfig:
    options = merged_lookup(config, name, address)
    configured = str(options.get("hostname", name))
    if address == name:
        return HostConfig(options, configured)
    options["hostname"] = address
    set_aside = configured if configured not in (name, address) else None
    return HostConfig(options, address, set_aside)
