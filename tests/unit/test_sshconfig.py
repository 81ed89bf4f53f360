"""cluster/backends/ssh/sshconfig.py's IndexedSSHConfig: the same answer as paramiko's own
lookup for any config and host (it only leaves out blocks that cannot apply), and a lookup that
reads the blocks naming the host, not every block of a config with one per node."""
from __future__ import annotations

import io

from hypothesis import given, settings
from hypothesis import strategies as st
from paramiko.config import SSHConfig

from cluster.backends.ssh.sshconfig import IndexedSSHConfig, host_config

NAMES = ["n1", "n2", "n10", "10.0.0.1", "10.0.0.2", "gpu-a", "gpu-b"]
PATTERNS = NAMES + ["*", "n*", "!n2", "10.0.0.?", "gpu-[ab]", "!gpu-a", "*.example"]
OPTIONS = [("User", ["u1", "u2", "root"]), ("Port", ["22", "2222"]),
           ("IdentityFile", ["~/.ssh/a", "~/.ssh/b", "/k/c"]), ("HostName", ["h1", "10.1.1.1"]),
           ("ConnectTimeout", ["5", "9"])]


@st.composite
def configs(draw) -> str:
    lines = []
    for _ in range(draw(st.integers(0, 8))):
        if draw(st.integers(0, 5)) == 0:
            lines.append(f"Match host {draw(st.sampled_from(PATTERNS))}")
        else:
            hosts = draw(st.lists(st.sampled_from(PATTERNS), min_size=1, max_size=3))
            lines.append("Host " + " ".join(hosts))
        for key, values in draw(st.lists(st.sampled_from(OPTIONS), max_size=3)):
            lines.append(f"    {key} {draw(st.sampled_from(values))}")
    return "\n".join(lines) + "\n"


def both(text: str) -> tuple[SSHConfig, IndexedSSHConfig]:
    plain, indexed = SSHConfig(), IndexedSSHConfig()
    plain.parse(io.StringIO(text))
    indexed.parse(io.StringIO(text))
    return plain, indexed


@settings(max_examples=300, deadline=None)
@given(configs(), st.sampled_from(NAMES + ["other", "n3"]))
def test_every_lookup_is_paramikos(text: str, host: str) -> None:
    plain, indexed = both(text)
    assert indexed.lookup(host) == plain.lookup(host)


@settings(max_examples=100, deadline=None)
@given(configs(), st.sampled_from(NAMES), st.sampled_from(NAMES))
def test_a_host_by_name_and_address_is_as_before(text: str, name: str, address: str) -> None:
    plain, indexed = both(text)
    assert host_config(indexed, name, address) == host_config(plain, name, address)


def test_a_config_parsed_again_is_indexed_again() -> None:
    config = IndexedSSHConfig()
    config.parse(io.StringIO("Host a\n    User one\n"))
    assert config.lookup("a")["user"] == "one"
    config.parse(io.StringIO("Host b\n    User two\n"))          # the system file, after
    assert config.lookup("b")["user"] == "two"


def test_a_canonicalizing_config_is_read_whole() -> None:
    text = "Host *\n    CanonicalizeHostname yes\n    CanonicalDomains invalid\nHost a\n    User x\n"
    plain, indexed = both(text)
    assert indexed.lookup("a") == plain.lookup("a")


def test_a_lookup_reads_the_blocks_naming_the_host_not_all(monkeypatch) -> None:
    """A config with a Host block per node (1,000 here): each lookup hands paramiko the
    wildcard blocks and the host's own, so a launch's lookups grow with N, not N squared."""
    text = "".join(f"Host node{i} 10.0.{i // 250}.{i % 250}\n    User u{i}\n" for i in range(1000))
    text += "Host *\n    Port 2222\n"
    _, indexed = both(text)
    seen: list[int] = []
    real = SSHConfig._lookup

    def counting(self, hostname, options=None, canonical=False, final=False):
        seen.append(len(self._config))
        return real(self, hostname, options, canonical, final)
    monkeypatch.setattr(SSHConfig, "_lookup", counting)
    got = indexed.lookup("node517")
    assert got["user"] == "u517" and got["port"] == "2222"
    assert seen and max(seen) == 3          # the implicit global block, node517's, Host *
