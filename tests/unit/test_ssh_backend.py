"""The SSH backend without a network: host-key policies against a fake known_hosts, exception
translation, sync file selection."""
from __future__ import annotations

import errno
import socket
from pathlib import Path

import paramiko
import pytest
from paramiko.ssh_exception import NoValidConnectionsError

from cluster.backends.ssh import (AcceptNewPolicy, Attempt, AuthFailed, HostKeyChanged,
                                  HostKeyUnknown, KnownHosts, OffPolicy, SshBackend, SshError,
                                  StrictPolicy, Unreachable, UnknownKey, known_hosts_for,
                                  sftp_path, translate)
from cluster.errors import ClusterError, PreflightError
from cluster.backends.ssh.identities import AgentState, KeysRefused


@pytest.fixture(scope="module")
def keys() -> tuple[paramiko.PKey, paramiko.PKey]:
    return paramiko.ECDSAKey.generate(), paramiko.ECDSAKey.generate()


AT = Attempt(name="gpu1", hostname="10.0.0.1", port=22, user="alice",
             keys=("/home/alice/.ssh/id_ed25519",), agent=False, timeout=10.0,
             known_hosts=("/home/alice/.ssh/known_hosts",))


def client_with(known: KnownHosts) -> paramiko.SSHClient:
    """The client a policy is handed. Its own HostKeys stay empty: the policies read known
    (hostkeys.py), so paramiko asks them about every key."""
    return paramiko.SSHClient()


# --- policies ------------------------------------------------------------------------------


def test_strict_refuses_unknown(tmp_path, keys):
    known = KnownHosts([str(tmp_path / "known_hosts")], str(tmp_path / "known_hosts"))
    with pytest.raises(UnknownKey) as info:
        StrictPolicy().missing_host_key(client_with(known), "10.0.0.1", keys[0])
    err = translate(info.value, AT, known)
    assert isinstance(err, HostKeyUnknown) and isinstance(err, PreflightError)
    text = str(err)
    assert "gpu1" in text and "ssh-keyscan -H 10.0.0.1 >>" in text and "accept-new" in text
    assert not (tmp_path / "known_hosts").exists()


def test_strict_keyscan_hint_has_port(keys):
    at = Attempt(name="gpu1", hostname="h", port=2222, user="u", keys=(), agent=False, timeout=1)
    assert "ssh-keyscan -p 2222 -H h" in str(translate(UnknownKey("[h]:2222", keys[0]), at))


def test_accept_new_records_key(tmp_path, keys):
    path = tmp_path / "ssh" / "known_hosts"       # the directory does not exist yet
    known = KnownHosts([str(path)], str(path))
    said: list[str] = []
    AcceptNewPolicy(known, said.append).missing_host_key(client_with(known), "10.0.0.1", keys[0])
    AcceptNewPolicy(known, said.append).missing_host_key(client_with(known), "[h]:2222", keys[1])
    lines = path.read_text().splitlines()
    assert lines == [f"10.0.0.1 {keys[0].get_name()} {keys[0].get_base64()}",
                     f"[h]:2222 {keys[1].get_name()} {keys[1].get_base64()}"]
    reloaded = paramiko.HostKeys(str(path))
    assert reloaded.lookup("10.0.0.1")[keys[0].get_name()] == keys[0]
    assert len(said) == 2 and str(path) in said[0]
    assert oct(path.parent.stat().st_mode & 0o777) == "0o700"


def test_off_accepts_anything(keys):
    assert OffPolicy().missing_host_key(paramiko.SSHClient(), "x", keys[0]) is None


def test_changed_key_names_the_line(tmp_path, keys):
    path = tmp_path / "known_hosts"
    hashed = paramiko.HostKeys.hash_host("10.0.0.1")
    path.write_text(f"# comment\nother {keys[0].get_name()} {keys[0].get_base64()}\n"
                    f"{hashed} {keys[0].get_name()} {keys[0].get_base64()}\n")
    known = KnownHosts([str(path)], str(path))
    assert known.lines_for("10.0.0.1") == [(str(path), 3, keys[0].get_name())]
    exc = paramiko.BadHostKeyException("10.0.0.1", keys[1], keys[0])
    err = translate(exc, AT, known)
    assert isinstance(err, HostKeyChanged)
    text = str(err)
    assert "HOST KEY CHANGED" in text and f"{path} line 3" in text
    assert "man-in-the-middle" in text and f"ssh-keygen -R 10.0.0.1 -f {path}" in text


def test_known_hosts_files_from_ssh_config(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    k = known_hosts_for({"userknownhostsfile": "~/a ~/b"})
    assert k.files[:3] == [str(tmp_path / "a"), str(tmp_path / "b"),
                           str(tmp_path / ".ssh" / "known_hosts")]
    assert k.write_to == str(tmp_path / "a")
    d = known_hosts_for({})
    assert d.write_to == str(tmp_path / ".ssh" / "known_hosts")


# --- exception translation -----------------------------------------------------------------


@pytest.mark.parametrize("exc, cls, words", [
    (NoValidConnectionsError({("10.0.0.1", 22): OSError(errno.ECONNREFUSED, "refused")}),
     Unreachable, ["gpu1", "connection refused"]),
    (NoValidConnectionsError({("10.0.0.1", 22): OSError(errno.EHOSTUNREACH, "unreach")}),
     Unreachable, ["no route"]),
    (socket.timeout("timed out"), Unreachable, ["timed out after 10 s", "connect_timeout"]),
    (socket.gaierror(-2, "Name or service not known"), Unreachable, ["cannot resolve"]),
    (OSError(errno.ENETUNREACH, "x"), Unreachable, ["network unreachable"]),
    (paramiko.AuthenticationException("Authentication failed."), AuthFailed,
     ["user 'alice'", "/home/alice/.ssh/id_ed25519", "identity_file"]),
    (paramiko.SSHException("Error reading SSH protocol banner"), Unreachable, ["banner"]),
    (paramiko.SSHException("something else"), SshError, ["something else"]),
    (EOFError(), Unreachable, ["closed the connection"]),
])
def test_translate(exc, cls, words):
    err = translate(exc, AT)
    assert type(err) is cls and isinstance(err, ClusterError)
    assert err.exit_code == 3
    text = str(err)
    assert text.startswith("gpu1 (alice@10.0.0.1:22)")
    for w in words:
        assert w in text, text


# --- sync selection, paths, construction ---------------------------------------------------


def test_sftp_path():
    assert sftp_path("~/x/y") == "x/y" and sftp_path("~") == "." and sftp_path("/abs") == "/abs"


def test_backend_sync_targets_and_policy():
    b = SshBackend(sync=["/src", ("/train", "cluster-train")], host_key_policy="accept-new")
    try:
        assert b.sync == [("/src", "."), ("/train", "cluster-train")]
        assert b.policy == "accept-new" and b.name == "ssh"
    finally:
        b.close()
    with pytest.raises(ClusterError, match="valid: strict, accept-new, off"):
        SshBackend(host_key_policy="yes")


def test_only_ssh_package_imports_paramiko():
    root = Path(__file__).resolve().parents[2] / "cluster"
    offenders = [p for p in root.rglob("*.py") if p.parent.name != "ssh"
                 and any(w in p.read_text() for w in ("import paramiko", "import fabric",
                                                      "from paramiko", "from fabric"))]
    assert offenders == []


def test_connections_made_at_once_from_many_threads_share_one_unwritten_config(tmp_path: Path) -> None:
    """One Fabric config for every connection (a clone each cost ~15 ms per node), which nothing
    writes into: a write re-merges it, and other threads reading it meanwhile raised "No
    attribute or config key found for 'gateway'" at 128 nodes. A write would raise here."""
    import threading
    from cluster.backends.ssh.transport import SshTransport, fabric_config
    from cluster.spec import Host, SshSettings
    config = fabric_config(None)
    before = dict(config)
    made, errors = [], []
    start = threading.Barrier(64)

    def make(i: int) -> None:
        host = Host(name=f"n{i}", address=f"10.9.{i // 250}.{i % 250 + 1}", user="u", port=22)
        transport = SshTransport(host, SshSettings(), "off", config, warn=lambda _: None)
        start.wait()
        try:
            for _ in range(5):
                made.append(transport._make(host.address, "u", 22, 5.0))
        except Exception as exc:          # noqa: BLE001 - the race, reported below
            errors.append(repr(exc))

    threads = [threading.Thread(target=make, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(made) == 320 and all(c.config is config for c in made)
    assert dict(config) == before                   # the shared config was never written


def test_the_shared_config_refuses_a_write_and_a_jump_hosts_node_gets_its_own(tmp_path: Path) -> None:
    """Fabric writes a ProxyJump hop's IdentityFile lines into its node's config: that node's
    connection has a clone of its own, and the hop's options from the ssh config are there."""
    from cluster.backends.ssh.transport import SshTransport, fabric_config
    from cluster.spec import Host, SshSettings
    ssh = tmp_path / "config"
    ssh.write_text("Host inner\n    ProxyJump bastion\nHost bastion\n    User hopper\n"
                   "    IdentityFile ~/.ssh/hop_key\nHost plain\n    IdentityFile ~/.ssh/own_key\n")
    config = fabric_config(str(ssh))
    with pytest.raises(RuntimeError, match="shared Fabric config was written"):
        config.connect_kwargs["key_filename"] = ["x"]
    host = Host(name="inner", address="inner", user="u", port=22)
    conn = SshTransport(host, SshSettings(), "off", config, warn=lambda _: None)._make(
        "inner", "u", 22, 5.0)
    assert conn.config is not config
    assert conn.gateway.user == "hopper" and conn.gateway.host == "bastion"
    assert any(k.endswith("hop_key") for k in conn.gateway.connect_kwargs["auth_strategy"].paths)
    # A host with IdentityFile lines of its own, no jump: the shared config, nothing written
    # (Fabric adds those lines to a Connection's connect_kwargs when it is given none).
    host = Host(name="plain", address="plain", user="u", port=22)
    conn = SshTransport(host, SshSettings(), "off", config, warn=lambda _: None)._make(
        "plain", "u", 22, 5.0)
    assert conn.config is config
    assert any(k.endswith("own_key") for k in conn.connect_kwargs["auth_strategy"].paths)
    # Fabric's clone() reads the ssh config files again into the config it clones from: with
    # a config loaded from files, N connections left N copies of every block (and each clone
    # deep-copied them all). Ours is given as an object: cloning adds nothing.
    blocks = len(config.base_ssh_config._config)
    for name in ("inner", "plain") * 20:
        SshTransport(Host(name=name, address=name, user="u", port=22), SshSettings(), "off",
                     config, warn=lambda _: None)._make(name, "u", 22, 5.0)
    assert len(config.base_ssh_config._config) == blocks


class FakeHop:
    """A jump-host connection as Gateways sees it: opened at most once, or failing."""

    def __init__(self, host: str, fail: bool = False) -> None:
        self.user, self.host, self.port, self.gateway = "u", host, 22, None
        self.opened, self.fail, self.is_connected = 0, fail, False

        class Transport:
            def set_keepalive(self, seconds: int) -> None:
                self.seconds = seconds
        self.transport = Transport()

    def open(self) -> None:
        import time
        self.opened += 1
        time.sleep(0.05)                  # long enough for the other threads to pile up
        if self.fail:
            raise OSError("jump host unreachable")
        self.is_connected = True

    def close(self) -> None:
        self.is_connected = False


def test_one_connection_per_jump_host_opened_once_and_a_failure_shared(monkeypatch) -> None:
    import threading
    from cluster.backends.ssh import transport as tr
    monkeypatch.setattr(tr, "Connection", FakeHop)      # hop_key tells hops from strings
    gateways = tr.Gateways()
    hops = [FakeHop("bastion") for _ in range(50)]
    shared = [gateways.share(h) for h in hops]
    assert {id(s) for s, _ in shared} == {id(hops[0])} and [new for _, new in shared].count(True) == 1
    threads = [threading.Thread(target=gateways.open, args=(hops[0], 15.0)) for _ in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert hops[0].opened == 1 and hops[0].transport.seconds == 15

    down, _ = gateways.share(FakeHop("down", fail=True))
    errors = []
    for _ in range(5):
        try:
            gateways.open(down, 15.0)
        except OSError as exc:
            errors.append(str(exc))
    assert down.opened == 1 and errors == ["jump host unreachable"] * 5   # tried once, told to all
    gateways.close()
    assert not hops[0].is_connected


@pytest.mark.parametrize("exc", [
    paramiko.AuthenticationException("Authentication failed."),
    KeysRefused("alice", [], [], AgentState(None)),
])
def test_a_refused_login_names_the_command_line_options_too(exc):
    """`cluster doctor --hosts a,b` has no inventory to set user/identity_file in: the fix
    names --user and --identity as well (tried as a newcomer: the hint named only the
    inventory and ~/.ssh/config)."""
    text = str(translate(exc, AT))
    assert "--user" in text and "--identity" in text, text
