"""Trusting hosts, end to end: the real `cluster` CLI against real sshd nodes
(fixtures/sshnodes.py) with known_hosts files holding patterns, hashed names, @revoked and
@cert-authority lines.
"""
from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

try:
    from tests.integration.conftest import PROGRAMS, Cli, Proc
except ImportError:  # run with tests/integration on sys.path
    from conftest import PROGRAMS, Cli, Proc  # type: ignore

pytestmark = [pytest.mark.integration]

ALLREDUCE = ["--sync", str(PROGRAMS), "--", "allreduce.py"]


def up(cli: Cli, inv: str, nodes: int, *extra: str, timeout: float = 180) -> Proc:
    return cli.run("up", "-i", inv, "--nodes", str(nodes), *extra, *ALLREDUCE, timeout=timeout)


# --- known_hosts: patterns, hashed names, @revoked, @cert-authority --------------------------


def hashed_line(address: str, key: str, directory: Path) -> str:
    """`address key`, hashed by the real ssh-keygen -H."""
    path = directory / "to-hash"
    path.write_text(f"{address} {key}\n")
    subprocess.run(["ssh-keygen", "-H", "-f", str(path)], check=True, capture_output=True)
    text = path.read_text().strip()
    assert text.startswith("|1|") and address not in text
    return text


def test_known_hosts_patterns_and_hashed_names(ssh_nodes4, cli):
    n1, n2, n3 = ssh_nodes4.nodes[:3]
    subnet = n1.address.rsplit(".", 1)[0]
    known = cli.home / ".ssh" / "known_hosts"
    known.write_text(f"{hashed_line(n1.address, n1.hostkey_pub, cli.home)}\n"
                     f"{subnet}.*,!{n3.address} {n2.hostkey_pub}\n"
                     f"{subnet}.*,!{n3.address} {n3.hostkey_pub}\n")
    inv = ssh_nodes4.write_inventory(cli.home / "inv.yaml")
    both = up(cli, inv, 2)                                  # strict, the default
    assert both.popen.returncode == 0, both.dump()

    inv3 = ssh_nodes4.write_inventory(cli.home / "inv3.yaml", nodes=[3])
    negated = up(cli, inv3, 1, timeout=60)
    assert negated.popen.returncode == 3, negated.dump()
    assert "host key not in known_hosts" in negated.stderr, negated.dump()


def sshd_log_after(ssh_nodes4, i: int, offset: int, closes: int) -> str:
    """Node i's sshd log from offset on, once it shows `closes` closed connections."""
    path = Path(ssh_nodes4.sshd_log(i))
    deadline = time.monotonic() + 10
    while True:
        text = path.read_bytes()[offset:].decode(errors="replace")
        if text.count("Connection closed") >= closes or time.monotonic() > deadline:
            return text


def test_revoked_key_is_refused_before_authentication(ssh_nodes4, cli):
    n1 = ssh_nodes4.nodes[0]
    known = cli.home / ".ssh" / "known_hosts"
    text = f"{n1.address} {n1.hostkey_pub}\n@revoked * {n1.hostkey_pub}\n"
    known.write_text(text)
    inv = ssh_nodes4.write_inventory(cli.home / "inv.yaml", nodes=[1])
    offset = Path(ssh_nodes4.sshd_log(1)).stat().st_size
    for policy in ("strict", "accept-new"):
        proc = up(cli, inv, 1, "--host-key-policy", policy, timeout=60)
        assert proc.popen.returncode == 3, proc.dump()
        assert "REVOKED" in proc.stderr and f"{known} line 2" in proc.stderr, proc.dump()
    assert known.read_text() == text
    log = sshd_log_after(ssh_nodes4, 1, offset, closes=2)
    assert log.count("Connection closed") == 2, log
    assert "Accepted publickey" not in log and "authenticating user" not in log, log


def test_cert_authority_is_explained(ssh_nodes4, cli):
    n1, n2 = ssh_nodes4.nodes[:2]
    subnet = n1.address.rsplit(".", 1)[0]
    known = cli.home / ".ssh" / "known_hosts"
    known.write_text(f"@cert-authority {subnet}.* {n2.hostkey_pub}\n")
    inv = ssh_nodes4.write_inventory(cli.home / "inv.yaml", nodes=[1])
    proc = up(cli, inv, 1, timeout=60)
    assert proc.popen.returncode == 3, proc.dump()
    for words in ("@cert-authority", f"{known} line 1", "not supported", "ssh-keyscan",
                  "accept-new"):
        assert words in proc.stderr, proc.dump()
