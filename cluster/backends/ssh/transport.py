"""One node over SSH: connect (at first use, never prompting), run, stream, write files."""
from __future__ import annotations

import os
import posixpath
import select
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import paramiko
from fabric import Config, Connection

from ...errors import ClusterError
from ...spec import Host, SshSettings
from ..transport import Result
from .errors import Attempt, SshError, translate
from .hostkeys import (AcceptNewPolicy, KnownHosts, OffPolicy, StrictPolicy, known_hosts_for,
                       split_files, transport_preferring, warn_unchecked_once)
from .identities import BatchAuth, identity_paths
from .keepalive import KEEPALIVE_PROBES, Keepalive
from .known_hosts import key_name
from .sshconfig import IndexedSSHConfig, host_config


class SharedConfig(Config):
    """The one Fabric config every node's Connection is given. A clone per connection cost the
    node count squared: Fabric's clone() reads the ssh config files again into the config it
    clones from, so each connection added every block of them once more, and each clone
    deep-copied them all (703 MB at 1,000 nodes). Its ssh config is given as an object, which
    Fabric never reads again. Shared, nothing may write into it: a write re-merges the whole
    config, and another thread reading it meanwhile found it empty ("No attribute or config
    key found for 'gateway'" at 128 nodes). So a write raises. Fabric writes a host's
    IdentityFile lines into the config's connect_kwargs unless the Connection is given its own
    (_make gives them), and a ProxyJump hop's lines into the config its node's Connection has:
    a node behind a jump host gets a clone of its own (its clones are writable)."""

    def _modify(self, keypath: Any, key: str, value: Any) -> None:
        self._refuse(key)
        super()._modify(keypath, key, value)

    def _remove(self, keypath: Any, key: str) -> None:
        self._refuse(key)
        super()._remove(keypath, key)

    def _refuse(self, key: str) -> None:
        if self.__dict__.get("_shared"):
            raise RuntimeError(f"cluster: the shared Fabric config was written ({key!r})")


class NodeConnection(Connection):
    """Fabric's Connection with `inline_ssh_env` a plain attribute. Fabric sets it on every
    Connection, and an attribute its class does not declare is written into the connection's
    config (invoke's DataProxy), which here is the shared one."""

    inline_ssh_env = None


def fabric_config(path: str | None) -> SharedConfig:
    """Fabric's config with the given ssh config file (missing is fine) and the system one,
    shared by every connection (SharedConfig)."""
    files = [os.path.expanduser(path), "/etc/ssh/ssh_config"] if path else []
    config = SharedConfig(ssh_config=IndexedSSHConfig.from_files(files))
    config._set(_shared=True)
    return config


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

    def fileno(self) -> int:
        return self.chan.fileno()       # paramiko's pipe: readable when recv() will not wait

    def write(self, data: bytes) -> None:
        try:
            self.chan.sendall(data)
        except (OSError, EOFError, paramiko.SSHException) as exc:
            raise ClusterError(f"cannot write to the node: {exc}") from None

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


class Gateways:
    """One connection per jump host (ProxyJump), shared by every node behind it: a thousand
    nodes behind one bastion are a thousand channels over one SSH connection, not a thousand
    logins at once, which sshd's MaxStartups (10:30:100 by default) starts refusing after ten.
    A jump host that cannot be reached is tried once; every node behind it gets that error."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._shared: dict[tuple[Any, ...], Connection] = {}
        self._opening: dict[tuple[Any, ...], threading.Lock] = {}
        self._failed: dict[tuple[Any, ...], BaseException] = {}

    def share(self, gateway: Connection) -> tuple[Connection, bool]:
        """The shared connection for this hop (and the hops before it); True when it is new."""
        key = hop_key(gateway)
        with self._lock:
            if key in self._shared:
                return self._shared[key], False
            self._shared[key] = gateway
            self._opening[key] = threading.Lock()
            return gateway, True

    def open(self, gateway: Connection, keepalive: float) -> None:
        key = hop_key(gateway)
        with self._opening[key]:
            if key in self._failed:
                raise self._failed[key]
            if gateway.is_connected:
                return
            try:
                gateway.open()
            except BaseException as exc:   # noqa: BLE001 - kept for the nodes behind it
                self._failed[key] = exc
                raise
            gateway.transport.set_keepalive(max(1, int(keepalive)))

    def close(self) -> None:
        with self._lock:
            hops, self._shared = list(self._shared.values()), {}
        for gateway in hops:
            try:
                gateway.close()
            except Exception:
                pass


def hop_key(conn: Connection) -> tuple[Any, ...]:
    before = conn.gateway
    return (conn.user, conn.host, conn.port,
            hop_key(before) if isinstance(before, Connection) else before)


class SshTransport:
    """One node over SSH. Connects at first use; every method is safe from several threads."""

    def __init__(self, host: Host, settings: SshSettings, policy: str, config: Config,
                 warn: Callable[[str], None], gateways: Gateways | None = None,
                 keepalive: Keepalive | None = None) -> None:
        self.host = host
        self.gateways = gateways or Gateways()    # the backend passes one for all its nodes
        # ...and one keepalive: its two threads ask every connection of the launcher
        self.keepalive = keepalive or Keepalive(settings.keepalive, warn)
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
            if isinstance(conn.gateway, Connection):
                self.gateways.open(conn.gateway, self._probe_interval())
            conn.open()
        except BaseException as exc:  # noqa: BLE001 - translated, never swallowed
            try:
                conn.close()
            except Exception:
                pass
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            raise translate(exc, at, self.known) from None
        conn.transport.set_keepalive(max(1, int(self._probe_interval())))
        self.keepalive.watch(self.label, conn.transport)
        return conn

    def _make(self, address: str, user: str | None, port: int | None, timeout: float) -> Connection:
        found = host_config(self.config.base_ssh_config, self.host.name, address)
        ssh_cfg = found.options
        if found.set_aside:
            self.warn(f"[{self.label}] connecting to the inventory address {address}; "
                      f"HostName {found.set_aside} from the ssh config is not used")
        user = user or ssh_cfg.get("user") or self.config.user
        port = port or int(ssh_cfg.get("port", 22))
        # Behind a jump host, a config of its own: Fabric writes the hops' IdentityFile into it.
        # connect_kwargs of our own: without them Fabric adds the host's IdentityFile lines
        # into the config's (_prepare sets the real ones).
        config = self.config.clone() if "proxyjump" in ssh_cfg else self.config
        conn = NodeConnection(found.destination, user=user, port=port, config=config,
                              connect_kwargs={"timeout": timeout})
        conn.host, conn.ssh_config = found.destination, ssh_cfg
        conn.gateway = conn.get_gateway()   # ProxyJump/ProxyCommand of the merged options
        self._prepare(conn, timeout, self.host.identity_file)
        self.known = self._secure(conn, ssh_cfg)
        if not isinstance(conn.gateway, Connection):
            return conn
        conn.gateway, new = self.gateways.share(conn.gateway)
        gateway = conn.gateway if new else None        # a shared hop is prepared once
        while isinstance(gateway, Connection):
            self._prepare(gateway, timeout, None)
            self._secure(gateway, gateway.ssh_config)
            gateway = gateway.gateway
        return conn

    @staticmethod
    def _prepare(conn: Connection, timeout: float, identity_file: str | None) -> None:
        """Timeouts and batch-mode authentication (identities.py) for one hop."""
        ssh_cfg = conn.ssh_config
        paths = identity_paths(identity_file, split_files(ssh_cfg.get("identityfile")))
        auth = BatchAuth(conn.user, paths, ssh_config=ssh_cfg,
                         identities_only=str(ssh_cfg.get("identitiesonly", "no")).lower() == "yes",
                         use_agent=str(ssh_cfg.get("identityagent", "")).lower() != "none")
        conn.connect_kwargs = {"timeout": timeout, "banner_timeout": timeout,
                               "auth_timeout": timeout, "channel_timeout": timeout,
                               "auth_strategy": auth}
        conn.connect_timeout = None          # the timeout travels in connect_kwargs (a float)

    def _secure(self, conn: Connection, ssh_cfg: Any) -> KnownHosts | None:
        """Our host key policy on this connection's client (hostkeys.py); the key types
        known_hosts has for the host are asked for first."""
        client = conn.client
        if self.policy == "off":
            conn.connect_kwargs["transport_factory"] = transport_preferring(())
            client.set_missing_host_key_policy(OffPolicy())
            warn_unchecked_once(self.warn)
            return None
        known = known_hosts_for(ssh_cfg)
        types = known.key_types(key_name(conn.host, conn.port))
        conn.connect_kwargs["transport_factory"] = transport_preferring(types)
        if self.policy == "accept-new":
            client.set_missing_host_key_policy(AcceptNewPolicy(known, self.warn))
        else:
            client.set_missing_host_key_policy(StrictPolicy(known))
        return known

    def _attempt(self, conn: Connection, timeout: float) -> Attempt:
        auth = conn.connect_kwargs.get("auth_strategy")
        keys = tuple(auth.paths) if isinstance(auth, BatchAuth) else ()
        agent = isinstance(auth, BatchAuth) and auth.agent_socket() is not None
        files = tuple(self.known.files) if self.known else ()
        return Attempt(name=self.host.name, hostname=conn.host, port=conn.port, user=conn.user,
                       keys=keys, agent=agent, timeout=timeout, known_hosts=files)

    def _probe_interval(self) -> float:
        return max(0.2, float(self.settings.keepalive) / KEEPALIVE_PROBES)

    def _session(self) -> paramiko.Channel:
        conn = self._connection()
        try:
            return conn.transport.open_session(timeout=float(self.settings.connect_timeout))
        except (paramiko.SSHException, EOFError, OSError) as exc:
            raise SshError(f"{self.attempt.where if self.attempt else self.label}: "
                           f"cannot open a session: {exc}") from None

    # -- the Transport protocol --

    def open(self) -> None:
        self._connection()

    def run(self, command: str, *, timeout: float | None = None, input: bytes = b"") -> Result:
        chan = self._session()
        chan.exec_command(command)
        if input:
            chan.sendall(input)
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
        self._write(iter((data,)), len(data), path, mode, None, f"cannot write {path}")

    def upload(self, local: Path, path: str, mode: int, mtime: int) -> None:
        """Copy a local file to path, with its mode and modification time (for --sync)."""
        def chunks() -> Iterator[bytes]:
            with open(local, "rb") as src:
                while chunk := src.read(1 << 20):
                    yield chunk
        self._write(chunks(), local.stat().st_size, path, mode, mtime,
                    f"sync: cannot copy {local} to {self.label}:{path}")

    def download(self, path: str, into: BinaryIO) -> int:
        """Copy a file of the node into an open local file (for `cluster pull`), over the
        SFTP session --sync uses; returns the bytes that came."""
        try:
            return self.sftp().getfo(sftp_path(path), into)
        except (OSError, paramiko.SSHException, EOFError) as exc:
            raise ClusterError(f"cannot copy {self.label}:{path}: {exc}") from None

    def _write(self, chunks: Iterator[bytes], size: int, path: str, mode: int,
               mtime: int | None, what: str) -> None:
        """Write under a temporary name, check the size that arrived, then rename into place:
        a reader (or a run started meanwhile) never sees half a file. The size check matters:
        paramiko drops the server's answers to pipelined writes, so a full disk would
        otherwise leave a short file and no error."""
        sftp = self.sftp()
        target = sftp_path(path)
        tmp = posixpath.join(posixpath.dirname(target),
                             f".{posixpath.basename(target)}.cluster-tmp-{os.getpid()}")
        try:
            with sftp.open(tmp, "wb") as dst:
                dst.set_pipelined(True)
                for chunk in chunks:
                    dst.write(chunk)
            arrived = sftp.stat(tmp).st_size
            if arrived != size:
                self._remove(sftp, tmp)
                raise ClusterError(f"{what}: only {arrived} of {size} bytes arrived "
                                   f"(is the disk full there?)")
            sftp.chmod(tmp, mode)
            if mtime is not None:
                sftp.utime(tmp, (mtime, mtime))
            sftp.posix_rename(tmp, target)
        except (OSError, paramiko.SSHException, EOFError) as exc:
            self._remove(sftp, tmp)
            raise ClusterError(f"{what}: {exc}") from None

    @staticmethod
    def _remove(sftp: paramiko.SFTPClient, path: str) -> None:
        try:
            sftp.remove(path)
        except (OSError, paramiko.SSHException, EOFError):
            pass

    def close(self) -> None:
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
