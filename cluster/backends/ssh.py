"""SSH backend: every node over SSH. The only module that imports Fabric and paramiko.

Fabric supplies the ~/.ssh/config handling (User, Port, IdentityFile, HostName, ProxyJump,
ProxyCommand); the inventory's own user, port and identity_file win when they are set. Channels
and SFTP are plain paramiko on the connection Fabric opened.

    SshTransport   one node: run / spawn / put, connected at first use (so in parallel,
                   from the backend's thread pool), never prompting
    SshBackend     SupervisedBackend over SshTransport, plus `--sync` in the check phase

Host keys (never paramiko's AutoAddPolicy):
    strict      the key must already be in known_hosts; unknown -> refused, with the fix
    accept-new  an unknown key is accepted and appended to known_hosts; a changed one refused
    off         anything is accepted, with one warning

paramiko and socket exceptions are translated here, at the boundary, into the ClusterError
subclasses below; each message names the host and what was tried.
"""
from __future__ import annotations

import errno
import os
import posixpath
import select
import shlex
import socket
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import paramiko
from fabric import Config, Connection
from paramiko.hostkeys import HostKeyEntry, HostKeys

from ..errors import ClusterError, PreflightError
from ..spec import Host, SshSettings
from ..plan import LaunchPlan, NodePlan, shpath
from .supervised import Result, SupervisedBackend

KEEPALIVE_S = 5.0
KEEPALIVE_MISSES = 3                  # no answer for 3 intervals: the node is gone
SKIP_NAMES = frozenset({"__pycache__", ".git", ".cluster", ".mypy_cache", ".pytest_cache"})
SKIP_TOP = frozenset({"runs"})        # the local run records, at the top of a synced dir
SKIP_SUFFIXES = (".pyc", ".pyo")
TRAINER_SUBDIR = "cluster-train"


# --- errors --------------------------------------------------------------------------------
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


# --- host keys -----------------------------------------------------------------------------


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


# --- exception translation -----------------------------------------------------------------


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
    if isinstance(exc, UnknownKey):
        scan = f"ssh-keyscan{' -p ' + str(at.port) if at.port != 22 else ''} -H {at.hostname}"
        target = known.write_to if known else "~/.ssh/known_hosts"
        return HostKeyUnknown(
            f"{at.where}: host key not in known_hosts ({', '.join(at.known_hosts) or target}); "
            f"server offers {exc.key.get_name()} {fingerprint(exc.key)}. Verify it, then add it: "
            f"`{scan} >> {target}`, or run with --host-key-policy accept-new")
    if isinstance(exc, paramiko.BadHostKeyException):
        lines = known.lines_for(exc.hostname) if known else []
        where = "; ".join(f"{f} line {n} ({t})" for f, n, t in lines) or "known_hosts"
        return HostKeyChanged(
            f"{at.where}: HOST KEY CHANGED: the server sent {exc.key.get_name()} "
            f"{fingerprint(exc.key)}, which does not match {where}. Someone may be intercepting "
            f"the connection (man-in-the-middle), or the host was reinstalled. Refusing to "
            f"connect. If the change is expected, remove the old key with "
            f"`ssh-keygen -R {exc.hostname}"
            f"{' -f ' + lines[0][0] if lines else ''}` and connect again")
    if isinstance(exc, paramiko.AuthenticationException):
        keys = ", ".join(at.keys) if at.keys else "none given"
        extra = " and the ssh agent" if at.agent else ""
        return AuthFailed(f"{at.where}: authentication failed for user {at.user!r} "
                          f"(keys tried: {keys}{extra}; no password prompts in batch mode): {exc}. "
                          f"Set 'user'/'identity_file' in the inventory or ~/.ssh/config")
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


# --- configuration -------------------------------------------------------------------------


def fabric_config(path: str | None) -> Config:
    """Fabric's config with the given ssh config file (missing is fine) and the system one."""
    user = os.path.expanduser(path) if path else os.devnull
    system = "/etc/ssh/ssh_config" if path else os.devnull
    return Config(user_ssh_path=user, system_ssh_path=system)


def _split_files(value: Any) -> list[str]:
    if not value:
        return []
    items = value if isinstance(value, list) else str(value).split()
    return [os.path.expanduser(v) for v in items if v and v != "none"]


# --- one node ------------------------------------------------------------------------------


class SshChannel:
    """A streaming remote command: combined output, exit status, None when the link broke.
    Its stdin is kept open: when `cluster up` dies, sshd closes it and the supervisor stops."""

    def __init__(self, chan: paramiko.Channel) -> None:
        self.chan = chan

    def read(self) -> bytes:
        try:
            return self.chan.recv(65536)
        except (OSError, EOFError, paramiko.SSHException):
            return b""

    def wait(self) -> int | None:
        self.chan.status_event.wait()
        code = self.chan.exit_status
        if code != -1:
            return code
        transport = self.chan.get_transport()
        if transport is None or not transport.is_active():
            return None
        # closed without an exit status: sshd sent exit-signal (paramiko drops it)
        return 255

    def close(self) -> None:
        try:
            self.chan.close()
        except Exception:
            pass


class SshTransport:
    """One node over SSH. Connects at first use; every method is safe from several threads."""

    def __init__(self, host: Host, settings: SshSettings, policy: str, config: Config,
                 warn: Callable[[str], None]) -> None:
        self.host = host
        self.label = host.name
        self.settings = settings
        self.policy = policy
        self.config = config
        self.known: KnownHosts | None = None     # the files checked, once connecting
        self.warn = warn
        self._lock = threading.Lock()
        self._conn: Connection | None = None
        self._sftp: paramiko.SFTPClient | None = None
        self._error: ClusterError | None = None
        self._closed = threading.Event()
        self.attempt: Attempt | None = None

    # -- connecting --

    def _connection(self) -> Connection:
        with self._lock:
            if self._conn is not None and self._conn.transport is not None \
                    and self._conn.transport.is_active():
                return self._conn
            if self._conn is not None:       # it was connected and broke: no silent reconnect
                raise SshError(f"{self.attempt.where if self.attempt else self.label}: "
                               f"the connection was lost")
            if self._error is not None:
                raise self._error
            try:
                self._conn = self._open()
            except ClusterError as exc:
                self._error = exc
                raise
            return self._conn

    def _open(self) -> Connection:
        timeout = float(self.settings.connect_timeout)
        conn = self._make(self.host.address, self.host.user, self.host.port, timeout)
        at = self.attempt = self._attempt(conn, timeout)
        try:
            conn.open()
        except BaseException as exc:  # noqa: BLE001 - translated, never swallowed
            try:
                conn.close()
            except Exception:
                pass
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            raise translate(exc, at, self.known) from None
        transport = conn.transport
        transport.set_keepalive(int(KEEPALIVE_S))
        threading.Thread(target=self._heartbeat, args=(transport,), daemon=True,
                         name=f"ssh-heartbeat-{self.label}").start()
        return conn

    def _make(self, address: str, user: str | None, port: int | None, timeout: float) -> Connection:
        ssh_cfg = self.config.base_ssh_config.lookup(address)
        keys = [os.path.expanduser(self.host.identity_file)] if self.host.identity_file else []
        keys += [k for k in _split_files(ssh_cfg.get("identityfile")) if k not in keys]
        only = str(ssh_cfg.get("identitiesonly", "no")).lower() == "yes"
        connect_kwargs: dict[str, Any] = {
            "timeout": timeout, "banner_timeout": timeout, "auth_timeout": timeout,
            "channel_timeout": timeout, "allow_agent": not only, "look_for_keys": not only,
            "passphrase": None, "password": None,
        }
        present = [k for k in keys if os.path.exists(k)]
        if present:
            connect_kwargs["key_filename"] = present
        conn = Connection(address, user=user, port=port, config=self.config,
                          connect_kwargs=connect_kwargs)
        conn.connect_timeout = None          # the timeout travels in connect_kwargs (a float)
        self.known = self._secure(conn, ssh_cfg)
        gateway = conn.gateway
        while isinstance(gateway, Connection):
            gateway.connect_kwargs = {**gateway.connect_kwargs, "timeout": timeout,
                                      "banner_timeout": timeout, "auth_timeout": timeout,
                                      "passphrase": None, "password": None}
            gateway.connect_timeout = None
            self._secure(gateway, gateway.ssh_config)
            gateway = gateway.gateway
        return conn

    def _secure(self, conn: Connection, ssh_cfg: Any) -> KnownHosts | None:
        """Our host key policy on this connection's client, with known_hosts loaded into it."""
        client = conn.client
        if self.policy == "off":
            client.set_missing_host_key_policy(OffPolicy())
            if not _off_warned.is_set():
                _off_warned.set()
                self.warn("WARNING: host keys are not checked (--host-key-policy off); "
                          "anyone on the network path can impersonate the nodes")
            return None
        known = known_hosts_for(ssh_cfg)
        known.load_into(client.get_host_keys())
        if self.policy == "accept-new":
            client.set_missing_host_key_policy(AcceptNewPolicy(known, self.warn))
        else:
            client.set_missing_host_key_policy(StrictPolicy())
        return known

    def _attempt(self, conn: Connection, timeout: float) -> Attempt:
        kw = conn.connect_kwargs
        keys = tuple(kw.get("key_filename") or ())
        if kw.get("look_for_keys", True):
            keys += ("~/.ssh/id_*",)
        files = tuple(self.known.files) if self.known else ()
        return Attempt(name=self.host.name, hostname=conn.host, port=conn.port, user=conn.user,
                       keys=keys, agent=bool(kw.get("allow_agent", True)
                                             and os.environ.get("SSH_AUTH_SOCK")),
                       timeout=timeout, known_hosts=files)

    def _heartbeat(self, transport: paramiko.Transport) -> None:
        """Ask for a reply every KEEPALIVE_S; none for KEEPALIVE_MISSES intervals closes the
        transport, which ends every channel (Channel.wait() -> None: the node is lost)."""
        while not self._closed.wait(KEEPALIVE_S):
            if not transport.is_active():
                return
            answered = threading.Event()

            def ask() -> None:
                try:
                    transport.global_request("keepalive@openssh.com", wait=True)
                finally:
                    answered.set()
            threading.Thread(target=ask, daemon=True).start()
            if not answered.wait(KEEPALIVE_S * KEEPALIVE_MISSES):
                self.warn(f"[{self.label}] no answer over SSH for "
                          f"{KEEPALIVE_S * KEEPALIVE_MISSES:g} s; treating the node as lost")
                transport.close()
                return

    def _session(self) -> paramiko.Channel:
        conn = self._connection()
        try:
            return conn.transport.open_session(timeout=float(self.settings.connect_timeout))
        except (paramiko.SSHException, EOFError, OSError) as exc:
            raise SshError(f"{self.attempt.where if self.attempt else self.label}: "
                           f"cannot open a session: {exc}") from None

    # -- the Transport protocol --

    def run(self, command: str, *, timeout: float | None = None) -> Result:
        chan = self._session()
        chan.exec_command(command)
        chan.shutdown_write()
        out, err = bytearray(), bytearray()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = 0.5 if deadline is None else max(0.0, min(0.5, deadline - time.monotonic()))
            try:
                select.select([chan], [], [], left)
            except (OSError, ValueError):
                time.sleep(0.01)
            while chan.recv_ready():
                out += chan.recv(65536)
            while chan.recv_stderr_ready():
                err += chan.recv_stderr(65536)
            if chan.exit_status_ready():
                while chan.recv_ready():
                    out += chan.recv(65536)
                while chan.recv_stderr_ready():
                    err += chan.recv_stderr(65536)
                code = chan.exit_status
                transport = chan.get_transport()
                chan.close()
                if code == -1:
                    lost = transport is None or not transport.is_active()
                    return Result(None if lost else 255, bytes(out), bytes(err))
                return Result(code, bytes(out), bytes(err))
            if deadline is not None and time.monotonic() >= deadline:
                chan.close()
                return Result(None, bytes(out), bytes(err) + b"timed out")

    def spawn(self, command: str) -> SshChannel:
        chan = self._session()
        chan.set_combine_stderr(True)
        chan.exec_command(command)
        return SshChannel(chan)

    def sftp(self) -> paramiko.SFTPClient:
        conn = self._connection()
        with self._lock:
            if self._sftp is None:
                try:
                    self._sftp = conn.client.open_sftp()
                except (paramiko.SSHException, EOFError, OSError) as exc:
                    raise SshError(f"{self.label}: cannot start SFTP: {exc}") from None
            return self._sftp

    def put(self, data: bytes, path: str, mode: int) -> None:
        sftp = self.sftp()
        target = sftp_path(path)
        tmp = posixpath.join(posixpath.dirname(target), f".{posixpath.basename(target)}.tmp")
        try:
            with sftp.open(tmp, "wb") as f:
                f.set_pipelined(True)
                f.write(data)
            sftp.chmod(tmp, mode)
            sftp.posix_rename(tmp, target)
        except (OSError, paramiko.SSHException, EOFError) as exc:
            raise ClusterError(f"{self.label}: cannot write {path}: {exc}") from None

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            conn, self._conn = self._conn, None
            sftp, self._sftp = self._sftp, None
        for thing in (sftp, conn):
            if thing is not None:
                try:
                    thing.close()
                except Exception:
                    pass


def sftp_path(path: str) -> str:
    """SFTP starts in the home directory: '~/x' is 'x' there."""
    if path == "~":
        return "."
    return path[2:] if path.startswith("~/") else path


# --- sync ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class LocalFile:
    rel: str
    path: Path
    size: int
    mtime: int
    mode: int


def local_files(root: str | Path) -> list[LocalFile]:
    """Files to sync under root: no __pycache__, .git, .cluster, top-level runs/, *.pyc."""
    root = Path(root)
    out: list[LocalFile] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        top = Path(dirpath) == root
        dirnames[:] = sorted(d for d in dirnames
                             if d not in SKIP_NAMES and not (top and d in SKIP_TOP))
        for name in sorted(filenames):
            if name.endswith(SKIP_SUFFIXES):
                continue
            p = Path(dirpath) / name
            try:
                st = p.stat()
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            out.append(LocalFile(p.relative_to(root).as_posix(), p, st.st_size,
                                 int(st.st_mtime), stat.S_IMODE(st.st_mode)))
    return out


def sync_dir(transport: SshTransport, local: str | Path, remote: str) -> dict[str, Any]:
    """Copy local's files into remote (a directory on the node, may start with ~), skipping
    the ones whose size and mtime already match; uploaded files get the local mtime."""
    files = local_files(local)
    tops = sorted({f.rel.split("/", 1)[0] for f in files})
    listing = " ".join(shlex.quote(t) for t in tops)
    cmd = (f"mkdir -p {shpath(remote)} && cd {shpath(remote)} && pwd && "
           + (f"{{ find {listing} -type f -printf '%p\\t%s\\t%T@\\n' 2>/dev/null || true; }}"
              if tops else "true"))
    res = transport.run(cmd, timeout=120)
    if res.code != 0:
        raise ClusterError(f"sync: cannot list {remote}: {res.text()[-300:]}")
    lines = res.stdout.decode(errors="replace").splitlines()
    base = lines[0].strip()
    have: dict[str, tuple[int, int]] = {}
    for line in lines[1:]:
        parts = line.rsplit("\t", 2)
        if len(parts) == 3:
            try:
                have[parts[0]] = (int(parts[1]), int(float(parts[2])))
            except ValueError:
                continue
    todo = [f for f in files if have.get(f.rel) != (f.size, f.mtime)]
    if todo:
        dirs = sorted({posixpath.dirname(f.rel) for f in todo} - {""})
        if dirs:
            made = transport.run(f"cd {shlex.quote(base)} && mkdir -p -- "
                                 + " ".join(shlex.quote(d) for d in dirs), timeout=60)
            if made.code != 0:
                raise ClusterError(f"sync: cannot create directories in {base}: {made.text()[-300:]}")
        sftp = transport.sftp()
        for f in todo:
            target = f"{base}/{f.rel}"
            try:
                with open(f.path, "rb") as src, sftp.open(target, "wb") as dst:
                    dst.set_pipelined(True)
                    while chunk := src.read(1 << 20):
                        dst.write(chunk)
                sftp.chmod(target, f.mode & 0o777)
                sftp.utime(target, (f.mtime, f.mtime))
            except (OSError, paramiko.SSHException, EOFError) as exc:
                raise ClusterError(f"sync: cannot copy {f.path} to {target}: {exc}") from None
    return {"dir": base, "files": len(files), "copied": len(todo),
            "bytes": sum(f.size for f in todo)}


# --- the backend ---------------------------------------------------------------------------


def _stderr_warn(text: str) -> None:
    sys.stderr.write(f"cluster: {text}\n")
    sys.stderr.flush()


class SshBackend(SupervisedBackend):
    """Every node over SSH, each running cluster/remote/supervisor.py.

    sync: directories copied to every node in the check phase. A plain path lands in the
    node's workdir; a (path, subdir) pair in <workdir>/<subdir> (the built-in trainer goes to
    <workdir>/cluster-train, which is where `cluster up` with no script points torchrun).
    """

    name = "ssh"

    def __init__(self, settings: SshSettings | None = None, *, host_key_policy: str | None = None,
                 sync: Iterable[str | tuple[str, str]] = (), warn: Callable[[str], None] | None = None,
                 max_workers: int = 64) -> None:
        self.settings = settings or SshSettings()
        self.policy = host_key_policy or self.settings.host_key_policy
        if self.policy not in ("strict", "accept-new", "off"):
            raise ClusterError(f"unknown host key policy {self.policy!r} "
                               f"(valid: strict, accept-new, off)")
        self.warn = warn or _stderr_warn
        self.sync: list[tuple[str, str]] = [(s, ".") if isinstance(s, str) else (s[0], s[1])
                                            for s in sync]
        self.config = fabric_config(self.settings.config)
        self.synced: dict[str, list[dict[str, Any]]] = {}
        super().__init__(self._connect, max_workers=max_workers)

    def _connect(self, host: Host) -> SshTransport:
        return SshTransport(host, self.settings, self.policy, self.config, self.warn)

    def check(self, plan: LaunchPlan) -> dict[str, dict[str, Any]]:
        if self.sync:
            self._sync_all(plan)
        return super().check(plan)

    def _sync_all(self, plan: LaunchPlan) -> None:
        def one(node: NodePlan) -> list[dict[str, Any]]:
            transport = self.transport(node.host)
            reports = []
            for local, sub in self.sync:
                remote = node.host.workdir.rstrip("/") or "/"
                if sub not in ("", "."):
                    remote = f"{remote}/{sub}"
                reports.append(sync_dir(transport, local, remote))
            return reports
        results = self.each(plan.nodes, one)
        failures = {n.label: str(r) for n, r in results if isinstance(r, Exception)}
        if failures:
            lines = "\n".join(f"  {label}: {why}" for label, why in failures.items())
            raise PreflightError(f"{len(failures)} of {len(plan.nodes)} node(s) failed the checks; "
                                 f"nothing was started ({len(plan.nodes) - len(failures)} ready)",
                                 details=lines)
        self.synced = {n.host.name: r for n, r in results}
