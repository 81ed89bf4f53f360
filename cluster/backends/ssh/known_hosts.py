"""The known_hosts file format as OpenSSH reads it (sshd(8), "SSH_KNOWN_HOSTS FILE FORMAT").

    [@revoked | @cert-authority] hostnames keytype base64-key [comment]

hostnames is a comma list of patterns (`*` any run of characters, `?` one character, `!pattern`
excludes: a line whose negated pattern matches does not apply even if another pattern does), or
one hashed name `|1|base64(salt)|base64(HMAC-SHA1(salt, name))`. A host on a port other than 22
is named `[host]:port`, in patterns and hashes alike. Matching ignores case.

paramiko's HostKeys reads none of the markers, patterns or negations; this module does, and
nothing else: it reads lines and answers which of them name a host. Keys are compared as their
public blobs, so no key type needs to be understood to be matched.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import re
from dataclasses import dataclass
from pathlib import Path

MARKERS = {"@revoked": "revoked", "@cert-authority": "cert-authority"}
HASH_MAGIC = "|1|"


@dataclass(frozen=True)
class Entry:
    """One key line: where it is, which hosts it names, its key, and its marker if any."""
    file: str
    line: int
    hosts: str                # the hostnames field as written
    keytype: str
    blob: bytes               # the public key, decoded
    marker: str | None = None  # "revoked" | "cert-authority" | None

    @property
    def where(self) -> str:
        return f"{self.file} line {self.line}"

    @property
    def hashed(self) -> bool:
        return self.hosts.startswith(HASH_MAGIC)

    @property
    def is_pattern(self) -> bool:
        """True when the line names hosts by pattern or list, not by one exact name."""
        return not self.hashed and any(c in self.hosts for c in "*?!,")

    def names(self, host: str) -> bool:
        return host_matches(self.hosts, host)


def key_name(hostname: str, port: int) -> str:
    """The name known_hosts uses for a host: `host`, or `[host]:port` off port 22."""
    return hostname if port == 22 else f"[{hostname}]:{port}"


def pattern_matches(pattern: str, name: str) -> bool:
    """OpenSSH's match_pattern: `*` and `?` are wildcards, every other character is literal
    (so `[10.0.0.1]:2222` is a plain name, not a character class)."""
    if "*" not in pattern and "?" not in pattern:
        return pattern == name          # a plain name: no pattern to compile (most lines)
    regex = "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern)
    return re.fullmatch(regex, name, flags=re.DOTALL) is not None


def list_matches(patterns: str, name: str) -> bool:
    """A comma list: any positive pattern matches and no negated one does."""
    name = name.lower()
    positive = False
    for pattern in patterns.lower().split(","):
        if pattern.startswith("!"):
            if pattern_matches(pattern[1:], name):
                return False
        elif pattern and pattern_matches(pattern, name):
            positive = True
    return positive


def hash_name(name: str, salt: bytes | None = None) -> str:
    """The hashed form of name (`ssh-keygen -H`, HashKnownHosts yes)."""
    salt = salt if salt is not None else os.urandom(20)
    digest = hmac.new(salt, name.lower().encode(), hashlib.sha1).digest()
    return f"{HASH_MAGIC}{base64.b64encode(salt).decode()}|{base64.b64encode(digest).decode()}"


def hashed_matches(field: str, name: str) -> bool:
    parts = field[len(HASH_MAGIC):].split("|")
    if len(parts) != 2:
        return False
    try:
        salt = base64.b64decode(parts[0], validate=True)
    except (binascii.Error, ValueError):
        return False
    return hmac.compare_digest(hash_name(name, salt), field)


def host_matches(field: str, name: str) -> bool:
    """Does a line's hostnames field name this host (`host` or `[host]:port`)?"""
    if field.startswith(HASH_MAGIC):
        return hashed_matches(field, name)
    return list_matches(field, name)


def parse_line(text: str, file: str, lineno: int) -> Entry | None:
    """One line -> an Entry; None for blanks, comments and lines that are not a key."""
    fields = text.split()
    if not fields or fields[0].startswith("#"):
        return None
    marker = MARKERS.get(fields[0].lower()) if fields[0].startswith("@") else None
    if fields[0].startswith("@"):
        if marker is None:
            return None           # an unknown marker: OpenSSH skips the line too
        fields = fields[1:]
    if len(fields) < 3:
        return None
    hosts, keytype, data = fields[:3]
    try:
        blob = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        return None
    return Entry(file=file, line=lineno, hosts=hosts, keytype=keytype, blob=blob, marker=marker)


class FileIndex:
    """One file's key lines, and which of them name a host. A line of plain names (`host`,
    `host,10.0.0.1`: what ssh writes) is found by its names at once; a line of patterns, with a
    negation, or a hashed name is asked one by one. Each host's answer is kept: a connection
    asks for its host's lines more than once, and each of a launch's N connections asking all
    N lines was a launch's square."""

    def __init__(self, entries: list[Entry]) -> None:
        self.entries = entries
        self.by_name: dict[str, list[Entry]] = {}
        self.others: list[Entry] = []
        self._found: dict[str, list[Entry]] = {}
        for e in entries:
            names = [] if e.hashed else [n for n in e.hosts.lower().split(",") if n]
            if not names or any(n.startswith("!") or "*" in n or "?" in n for n in names):
                self.others.append(e)
                continue
            for name in dict.fromkeys(names):
                self.by_name.setdefault(name, []).append(e)

    def naming(self, host: str) -> list[Entry]:
        """The lines that name host, in file order."""
        found = self._found.get(host)
        if found is None:
            found = self.by_name.get(host.lower(), []) + [e for e in self.others if e.names(host)]
            found.sort(key=lambda e: e.line)
            self._found[host] = found
        return found


# path -> ((mtime_ns, size, inode), its lines): every connection of a launch reads the same
# files, and a file of 1,000 hosts parsed once per connection is a launch's square.
_PARSED: dict[str, tuple[tuple[int, int, int], FileIndex]] = {}


def read_entries(path: str) -> list[Entry]:
    """Every key line of one file; a missing or unreadable file has none."""
    return file_index(path).entries


def file_index(path: str) -> FileIndex:
    """One file's lines, parsed once while the file is unchanged (accept-new's appends change
    it); a missing or unreadable file has none."""
    try:
        st = os.stat(path)
        stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        cached = _PARSED.get(path)
        if cached is not None and cached[0] == stamp:
            return cached[1]
        text = Path(path).read_text(errors="replace")
    except OSError:
        return FileIndex([])
    entries = (parse_line(line, path, n) for n, line in enumerate(text.splitlines(), start=1))
    index = FileIndex([e for e in entries if e is not None])
    _PARSED[path] = (stamp, index)
    return index
