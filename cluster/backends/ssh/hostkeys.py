"""Host keys: the known_hosts files and the three policies (strict, accept-new, off).

The check is ours, not paramiko's: nothing is loaded into paramiko's HostKeys, so paramiko hands
every server key to our MissingHostKeyPolicy, which runs after the key exchange and before any
authentication is sent. It reads known_hosts as OpenSSH does (known_hosts.py: patterns, negation,
hashed names, `[host]:port`, @revoked, @cert-authority) and decides:

    revoked   an @revoked line for this host has the server's key  -> refused (strict, accept-new)
    known     a plain line for this host has the server's key      -> accepted
    changed   plain lines name this host, none with this key       -> refused (strict, accept-new)
    unknown   no plain line names this host                        -> strict: refused;
                                                                      accept-new: recorded
Under off nothing is read and any key is accepted (the backend warns once).

The key types known for a host are put first in the host key algorithms offered, as OpenSSH
does, so a server with several keys shows the one known_hosts has.
"""
from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import paramiko

from .keepalive import AnsweringTransport

from .known_hosts import Entry, file_index, hash_name

USER_KNOWN_HOSTS = "~/.ssh/known_hosts"
GLOBAL_KNOWN_HOSTS = "/etc/ssh/ssh_known_hosts"
_KNOWN_HOSTS_LOCK = threading.Lock()
_OFF_WARNED = threading.Event()


def warn_unchecked_once(warn: Callable[[str], None]) -> None:
    """Policy off: say once per process that host keys go unchecked."""
    if not _OFF_WARNED.is_set():
        _OFF_WARNED.set()
        warn("WARNING: host keys are not checked (--host-key-policy off); anyone on the "
             "network path can impersonate the nodes")

# known_hosts key type -> the host key algorithms that present it (RSA signs with SHA-2 now)
_ALGORITHMS = {"ssh-rsa": ("rsa-sha2-512", "rsa-sha2-256", "ssh-rsa")}


def fingerprint(key: paramiko.PKey) -> str:
    return key.fingerprint if hasattr(key, "fingerprint") else key.get_fingerprint().hex()


class HostKeyRefused(paramiko.SSHException):
    """Raised inside paramiko's connect by our policies, before authentication; translated by
    errors.translate. hostname is the known_hosts name (`host` or `[host]:port`)."""

    def __init__(self, text: str, hostname: str, key: paramiko.PKey,
                 entries: Sequence[Entry] = ()) -> None:
        super().__init__(text)
        self.hostname, self.key, self.entries = hostname, key, tuple(entries)


class UnknownKey(HostKeyRefused):
    """No plain known_hosts line names the host (strict). entries: @cert-authority lines that
    cover the host, if any (host certificates are not checked)."""

    def __init__(self, hostname: str, key: paramiko.PKey, authorities: Sequence[Entry] = ()) -> None:
        super().__init__(f"unknown host key for {hostname}", hostname, key, authorities)


class ChangedKey(HostKeyRefused):
    """known_hosts names the host with other keys only. entries: those lines."""

    def __init__(self, hostname: str, key: paramiko.PKey, entries: Sequence[Entry]) -> None:
        super().__init__(f"host key for {hostname} changed", hostname, key, entries)


class RevokedKey(HostKeyRefused):
    """An @revoked line for the host holds the server's key. entries: those lines."""

    def __init__(self, hostname: str, key: paramiko.PKey, entries: Sequence[Entry]) -> None:
        super().__init__(f"host key for {hostname} is revoked", hostname, key, entries)


@dataclass(frozen=True)
class Verdict:
    """What known_hosts says about one server key for one host name."""
    status: str                               # known | revoked | changed | unknown
    entries: tuple[Entry, ...] = ()           # the lines that decided it
    authorities: tuple[Entry, ...] = ()       # @cert-authority lines for the host


class KnownHosts:
    """The known_hosts files for one connection: read for checking, the first one written to
    under accept-new (hashed when HashKnownHosts is yes). Writes are serialised; nodes connect
    in parallel."""

    def __init__(self, files: Sequence[str], write_to: str, *, hash_new: bool = False) -> None:
        self.files = [os.path.expanduser(f) for f in files]
        self.write_to = os.path.expanduser(write_to)
        self.hash_new = hash_new
        self.lock = _KNOWN_HOSTS_LOCK

    def entries_for(self, hostname: str) -> list[Entry]:
        """Every line that names hostname (`host` or `[host]:port`), in file order."""
        return [e for f in self.files if os.path.isfile(f) for e in file_index(f).naming(hostname)]

    def check(self, hostname: str, key: paramiko.PKey) -> Verdict:
        lines = self.entries_for(hostname)
        blob = key.asbytes()
        revoked = tuple(e for e in lines if e.marker == "revoked" and e.blob == blob)
        if revoked:
            return Verdict("revoked", revoked)
        plain = tuple(e for e in lines if e.marker is None)
        authorities = tuple(e for e in lines if e.marker == "cert-authority")
        if any(e.blob == blob for e in plain):
            return Verdict("known", tuple(e for e in plain if e.blob == blob), authorities)
        return Verdict("changed" if plain else "unknown", plain, authorities)

    def key_types(self, hostname: str) -> list[str]:
        """The key types of the plain lines for hostname, in file order, without repeats."""
        return list(dict.fromkeys(e.keytype for e in self.entries_for(hostname)
                                  if e.marker is None))

    def lines_for(self, hostname: str) -> list[tuple[str, int, str]]:
        """(file, line number, key type) of every plain line naming hostname."""
        return [(e.file, e.line, e.keytype) for e in self.entries_for(hostname) if e.marker is None]

    def add(self, hostname: str, key: paramiko.PKey) -> None:
        name = hash_name(hostname) if self.hash_new else hostname
        line = f"{name} {key.get_name()} {key.get_base64()}\n"
        with self.lock:
            directory = os.path.dirname(self.write_to) or "."
            if not os.path.isdir(directory):
                os.makedirs(directory, mode=0o700, exist_ok=True)
            with open(self.write_to, "a+") as f:
                f.seek(0)
                text = f.read()
                if text and not text.endswith("\n"):
                    f.write("\n")
                f.write(line)


def known_hosts_for(ssh_cfg: Any) -> KnownHosts:
    """~/.ssh/known_hosts plus the ssh config's UserKnownHostsFile (new keys go to the latter
    when it is set, as OpenSSH does) plus the global file, read-only."""
    user = split_files(ssh_cfg.get("userknownhostsfile"))
    glob = split_files(ssh_cfg.get("globalknownhostsfile")) or [GLOBAL_KNOWN_HOSTS]
    default = os.path.expanduser(USER_KNOWN_HOSTS)
    files = list(dict.fromkeys(user + [default] + glob))
    hashed = str(ssh_cfg.get("hashknownhosts", "no")).lower() == "yes"
    return KnownHosts(files, user[0] if user else default, hash_new=hashed)


def preferred_algorithms(known_types: Sequence[str], offered: Sequence[str]) -> list[str]:
    """offered, reordered so that the algorithms of the known key types come first."""
    wanted = [a for t in known_types for a in _ALGORITHMS.get(t, (t,))]
    first = [a for a in dict.fromkeys(wanted) if a in offered]
    return first + [a for a in offered if a not in first]


def transport_preferring(known_types: Sequence[str]) -> Callable[..., paramiko.Transport]:
    """A paramiko transport_factory whose host key algorithms put known_types first; its
    transports answer the launcher's one keepalive (keepalive.py)."""
    def make(sock: Any, disabled_algorithms: dict[str, Any] | None = None) -> paramiko.Transport:
        transport = AnsweringTransport(sock, disabled_algorithms=disabled_algorithms)
        options = transport.get_security_options()
        options.key_types = preferred_algorithms(known_types, list(options.key_types))
        return transport
    return make


class StrictPolicy(paramiko.MissingHostKeyPolicy):
    """The server's key must be known: revoked, changed and unknown keys are refused.
    With no KnownHosts, nothing is known."""

    def __init__(self, known: KnownHosts | None = None) -> None:
        self.known = known

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        verdict = self.known.check(hostname, key) if self.known else Verdict("unknown")
        if verdict.status == "known":
            return
        if verdict.status == "revoked":
            raise RevokedKey(hostname, key, verdict.entries)
        if verdict.status == "changed":
            raise ChangedKey(hostname, key, verdict.entries)
        self.unknown(hostname, key, verdict)

    def unknown(self, hostname: str, key: paramiko.PKey, verdict: Verdict) -> None:
        raise UnknownKey(hostname, key, verdict.authorities)


class AcceptNewPolicy(StrictPolicy):
    """As strict, except that an unknown key is accepted and recorded in known_hosts (like
    OpenSSH's accept-new). Revoked and changed keys are still refused."""
    known: KnownHosts          # always given: an accepted key is recorded there

    def __init__(self, known: KnownHosts, warn: Callable[[str], None]) -> None:
        super().__init__(known)
        self.known = known
        self.warn = warn

    def unknown(self, hostname: str, key: paramiko.PKey, verdict: Verdict) -> None:
        self.known.add(hostname, key)
        self.warn(f"added the {key.get_name()} host key of {hostname} ({fingerprint(key)}) "
                  f"to {self.known.write_to}")


class OffPolicy(paramiko.MissingHostKeyPolicy):
    """Accept any key; the backend warns once that host keys are not checked."""

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        return None


def split_files(value: Any) -> list[str]:
    if not value:
        return []
    items = value if isinstance(value, list) else str(value).split()
    return [os.path.expanduser(v) for v in items if v and v != "none"]
