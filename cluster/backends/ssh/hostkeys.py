"""Host keys: the known_hosts files and the three policies (strict, accept-new, off).

Never paramiko's auto-adding policy: an unknown key is refused (strict), or accepted and
recorded (accept-new), or accepted with a warning (off); a changed key is refused by all but off.
"""
from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import paramiko
from paramiko.hostkeys import HostKeyEntry, HostKeys

class UnknownKey(paramiko.SSHException):
    """Raised inside paramiko's connect by StrictPolicy; translated to HostKeyUnknown."""

    def __init__(self, hostname: str, key: paramiko.PKey) -> None:
        super().__init__(f"unknown host key for {hostname}")
        self.hostname, self.key = hostname, key


def fingerprint(key: paramiko.PKey) -> str:
    return key.fingerprint if hasattr(key, "fingerprint") else key.get_fingerprint().hex()


class KnownHosts:
    """The known_hosts files for one backend: read for checking, the first one written to
    under accept-new. Writes are serialised; nodes connect in parallel."""

    def __init__(self, files: Sequence[str], write_to: str) -> None:
        self.files = [os.path.expanduser(f) for f in files]
        self.write_to = os.path.expanduser(write_to)
        self.lock = _KNOWN_HOSTS_LOCK

    def load_into(self, keys: HostKeys) -> None:
        for f in self.files:
            if os.path.isfile(f):
                try:
                    keys.load(f)
                except (OSError, paramiko.SSHException, ValueError):
                    continue

    def lines_for(self, hostname: str) -> list[tuple[str, int, str]]:
        """(file, line number, key type) of every entry naming hostname (plain or hashed)."""
        found = []
        for f in self.files:
            try:
                text = Path(f).read_text(errors="replace")
            except OSError:
                continue
            for lineno, line in enumerate(text.splitlines(), start=1):
                line = line.strip()
                if not line or line.startswith("#"):
                    continue
                try:
                    entry = HostKeyEntry.from_line(line, lineno)
                except (paramiko.SSHException, ValueError, IndexError):
                    entry = None
                if entry is None or entry.key is None:
                    continue
                if any(_host_matches(h, hostname) for h in entry.hostnames):
                    found.append((f, lineno, entry.key.get_name()))
        return found

    def add(self, hostname: str, key: paramiko.PKey) -> None:
        line = f"{hostname} {key.get_name()} {key.get_base64()}\n"
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


_KNOWN_HOSTS_LOCK = threading.Lock()
USER_KNOWN_HOSTS = "~/.ssh/known_hosts"
GLOBAL_KNOWN_HOSTS = "/etc/ssh/ssh_known_hosts"


def known_hosts_for(ssh_cfg: Any) -> KnownHosts:
    """~/.ssh/known_hosts plus the ssh config's UserKnownHostsFile (new keys go to the latter
    when it is set, as OpenSSH does) plus the global file, read-only."""
    user = _split_files(ssh_cfg.get("userknownhostsfile"))
    glob = _split_files(ssh_cfg.get("globalknownhostsfile")) or [GLOBAL_KNOWN_HOSTS]
    default = os.path.expanduser(USER_KNOWN_HOSTS)
    files = list(dict.fromkeys(user + [default] + glob))
    return KnownHosts(files, user[0] if user else default)


def _host_matches(pattern: str, hostname: str) -> bool:
    if pattern.startswith("|1|"):
        return HostKeys.hash_host(hostname, pattern) == pattern
    return pattern == hostname


class StrictPolicy(paramiko.MissingHostKeyPolicy):
    """Unknown host key: refuse (the caller explains how to add it)."""

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        raise UnknownKey(hostname, key)


class AcceptNewPolicy(paramiko.MissingHostKeyPolicy):
    """Unknown host key: accept it and record it in known_hosts (like OpenSSH's accept-new).
    A changed key never reaches a policy: paramiko raises BadHostKeyException first."""

    def __init__(self, known: KnownHosts, warn: Callable[[str], None]) -> None:
        self.known = known
        self.warn = warn

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        self.known.add(hostname, key)
        self.warn(f"added the {key.get_name()} host key of {hostname} ({fingerprint(key)}) "
                  f"to {self.known.write_to}")


class OffPolicy(paramiko.MissingHostKeyPolicy):
    """Accept any key; the backend warns once that host keys are not checked."""

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        return None


_off_warned = threading.Event()


def _split_files(value: Any) -> list[str]:
    if not value:
        return []
    items = value if isinstance(value, list) else str(value).split()
    return [os.path.expanduser(v) for v in items if v and v != "none"]
