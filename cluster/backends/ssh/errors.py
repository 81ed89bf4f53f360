"""paramiko and socket exceptions, translated once, here, into the project's errors. Each
message names the host, the user and keys tried, and what to do."""
from __future__ import annotations

import errno
import socket
from dataclasses import dataclass

import paramiko

from ...errors import ClusterError, PreflightError
from .hostkeys import ChangedKey, HostKeyRefused, KnownHosts, RevokedKey, fingerprint
from .identities import KeysRefused
from .known_hosts import Entry

# All exit code 3 (PreflightError): a node that cannot be reached or trusted fails the checks.


class SshError(PreflightError):
    """Connecting to a node failed."""


class Unreachable(SshError):
    """Refused, timed out, no route, name does not resolve, not an SSH server."""


class AuthFailed(SshError):
    """The server refused every key we offered."""


class HostKeyUnknown(SshError):
    """strict policy and the host's key is not in known_hosts."""


class HostKeyChanged(SshError):
    """known_hosts has another key for this host: refused under every policy but off."""


class HostKeyRevoked(SshError):
    """known_hosts marks the host's key @revoked: refused under every policy but off."""


@dataclass(frozen=True)
class Attempt:
    """What a connection tried, for the messages."""
    name: str
    hostname: str
    port: int
    user: str
    keys: tuple[str, ...]
    agent: bool
    timeout: float
    known_hosts: tuple[str, ...] = ()

    @property
    def where(self) -> str:
        target = f"{self.user}@{self.hostname}:{self.port}"
        return target if self.name == self.hostname else f"{self.name} ({target})"


def translate(exc: BaseException, at: Attempt, known: KnownHosts | None = None) -> ClusterError:
    """A paramiko/socket exception from connecting -> the matching ClusterError."""
    if isinstance(exc, ClusterError):
        return exc
    if isinstance(exc, HostKeyRefused):
        return _host_key(exc, at, known)
    if isinstance(exc, paramiko.BadHostKeyException):
        lines = known.lines_for(exc.hostname) if known else []
        where = "; ".join(f"{f} line {n} ({t})" for f, n, t in lines) or "known_hosts"
        return _changed(at, exc.hostname, exc.key, where, lines[0][0] if lines else None)
    if isinstance(exc, KeysRefused):
        return _keys_refused(exc, at)
    if isinstance(exc, paramiko.AuthenticationException):
        keys = ", ".join(at.keys) if at.keys else "none given"
        extra = " and the ssh agent" if at.agent else ""
        return AuthFailed(f"{at.where}: authentication failed for user {at.user!r} "
                          f"(keys tried: {keys}{extra}; no password prompts in batch mode): {exc}. "
                          f"Set 'user'/'identity_file' in the inventory (--user/--identity on the command line) or ~/.ssh/config")
    if isinstance(exc, paramiko.ssh_exception.NoValidConnectionsError):
        codes = {getattr(e, "errno", None) for e in exc.errors.values()}
        why = "connection refused (is sshd running there?)" if errno.ECONNREFUSED in codes \
            else "no route to host"
        return Unreachable(f"{at.where}: {why}")
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return Unreachable(f"{at.where}: timed out after {at.timeout:g} s "
                           f"(ssh.connect_timeout in the inventory)")
    if isinstance(exc, socket.gaierror):
        return Unreachable(f"{at.where}: cannot resolve {at.hostname!r}: {exc.strerror}")
    if isinstance(exc, OSError):
        reasons = {errno.ECONNREFUSED: "connection refused (is sshd running there?)",
                   errno.EHOSTUNREACH: "no route to host", errno.ENETUNREACH: "network unreachable",
                   errno.ETIMEDOUT: "timed out", errno.ECONNRESET: "connection reset"}
        return Unreachable(f"{at.where}: {reasons.get(exc.errno or 0, exc.strerror or str(exc))}")
    if isinstance(exc, paramiko.SSHException):
        text = str(exc)
        if "banner" in text.lower():
            return Unreachable(f"{at.where}: no SSH banner ({text}); not an SSH server, "
                               f"or it is overloaded (MaxStartups)")
        return SshError(f"{at.where}: SSH failed: {text}")
    if isinstance(exc, EOFError):
        return Unreachable(f"{at.where}: the server closed the connection")
    return SshError(f"{at.where}: {type(exc).__name__}: {exc}")


def _keyscan(at: Attempt) -> str:
    return f"ssh-keyscan{' -p ' + str(at.port) if at.port != 22 else ''} -H {at.hostname}"


def _host_key(exc: HostKeyRefused, at: Attempt, known: KnownHosts | None) -> ClusterError:
    key = f"{exc.key.get_name()} {fingerprint(exc.key)}"
    target = known.write_to if known else "~/.ssh/known_hosts"
    if isinstance(exc, RevokedKey):
        lines = ", ".join(e.where for e in exc.entries)
        return HostKeyRevoked(
            f"{at.where}: the server's host key {key} is REVOKED (@revoked at {lines}). Refusing "
            f"to connect (revoked keys are refused under every host key policy but off). The host "
            f"needs a new key; once its administrator has given it one, verify it and add it to "
            f"{target}")
    if isinstance(exc, ChangedKey):
        where = "; ".join(f"{e.where} ({e.keytype})" for e in exc.entries)
        first = exc.entries[0] if exc.entries else None
        if first is not None and first.is_pattern:
            return _changed(at, exc.hostname, exc.key, where, None, pattern=first)
        return _changed(at, exc.hostname, exc.key, where, first.file if first else None)
    files = ", ".join(at.known_hosts) or target
    if exc.entries:
        authorities = ", ".join(e.where for e in exc.entries)
        return HostKeyUnknown(
            f"{at.where}: no plain host key for this host in known_hosts ({files}); "
            f"@cert-authority at {authorities} covers it, but host certificates are not supported. "
            f"The server offers {key}. Verify it, then add it as a plain entry: "
            f"`{_keyscan(at)} >> {target}`, or run with --host-key-policy accept-new")
    return HostKeyUnknown(
        f"{at.where}: host key not in known_hosts ({files}); server offers {key}. Verify it, "
        f"then add it: `{_keyscan(at)} >> {target}`, or run with --host-key-policy accept-new")


def _changed(at: Attempt, hostname: str, key: paramiko.PKey, where: str, file: str | None,
             *, pattern: Entry | None = None) -> HostKeyChanged:
    if pattern is not None:
        fix = (f"edit {pattern.where} (its pattern {pattern.hosts!r} covers this host), or add "
               f"a line naming this host with its new key")
    else:
        fix = f"remove the old key with `ssh-keygen -R {hostname}{' -f ' + file if file else ''}`"
    return HostKeyChanged(
        f"{at.where}: HOST KEY CHANGED: the server sent {key.get_name()} {fingerprint(key)}, "
        f"which does not match {where}. Someone may be intercepting the connection "
        f"(man-in-the-middle), or the host was reinstalled. Refusing to connect. If the change "
        f"is expected, {fix} and connect again")


def _keys_refused(exc: KeysRefused, at: Attempt) -> AuthFailed:
    offered = "; ".join(exc.tried) if exc.tried else \
        f"no key could be offered (identities: {', '.join(at.keys) or 'none'}; {exc.agent.name()})"
    text = (f"{at.where}: authentication failed for user {at.user!r} (batch mode: no passphrase "
            f"or password prompts). Offered: {offered}.")
    if exc.notes:
        text += " Not offered: " + "; ".join(exc.notes) + "."
    return AuthFailed(text + " Set 'user'/'identity_file' in the inventory (--user/--identity on the command line) or ~/.ssh/config")
