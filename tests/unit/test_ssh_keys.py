"""SSH keys without a network: the known_hosts matcher (patterns, negation, hashed names, ports,
markers), the host key verdicts and policies, which identities are offered in which order, and
~/.ssh/config looked up by a host's name and address. Key files are made by the real ssh-keygen."""
from __future__ import annotations

import base64
import shutil
import socket
import subprocess
from pathlib import Path

import paramiko
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.backends.ssh import (AcceptNewPolicy, Attempt, AuthFailed, ChangedKey,
                                  HostKeyChanged, HostKeyRevoked, HostKeyUnknown, KeysRefused,
                                  KnownHosts, OffPolicy, RevokedKey, SshBackend, StrictPolicy,
                                  UnknownKey, known_hosts_for, translate)
from cluster.backends.ssh.hostkeys import preferred_algorithms, transport_preferring
from cluster.backends.ssh.identities import (AgentState, Identity, identity_paths,
                                             openssh_header, plan, read_identity, unusable)
from cluster.backends.ssh.known_hosts import (hash_name, host_matches, key_name, list_matches,
                                              parse_line, pattern_matches, read_entries)
from cluster.backends.ssh.sshconfig import host_config
from cluster.spec import Host, SshSettings

needs_keygen = pytest.mark.skipif(shutil.which("ssh-keygen") is None, reason="needs ssh-keygen")


@pytest.fixture(scope="module")
def keys() -> list[paramiko.PKey]:
    return [paramiko.ECDSAKey.generate() for _ in range(3)]


def line(hosts: str, key: paramiko.PKey, marker: str = "") -> str:
    return f"{marker + ' ' if marker else ''}{hosts} {key.get_name()} {key.get_base64()}"


def known_file(tmp_path: Path, *lines: str, name: str = "known_hosts") -> KnownHosts:
    path = tmp_path / name
    path.write_text("".join(f"{text}\n" for text in lines))
    return KnownHosts([str(path)], str(path))


AT = Attempt(name="gpu1", hostname="10.0.0.1", port=22, user="alice", keys=(), agent=False,
             timeout=10.0, known_hosts=("/home/alice/.ssh/known_hosts",))


# --- the matcher ---------------------------------------------------------------------------


@pytest.mark.parametrize("pattern, name, want", [
    ("10.77.*", "10.77.0.1", True),
    ("10.77.*", "10.78.0.1", False),
    ("*", "anything", True),
    ("node?", "node1", True),
    ("node?", "node12", False),
    ("gpu-*.example.com", "gpu-a.example.com", True),
    ("[10.0.0.1]:2222", "[10.0.0.1]:2222", True),      # brackets are literal, not a class
    ("[10.0.0.1]:2222", "1", False),
    ("[10.77.*]:2222", "[10.77.0.3]:2222", True),
    ("10.0.0.1", "10.0.0.10", False),
    ("a.b", "axb", False),                              # a dot is a dot
])
def test_pattern(pattern: str, name: str, want: bool) -> None:
    assert pattern_matches(pattern, name) is want


@pytest.mark.parametrize("patterns, name, want", [
    ("10.77.*,!10.77.0.3", "10.77.0.1", True),
    ("10.77.*,!10.77.0.3", "10.77.0.3", False),         # a negated match wins over a positive one
    ("!10.77.0.3,10.77.*", "10.77.0.3", False),         # in any order
    ("!10.77.0.3", "10.77.0.1", False),                 # negation alone names nothing
    ("gpu-a,gpu-b", "gpu-b", True),
    ("GPU-A", "gpu-a", True),                           # case is ignored
    ("gpu-a", "GPU-A", True),
])
def test_pattern_list(patterns: str, name: str, want: bool) -> None:
    assert list_matches(patterns, name) is want


def test_ports_are_part_of_the_name() -> None:
    assert key_name("h", 22) == "h" and key_name("h", 2222) == "[h]:2222"
    assert host_matches("[h]:2222", key_name("h", 2222))
    assert not host_matches("h", key_name("h", 2222))      # a port-22 line is not for 2222
    assert not host_matches("[h]:2222", key_name("h", 22))
    assert not host_matches("[h]:2222", key_name("h", 2200))


def test_hashed_names() -> None:
    hashed = hash_name("10.0.0.1")
    assert hashed.startswith("|1|")
    assert host_matches(hashed, "10.0.0.1") and not host_matches(hashed, "10.0.0.2")
    assert hash_name("10.0.0.1", b"salt") == hash_name("10.0.0.1", b"salt") != hashed
    port = hash_name("[h]:2222")
    assert host_matches(port, "[h]:2222") and not host_matches(port, "h")
    assert host_matches(paramiko.HostKeys.hash_host("gpu-a"), "gpu-a")      # same scheme
    assert not host_matches("|1|not-base64!|x", "gpu-a")


@needs_keygen
def test_hashed_by_ssh_keygen(tmp_path: Path, keys) -> None:
    path = tmp_path / "known_hosts"
    path.write_text(line("10.0.0.1", keys[0]) + "\n" + line("[10.0.0.2]:2222", keys[1]) + "\n")
    subprocess.run(["ssh-keygen", "-H", "-f", str(path)], check=True, capture_output=True)
    text = path.read_text()
    assert "10.0.0.1" not in text and "10.0.0.2" not in text
    entries = read_entries(str(path))
    assert [e.hashed for e in entries] == [True, True]
    assert entries[0].names("10.0.0.1") and entries[1].names("[10.0.0.2]:2222")
    assert not entries[1].names("10.0.0.2")


def test_parse_lines(keys) -> None:
    plain = parse_line(line("a,b", keys[0]) + " a comment", "f", 3)
    assert plain is not None and plain.marker is None and plain.hosts == "a,b"
    assert plain.blob == keys[0].asbytes() and plain.where == "f line 3" and plain.is_pattern
    revoked = parse_line(line("*", keys[0], "@revoked"), "f", 1)
    assert revoked is not None and revoked.marker == "revoked" and revoked.names("x")
    ca = parse_line(line("*.example.com", keys[0], "@cert-authority"), "f", 1)
    assert ca is not None and ca.marker == "cert-authority"
    for text in ("", "   ", "# a comment", line("x", keys[0], "@unknown-marker"),
                 "host ssh-ed25519", "host ssh-ed25519 not*base64"):
        assert parse_line(text, "f", 1) is None, text


# --- verdicts and policies -----------------------------------------------------------------


def test_verdicts(tmp_path: Path, keys) -> None:
    a, b, c = keys
    known = known_file(tmp_path,
                       "# nodes",
                       line("10.77.*,!10.77.0.3", a),
                       line(hash_name("gpu-h"), b),
                       line("[10.77.0.9]:2222", c),
                       line("*", c, "@revoked"),
                       line("*.ca.test", a, "@cert-authority"))
    assert known.check("10.77.0.1", a).status == "known"
    assert [e.line for e in known.check("10.77.0.1", a).entries] == [2]
    changed = known.check("10.77.0.1", b)
    assert changed.status == "changed" and [e.line for e in changed.entries] == [2]
    assert known.check("10.77.0.3", a).status == "unknown"           # negated
    assert known.check("gpu-h", b).status == "known"                 # hashed
    revoked = known.check("[10.77.0.9]:2222", c)                     # listed, but revoked
    assert revoked.status == "revoked" and [e.line for e in revoked.entries] == [5]
    assert known.check("10.77.0.9", a).status == "known"             # port 22: the wildcard
    ca = known.check("n1.ca.test", b)
    assert ca.status == "unknown" and [e.line for e in ca.authorities] == [6]
    assert known.key_types("10.77.0.1") == [a.get_name()]
    assert known.lines_for("10.77.0.1") == [(known.files[0], 2, a.get_name())]


def test_policies(tmp_path: Path, keys) -> None:
    a, b, c = keys
    known = known_file(tmp_path, line("10.77.*", a), line("*", c, "@revoked"))
    before = Path(known.files[0]).read_text()
    client = paramiko.SSHClient()
    said: list[str] = []
    for policy in (StrictPolicy(known), AcceptNewPolicy(known, said.append)):
        policy.missing_host_key(client, "10.77.0.1", a)                 # known: accepted
        with pytest.raises(ChangedKey):
            policy.missing_host_key(client, "10.77.0.1", b)
        with pytest.raises(RevokedKey):
            policy.missing_host_key(client, "10.77.0.1", c)
        with pytest.raises(RevokedKey):
            policy.missing_host_key(client, "elsewhere", c)             # revoked everywhere
    assert Path(known.files[0]).read_text() == before and said == []
    with pytest.raises(UnknownKey):
        StrictPolicy(known).missing_host_key(client, "elsewhere", b)
    AcceptNewPolicy(known, said.append).missing_host_key(client, "[elsewhere]:2222", b)
    assert Path(known.files[0]).read_text().endswith(line("[elsewhere]:2222", b) + "\n")
    assert known.check("[elsewhere]:2222", b).status == "known" and len(said) == 1
    assert OffPolicy().missing_host_key(client, "10.77.0.1", c) is None


def test_accept_new_hashes_when_asked(tmp_path: Path, keys) -> None:
    cfg = {"userknownhostsfile": str(tmp_path / "kh"), "hashknownhosts": "yes"}
    known = known_hosts_for(cfg)
    assert known.hash_new and known.write_to == str(tmp_path / "kh")
    AcceptNewPolicy(known, lambda _: None).missing_host_key(paramiko.SSHClient(), "gpu-a", keys[0])
    text = (tmp_path / "kh").read_text()
    assert text.startswith("|1|") and "gpu-a" not in text
    assert known.check("gpu-a", keys[0]).status == "known"


def test_messages_name_file_and_line(tmp_path: Path, keys) -> None:
    a, b, c = keys
    known = known_file(tmp_path, line("10.0.0.1", a), line("10.0.*", b), line("*", c, "@revoked"),
                       line("*.ca.test", a, "@cert-authority"))
    path = known.files[0]
    revoked = translate(RevokedKey("10.0.0.1", c, known.check("10.0.0.1", c).entries), AT, known)
    assert isinstance(revoked, HostKeyRevoked) and revoked.exit_code == 3
    assert "REVOKED" in str(revoked) and f"{path} line 3" in str(revoked)
    assert str(revoked).startswith("gpu1 (alice@10.0.0.1:22)")

    pattern = known_file(tmp_path, line("10.0.*", a), name="pattern")
    changed = translate(ChangedKey("10.0.0.1", c, pattern.check("10.0.0.1", c).entries), AT,
                        pattern)
    assert isinstance(changed, HostKeyChanged) and "HOST KEY CHANGED" in str(changed)
    assert f"edit {pattern.files[0]} line 1" in str(changed) and "'10.0.*'" in str(changed)
    assert "ssh-keygen -R" not in str(changed)              # -R cannot remove a pattern line

    exact = known_file(tmp_path, line("10.0.0.1", a), name="exact")
    err = translate(ChangedKey("10.0.0.1", b, exact.check("10.0.0.1", b).entries), AT, exact)
    assert f"ssh-keygen -R 10.0.0.1 -f {exact.files[0]}" in str(err)
    assert f"{exact.files[0]} line 1" in str(err)

    ca = translate(UnknownKey("n1.ca.test", b, known.check("n1.ca.test", b).authorities), AT, known)
    assert isinstance(ca, HostKeyUnknown)
    text = str(ca)
    assert "@cert-authority" in text and f"{path} line 4" in text and "not supported" in text
    assert "ssh-keyscan -H 10.0.0.1" in text and "accept-new" in text


def test_known_key_types_are_asked_for_first(keys) -> None:
    offered = ["ssh-ed25519", "ecdsa-sha2-nistp256", "rsa-sha2-512", "rsa-sha2-256"]
    assert preferred_algorithms(["ssh-rsa"], offered) == \
        ["rsa-sha2-512", "rsa-sha2-256", "ssh-ed25519", "ecdsa-sha2-nistp256"]
    assert preferred_algorithms([], offered) == offered
    assert preferred_algorithms(["ssh-dss"], offered) == offered       # not offered: no change
    left, right = socket.socketpair()
    try:
        transport = transport_preferring(["ecdsa-sha2-nistp256"])(left)
        assert transport.get_security_options().key_types[0] == "ecdsa-sha2-nistp256"
    finally:
        left.close()
        right.close()


# --- identities ----------------------------------------------------------------------------


def keygen(path: Path, passphrase: str = "", fmt: str | None = None, kind: str = "ed25519") -> Path:
    argv = ["ssh-keygen", "-q", "-t", kind, "-N", passphrase, "-C", path.name, "-f", str(path)]
    subprocess.run(argv + (["-m", fmt] if fmt else []), check=True, capture_output=True)
    return path


def pub_blob(path: Path) -> bytes:
    return base64.b64decode(Path(f"{path}.pub").read_text().split()[1])


@needs_keygen
def test_read_identity(tmp_path: Path) -> None:
    enc = keygen(tmp_path / "enc", "secret")
    blob = pub_blob(enc)
    Path(f"{enc}.pub").unlink()                 # the OpenSSH format holds its public part
    got = read_identity(str(enc))
    assert got.encrypted and got.key is None and got.public == blob and got.problem is None
    assert openssh_header(enc.read_bytes()) == ("aes256-ctr", blob)

    plain = keygen(tmp_path / "plain")
    got = read_identity(str(plain))
    assert not got.encrypted and got.key is not None and got.public == pub_blob(plain)

    pem = keygen(tmp_path / "pem", "secret", fmt="PEM", kind="ecdsa")
    assert read_identity(str(pem)).public == pub_blob(pem)       # from pem.pub
    Path(f"{pem}.pub").unlink()
    got = read_identity(str(pem))
    assert got.encrypted and got.public is None                  # PEM hides it

    assert read_identity(str(tmp_path / "none")).problem == "no such file"
    (tmp_path / "junk").write_text("not a key\n")
    assert "not a private key" in (read_identity(str(tmp_path / "junk")).problem or "")


@needs_keygen
def test_a_key_is_read_once_while_it_and_its_pub_are_unchanged(tmp_path: Path) -> None:
    """Every connection of a launch offers the same keys: parsed once (2 ms each), again as
    soon as the key or KEY.pub changes."""
    key = keygen(tmp_path / "k")
    first = read_identity(str(key))
    assert first.key is not None and read_identity(str(key)) is first
    Path(f"{key}.pub").unlink()
    assert read_identity(str(key)) is not first
    keygen(tmp_path / "k2")
    Path(f"{tmp_path}/k2").replace(key)                        # another key, same path
    assert read_identity(str(key)).public != first.public


def test_identity_paths(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    assert identity_paths("~/inv", ["~/a", str(tmp_path / "inv"), "~/b"]) == \
        [str(tmp_path / "inv"), str(tmp_path / "a"), str(tmp_path / "b")]
    assert identity_paths(None, []) == []                         # no defaults exist
    (tmp_path / ".ssh").mkdir()
    for name in ("id_ed25519", "id_rsa"):
        (tmp_path / ".ssh" / name).write_text("x")
    assert identity_paths(None, []) == [str(tmp_path / ".ssh" / "id_rsa"),
                                        str(tmp_path / ".ssh" / "id_ed25519")]
    assert identity_paths(None, ["~/c"]) == [str(tmp_path / "c")]  # named: no defaults


def test_order_of_offers(keys) -> None:
    a, b, c = keys
    in_agent_b = Identity("/k/b", public=b.asbytes(), encrypted=True)
    on_disk_c = Identity("/k/c", public=c.asbytes(), key=c)
    labels = [o.label for o in plan([in_agent_b, on_disk_c], [a, b], identities_only=False)]
    assert labels[0].startswith("agent key") and labels[0].endswith("(/k/b)")   # agent, named
    assert labels[1].startswith("agent key") and "(/k/" not in labels[1]        # agent, other
    assert labels[2].startswith("/k/c (")                                       # from disk
    only = plan([in_agent_b, on_disk_c], [a, b], identities_only=True)
    assert [o.key for o in only] == [b, c]                      # agent key a is not offered
    assert [o.key for o in plan([in_agent_b], [], identities_only=True)] == []


def test_why_an_identity_was_not_offered(keys) -> None:
    a, b, _ = keys
    enc = Identity("/k/enc", public=a.asbytes(), encrypted=True)
    hidden = Identity("/k/pem", public=None, encrypted=True)
    missing = Identity("/k/gone", problem="no such file")
    nobody = AgentState(None)
    note = unusable([enc], [], True, nobody)[0]
    assert "/k/enc is encrypted" in note and "SSH_AUTH_SOCK" in note and "ssh-add /k/enc" in note
    agent = AgentState("/tmp/agent.sock", 1)
    note = unusable([enc], [b], True, agent)[0]
    assert "not in the ssh agent at /tmp/agent.sock" in note and "`ssh-add /k/enc`" in note
    assert unusable([enc], [a], True, agent) == []                    # it is in the agent
    assert "ssh-keygen -y -f /k/pem" in unusable([hidden], [b], True, agent)[0]
    assert unusable([missing], [], False, nobody) == ["/k/gone: no such file"]


def test_refusal_message_carries_the_evidence() -> None:
    exc = KeysRefused("alice", ["agent key ssh-ed25519 SHA256:x (/k/a): refused"],
                      ["/k/enc is encrypted ... `ssh-add /k/enc`"], AgentState("/s", 1))
    at = Attempt(name="gpu1", hostname="10.0.0.1", port=22, user="alice", keys=("/k/a", "/k/enc"),
                 agent=True, timeout=10.0)
    err = translate(exc, at)
    assert isinstance(err, AuthFailed) and err.exit_code == 3
    text = str(err)
    for words in ("gpu1 (alice@10.0.0.1:22)", "user 'alice'", "SHA256:x (/k/a): refused",
                  "ssh-add /k/enc", "no passphrase"):
        assert words in text, text
    none = translate(KeysRefused("alice", [], [], AgentState(None)), at)
    assert "no key could be offered (identities: /k/a, /k/enc; no ssh agent)" in str(none)


# --- ~/.ssh/config by name and address -----------------------------------------------------

SSH_CONFIG = """\
Host gpu-a
  User alice
  IdentityFile ~/.ssh/a
  HostName gpu-a.example.com
  ProxyJump jump.example.com
Host 10.0.0.11
  User carol
  Port 2222
  IdentityFile ~/.ssh/b
Host gpu-c
  HostName 10.0.0.13
Host *
  IdentitiesOnly yes
  IdentityAgent none
"""


def parsed(text: str) -> paramiko.SSHConfig:
    return paramiko.SSHConfig.from_text(text)


def test_config_by_name_then_address(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    found = host_config(parsed(SSH_CONFIG), "gpu-a", "10.0.0.11")
    assert found.destination == "10.0.0.11" and found.set_aside == "gpu-a.example.com"
    opts = found.options
    assert opts["user"] == "alice" and opts["port"] == "2222" and opts["identitiesonly"] == "yes"
    assert opts["identityfile"] == [str(tmp_path / ".ssh/a"), str(tmp_path / ".ssh/b")]
    assert opts["hostname"] == "10.0.0.11"
    same = host_config(parsed(SSH_CONFIG), "gpu-c", "gpu-c")        # no address: HostName
    assert same.destination == "10.0.0.13" and same.set_aside is None
    plain = host_config(parsed(SSH_CONFIG), "gpu-b", "10.0.0.12")
    assert plain.destination == "10.0.0.12" and "user" not in plain.options
    assert host_config(parsed(SSH_CONFIG), "gpu-c", "10.0.0.13").set_aside is None


def test_transport_uses_the_name_block(monkeypatch, tmp_path: Path) -> None:
    """What one node's connection is made of (nothing is contacted)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = tmp_path / "ssh_config"
    cfg.write_text(SSH_CONFIG)
    said: list[str] = []
    backend = SshBackend(SshSettings(config=str(cfg)), warn=said.append)
    try:
        conn = backend._connect(Host(name="gpu-a", address="10.0.0.11"))._make(
            "10.0.0.11", None, None, 5.0)
        assert (conn.host, conn.user, conn.port) == ("10.0.0.11", "alice", 2222)
        auth = conn.connect_kwargs["auth_strategy"]
        assert auth.paths == [str(tmp_path / ".ssh/a"), str(tmp_path / ".ssh/b")]
        assert auth.identities_only and not auth.use_agent
        assert conn.gateway is not None and conn.gateway.host == "jump.example.com"
        assert "transport_factory" in conn.connect_kwargs
        assert any("gpu-a.example.com" in s and "10.0.0.11" in s for s in said)

        host = Host(name="gpu-a", address="10.0.0.11", user="bob", port=22,
                    identity_file="~/.ssh/mine")                     # the inventory wins
        conn = backend._connect(host)._make(host.address, host.user, host.port, 5.0)
        assert (conn.user, conn.port) == ("bob", 22)
        assert conn.connect_kwargs["auth_strategy"].paths[0] == str(tmp_path / ".ssh/mine")
    finally:
        backend.close()


def test_a_known_hosts_file_is_parsed_once_while_it_is_unchanged(tmp_path) -> None:
    """Every connection of a launch reads the same known_hosts: parsed once (1,000 hosts
    parsed again per connection made a 1,000-node launch's check quadratic), and again as
    soon as it changes (accept-new appends)."""
    from cluster.backends.ssh import known_hosts as kh
    blob = paramiko.RSAKey.generate(1024).get_base64()
    path = tmp_path / "known_hosts"
    path.write_text("".join(f"10.0.{i // 250}.{i % 250} ssh-rsa {blob}\n" for i in range(1000)))
    first = kh.read_entries(str(path))
    assert len(first) == 1000 and kh.read_entries(str(path)) is first
    with path.open("a") as f:
        f.write(f"[node9]:2222 ssh-rsa {blob}\n")
    again = kh.read_entries(str(path))
    assert len(again) == 1001 and again is not first
    assert again[-1].names("[node9]:2222") and not again[-1].names("[node9]:22")
    assert kh.pattern_matches("10.0.*", "10.0.3.7") and not kh.pattern_matches("10.0.3.7", "10.0.3.70")


KH_NAMES = ["node1", "Node1", "10.0.0.1", "[node1]:2222", "gpu-a", "gpu-b"]
KH_FIELDS = ["node1", "NODE1", "node1,10.0.0.1", "10.0.0.1,gpu-a", "gpu-*", "!gpu-b,gpu-*",
             "node?", "[node1]:2222", "*", "gpu-a,,gpu-b", "!node1"]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(KH_FIELDS + ["HASH"]), st.sampled_from(KH_NAMES),
                          st.sampled_from(["", "@revoked ", "@cert-authority "])), max_size=12),
       st.sampled_from(KH_NAMES + ["other"]))
def test_a_files_lines_for_a_host_are_those_that_name_it(lines, host) -> None:
    """The index answers as asking every line would, in file order: plain names, lists,
    patterns, negations, hashed names and markers, whatever the case."""
    from cluster.backends.ssh import known_hosts as kh
    text = "".join(f"{marker}{kh.hash_name(name) if field == 'HASH' else field} ssh-ed25519 "
                   f"{base64.b64encode(b'key%d' % i).decode()}\n"
                   for i, (field, name, marker) in enumerate(lines))
    entries = [e for n, line in enumerate(text.splitlines(), 1)
               if (e := kh.parse_line(line, "f", n)) is not None]
    assert len(entries) == len(lines)
    index = kh.FileIndex(entries)
    want = [e for e in entries if e.names(host)]
    assert index.naming(host) == want and index.naming(host) == want     # asked twice


def test_a_host_among_a_thousand_plain_lines_is_found_without_asking_each(tmp_path, monkeypatch) -> None:
    from cluster.backends.ssh import known_hosts as kh
    blob = paramiko.RSAKey.generate(1024).get_base64()
    path = tmp_path / "known_hosts"
    path.write_text("".join(f"node{i},10.0.{i // 250}.{i % 250} ssh-rsa {blob}\n" for i in range(1000))
                    + f"gpu-* ssh-rsa {blob}\n")
    index = kh.file_index(str(path))
    asked: list[str] = []
    real = kh.Entry.names
    monkeypatch.setattr(kh.Entry, "names", lambda self, host: asked.append(self.hosts) or real(self, host))
    found = index.naming("10.0.2.17")
    assert [e.line for e in found] == [518] and asked == ["gpu-*"]
