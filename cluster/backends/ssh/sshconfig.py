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
"""
from __future__ import annotations

from dataclasses import dataclass

from paramiko.config import SSHConfig, SSHConfigDict


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
