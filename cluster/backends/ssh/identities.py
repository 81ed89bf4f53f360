"""Which keys to offer, in which order, as OpenSSH picks them; and the paramiko AuthStrategy that
offers them. Batch mode: nothing here ever asks for a passphrase or a password.

The identities are the inventory's identity_file, then the ssh config's IdentityFile lines; with
neither, the default ~/.ssh/id_rsa, id_ecdsa and id_ed25519 that exist. Keys are offered in
OpenSSH's order (sshconnect2.c, pubkey_prepare):

  1. agent keys that are one of the identities (matched by public key: KEY's own public part,
     which the OpenSSH format keeps unencrypted, else KEY.pub)
  2. the agent's other keys, unless IdentitiesOnly is yes
  3. the identities not found in the agent, read from disk. An encrypted one cannot be read
     without a prompt, so it is skipped, and a failure names it with the `ssh-add` that fixes it

The agent is the one SSH_AUTH_SOCK names; `IdentityAgent none` turns it off (other IdentityAgent
values are not read). Certificates (KEY-cert.pub) are not offered.
"""
from __future__ import annotations

import base64
import binascii
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import paramiko
from paramiko.auth_strategy import AuthFailure, AuthStrategy, InMemoryPrivateKey, SourceResult

DEFAULT_IDENTITIES = ("~/.ssh/id_rsa", "~/.ssh/id_ecdsa", "~/.ssh/id_ed25519")
OPENSSH_MAGIC = b"openssh-key-v1\x00"
_OPENSSH_PEM = re.compile(rb"-----BEGIN OPENSSH PRIVATE KEY-----(.*?)-----END OPENSSH PRIVATE KEY-----",
                          re.DOTALL)
_KEY_ERRORS = (paramiko.SSHException, paramiko.pkey.UnknownKeyType, ValueError, TypeError, OSError)


@dataclass(frozen=True)
class Identity:
    """One identity file, as far as it can be read without a passphrase."""
    path: str
    public: bytes | None = None         # its public key blob; None: unknown without the passphrase
    encrypted: bool = False
    key: paramiko.PKey | None = None    # the private key, when it is not encrypted
    problem: str | None = None          # why it cannot be used at all


def describe(key: paramiko.PKey) -> str:
    return f"{key.get_name()} {key.fingerprint}"


def _ssh_string(raw: bytes, pos: int) -> tuple[bytes, int]:
    size = int.from_bytes(raw[pos:pos + 4], "big")
    end = pos + 4 + size
    if len(raw) < pos + 4 or len(raw) < end:
        raise ValueError("truncated")
    return raw[pos + 4:end], end


def openssh_header(data: bytes) -> tuple[str, bytes] | None:
    """(cipher name, public key blob) of an OpenSSH-format private key; None for other formats.
    Both are stored unencrypted, so this works without the passphrase."""
    found = _OPENSSH_PEM.search(data)
    if not found:
        return None
    try:
        raw = base64.b64decode(b"".join(found.group(1).split()), validate=True)
        if not raw.startswith(OPENSSH_MAGIC):
            return None
        cipher, pos = _ssh_string(raw, len(OPENSSH_MAGIC))
        _kdf, pos = _ssh_string(raw, pos)
        _kdf_options, pos = _ssh_string(raw, pos)
        if int.from_bytes(raw[pos:pos + 4], "big") < 1:
            return None
        public, _ = _ssh_string(raw, pos + 4)
        return cipher.decode("ascii", "replace"), public
    except (binascii.Error, ValueError):
        return None


def pem_encrypted(data: bytes) -> bool:
    """A PEM (PKCS#1 or PKCS#8) private key with a passphrase."""
    return b"Proc-Type: 4,ENCRYPTED" in data or b"BEGIN ENCRYPTED PRIVATE KEY" in data


def public_file(path: str) -> bytes | None:
    """The key blob of KEY.pub, if there is a readable one."""
    try:
        fields = Path(path + ".pub").read_text(errors="replace").split()
        return base64.b64decode(fields[1], validate=True) if len(fields) >= 2 else None
    except (OSError, binascii.Error, ValueError):
        return None


# path -> (the key file's and KEY.pub's stamps, what they hold): every connection of a launch
# offers the same keys, and parsing a key costs about 2 ms (a launch's CPU per node, else).
_READ: dict[str, tuple[tuple[Any, ...], Identity]] = {}


def _stamp(path: str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


def read_identity(path: str) -> Identity:
    """What the key file holds, read once while it and KEY.pub are unchanged (in memory)."""
    stamp = (_stamp(path), _stamp(path + ".pub"))
    if stamp[0] is None:
        return _read_identity(path)          # says why, as a read would
    cached = _READ.get(path)
    if cached is not None and cached[0] == stamp:
        return cached[1]
    identity = _read_identity(path)
    _READ[path] = (stamp, identity)
    return identity


def _read_identity(path: str) -> Identity:
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return Identity(path, problem="no such file")
    except OSError as exc:
        return Identity(path, problem=f"cannot read it ({exc.strerror})")
    header = openssh_header(data)
    encrypted = header[0] != "none" if header else pem_encrypted(data)
    public = header[1] if header else None
    if encrypted:
        return Identity(path, public=public or public_file(path), encrypted=True)
    try:
        key = paramiko.PKey.from_path(path)
    except _KEY_ERRORS as exc:
        return Identity(path, public=public or public_file(path),
                        problem=f"not a private key this tool can use ({exc})")
    return Identity(path, public=public or key.asbytes(), key=key)


def identity_paths(inventory_key: str | None, config_keys: Sequence[str]) -> list[str]:
    """The inventory's identity_file, then the ssh config's; the existing defaults if neither."""
    named = ([inventory_key] if inventory_key else []) + list(config_keys)
    paths = [os.path.expanduser(p) for p in named]
    if not paths:
        paths = [p for p in map(os.path.expanduser, DEFAULT_IDENTITIES) if os.path.exists(p)]
    return list(dict.fromkeys(paths))


@dataclass(frozen=True)
class Offer:
    """One key to offer, with what the messages call it."""
    key: paramiko.PKey
    label: str


def plan(identities: Sequence[Identity], agent_keys: Sequence[paramiko.PKey],
         identities_only: bool) -> list[Offer]:
    """The keys to offer, in OpenSSH's order (see the module docstring)."""
    remaining = list(identities)
    matched, others = [], []
    for agent_key in agent_keys:
        blob = agent_key.asbytes()
        identity = next((i for i in remaining if i.public == blob), None)
        if identity is not None:
            remaining.remove(identity)
            matched.append(Offer(agent_key, f"agent key {describe(agent_key)} ({identity.path})"))
        elif not identities_only:
            others.append(Offer(agent_key, f"agent key {describe(agent_key)}"))
    files = [Offer(i.key, f"{i.path} ({describe(i.key)})") for i in remaining if i.key is not None]
    return matched + others + files


@dataclass(frozen=True)
class AgentState:
    """The agent as the messages describe it."""
    socket: str | None            # SSH_AUTH_SOCK; None: no agent (unset, or IdentityAgent none)
    keys: int = 0

    def name(self) -> str:
        return f"the ssh agent at {self.socket}" if self.socket else "no ssh agent"


def unusable(identities: Sequence[Identity], agent_keys: Sequence[paramiko.PKey],
             identities_only: bool, agent: AgentState) -> list[str]:
    """Why each identity that is neither in the agent nor readable was not offered."""
    in_agent = {k.asbytes() for k in agent_keys}
    notes = []
    for i in identities:
        if i.public is not None and i.public in in_agent:
            continue
        if i.problem:
            notes.append(f"{i.path}: {i.problem}")
        elif i.encrypted:
            notes.append(_encrypted_note(i, identities_only, agent))
    return notes


def _encrypted_note(i: Identity, identities_only: bool, agent: AgentState) -> str:
    never = "batch mode never asks for a passphrase"
    if agent.socket is None:
        return (f"{i.path} is encrypted and there is no ssh agent (SSH_AUTH_SOCK is not set); "
                f"{never}: start one with `eval \"$(ssh-agent)\"`, then `ssh-add {i.path}`")
    if i.public is None and identities_only:
        return (f"{i.path} is encrypted and has no {i.path}.pub, so no agent key can be matched "
                f"to it (IdentitiesOnly yes): write it with `ssh-keygen -y -f {i.path} > "
                f"{i.path}.pub`, and `ssh-add {i.path}` if it is not in the agent")
    return (f"{i.path} is encrypted and its key is not in {agent.name()} ({agent.keys} key(s) "
            f"there); {never}: add it with `ssh-add {i.path}`")


class KeysRefused(paramiko.AuthenticationException):
    """Every key offered was refused (or none could be offered). tried: each key offered and
    what the server said; notes: identities that could not be offered, and why."""

    def __init__(self, username: str, tried: Sequence[str], notes: Sequence[str],
                 agent: AgentState) -> None:
        super().__init__(f"authentication failed for {username}")
        self.username, self.tried, self.notes, self.agent = username, list(tried), list(notes), agent


class _Offered(InMemoryPrivateKey):
    def __init__(self, username: str, offer: Offer) -> None:
        super().__init__(username=username, pkey=offer.key)
        self.label = offer.label

    def __repr__(self) -> str:
        return self.label


def _outcome(result: Any) -> str:
    if isinstance(result, paramiko.AuthenticationException):
        return "refused"
    if isinstance(result, Exception):
        return f"{type(result).__name__}: {result}"
    return "accepted"


class BatchAuth(AuthStrategy):
    """Public key authentication the way OpenSSH in batch mode does it (module docstring).
    Files and the agent are read when connecting; the agent connection is closed after."""

    def __init__(self, username: str, paths: Sequence[str], *, identities_only: bool,
                 use_agent: bool = True, ssh_config: Any = None) -> None:
        super().__init__(ssh_config=ssh_config)
        self.username = username
        self.paths = list(paths)
        self.identities_only = identities_only
        self.use_agent = use_agent
        self.offers: list[Offer] = []

    def agent_socket(self) -> str | None:
        if not self.use_agent:
            return None
        return os.environ.get("SSH_AUTH_SOCK") or None

    def get_sources(self) -> Iterator[_Offered]:
        for offer in self.offers:
            yield _Offered(self.username, offer)

    def authenticate(self, transport: paramiko.Transport) -> list[SourceResult]:
        socket = self.agent_socket()
        agent = paramiko.Agent() if socket else None
        try:
            keys = _agent_keys(agent)
            identities = [read_identity(p) for p in self.paths]
            self.offers = plan(identities, keys, self.identities_only)
            try:
                return super().authenticate(transport)
            except AuthFailure as failure:
                state = AgentState(socket, len(keys))
                tried = [f"{r.source!r}: {_outcome(r.result)}" for r in failure.result]
                raise KeysRefused(self.username, tried,
                                  unusable(identities, keys, self.identities_only, state),
                                  state) from None
        finally:
            if agent is not None:
                agent.close()


def _agent_keys(agent: paramiko.Agent | None) -> list[paramiko.PKey]:
    if agent is None:
        return []
    try:
        return list(agent.get_keys())
    except paramiko.SSHException:
        return []
