"""Logging in and trusting hosts, end to end: the real `cluster` CLI against real sshd nodes
(fixtures/sshnodes.py), a real ssh-agent holding a passphrase-protected key, ~/.ssh/config
blocks named after inventory hosts, and known_hosts files with patterns, hashed names, @revoked
and @cert-authority lines.

The agent runs on a socket of its own; only the CLI's environment names it (SSH_AUTH_SOCK).
Keys added to the nodes' authorized_keys are removed again after each test.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

try:
    from tests.integration.conftest import PROGRAMS, Cli, Proc
except ImportError:  # run with tests/integration on sys.path
    from conftest import PROGRAMS, Cli, Proc  # type: ignore

pytestmark = [pytest.mark.integration]

ALLREDUCE = ["--sync", str(PROGRAMS), "--", "allreduce.py"]
PASSPHRASE = "correct horse battery staple"


class Agent:
    """A real ssh-agent in the foreground (-D) on its own socket, and ssh-add against it."""

    def __init__(self, directory: Path) -> None:
        self.socket = str(directory / "agent.sock")
        self.askpass = directory / "askpass"
        self.askpass.write_text(f"#!/bin/sh\necho '{PASSPHRASE}'\n")
        self.askpass.chmod(0o700)
        self.proc = subprocess.Popen(["ssh-agent", "-D", "-a", self.socket],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 10
        while not os.path.exists(self.socket):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise AssertionError("ssh-agent did not start")
            time.sleep(0.02)

    def ssh_add(self, *args: str) -> str:
        """ssh-add with the passphrase from SSH_ASKPASS (forced: no terminal is asked)."""
        env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root"),
               "SSH_AUTH_SOCK": self.socket, "SSH_ASKPASS": str(self.askpass),
               "SSH_ASKPASS_REQUIRE": "force"}
        out = subprocess.run(["ssh-add", *args], env=env, stdin=subprocess.DEVNULL,
                             capture_output=True, text=True, timeout=30, start_new_session=True)
        assert out.returncode in (0, 1), out.stderr    # 1: `ssh-add -l` of an empty agent
        return out.stdout + out.stderr

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


@pytest.fixture
def agent() -> Iterator[Agent]:
    if not shutil.which("ssh-agent") or not shutil.which("ssh-add"):
        pytest.skip("needs ssh-agent and ssh-add")
    directory = Path(tempfile.mkdtemp(prefix="cluster-agent-"))   # a short socket path
    a = Agent(directory)
    try:
        yield a
    finally:
        a.close()
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def authorized(ssh_nodes4) -> Iterator[Callable[[Path], None]]:
    """authorize(pub_path): let that key log in to every node, until the test ends."""
    path = Path(ssh_nodes4.authorized_keys_path)
    before = path.read_text()

    def authorize(pub: Path) -> None:
        with path.open("a") as f:
            f.write(pub.read_text())
    try:
        yield authorize
    finally:
        path.write_text(before)


def keygen(path: Path, passphrase: str) -> Path:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", passphrase, "-C", path.name,
                    "-f", str(path)], check=True, capture_output=True)
    return path


def up(cli: Cli, inv: str, nodes: int, *extra: str, timeout: float = 180) -> Proc:
    return cli.run("up", "-i", inv, "--nodes", str(nodes), *extra, *ALLREDUCE, timeout=timeout)


# --- an encrypted key, through the agent ----------------------------------------------------


def test_encrypted_key_through_the_agent(ssh_nodes4, cli, agent, authorized):
    ssh = cli.home / ".ssh"
    locked = keygen(ssh / "id_locked", PASSPHRASE)
    authorized(Path(f"{locked}.pub"))
    Path(f"{locked}.pub").unlink()       # matched to the agent by the key file's own public part
    (ssh / "config").write_text("Host *\n  IdentitiesOnly yes\n")
    inv = ssh_nodes4.write_inventory(cli.home / "inv.yaml", identity_file=str(locked))

    # 1. the key is in the agent: both nodes log in with it
    assert "id_locked" in agent.ssh_add(str(locked)) + agent.ssh_add("-l")
    cli.env["SSH_AUTH_SOCK"] = agent.socket
    ok = up(cli, inv, 2)
    assert ok.popen.returncode == 0, ok.dump()

    # 2. no agent: refused before anything starts, naming the key and the fix, never prompting
    del cli.env["SSH_AUTH_SOCK"]
    no_agent = up(cli, inv, 1, timeout=60)
    assert no_agent.popen.returncode == 3, no_agent.dump()
    for words in (f"{locked} is encrypted", f"ssh-add {locked}", "SSH_AUTH_SOCK", "node1"):
        assert words in no_agent.stderr, no_agent.dump()

    # 3. an agent holding another key that the nodes accept: IdentitiesOnly yes keeps it out
    agent.ssh_add("-D")
    agent.ssh_add(ssh_nodes4.identity_file)
    cli.env["SSH_AUTH_SOCK"] = agent.socket
    only = up(cli, inv, 1, timeout=60)
    assert only.popen.returncode == 3, only.dump()
    assert f"{locked} is encrypted and its key is not in the ssh agent at {agent.socket}" \
        in only.stderr, only.dump()

    # 4. without IdentitiesOnly the agent's other keys are offered too, as OpenSSH does
    (ssh / "config").write_text("")
    other = up(cli, inv, 1)
    assert other.popen.returncode == 0, other.dump()


# --- ~/.ssh/config by the inventory's host name ----------------------------------------------


def test_ssh_config_block_by_host_name(ssh_nodes4, cli):
    """User and IdentityFile only in a `Host node1` block; the inventory names node1 with its
    address. The block's HostName points nowhere: the inventory's address is where we go."""
    node = ssh_nodes4.nodes[0]
    (cli.home / ".ssh" / "config").write_text(
        f"Host {node.name}\n  User {ssh_nodes4.user}\n  IdentityFile {ssh_nodes4.identity_file}\n"
        f"  IdentitiesOnly yes\n  HostName 192.0.2.1\n")
    inv = ssh_nodes4.write_inventory(cli.home / "inv.yaml", nodes=[1], user=None,
                                     identity_file=None, port=None)
    assert "user:" not in Path(inv).read_text() and "identity_file:" not in Path(inv).read_text()
    proc = up(cli, inv, 1)
    assert proc.popen.returncode == 0, proc.dump()
    assert f"connecting to the inventory address {node.address}; HostName 192.0.2.1" \
        in proc.stderr, proc.dump()


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


# --- every node behind one jump host ----------------------------------------------------------


def test_nodes_behind_one_jump_host_share_one_connection_to_it(ssh_nodes4, cli):
    """node1 is the bastion (ProxyJump); nodes 2-4 are reached only through it. Three nodes
    ride on ONE SSH connection to the bastion (channels, not logins: sshd's MaxStartups never
    sees a crowd), counted from the bastion's own namespace with ss, not from cluster."""
    jump = ssh_nodes4.nodes[0]
    behind = ssh_nodes4.nodes[1:]
    (cli.home / ".ssh" / "config").write_text(
        f"Host bastion\n  HostName {jump.address}\n  User {ssh_nodes4.user}\n"
        f"  IdentityFile {ssh_nodes4.identity_file}\n  IdentitiesOnly yes\n"
        f"Host {' '.join(n.name for n in behind)}\n  ProxyJump bastion\n")
    inv = ssh_nodes4.write_inventory(cli.home / "inv.yaml", nodes=[2, 3, 4])
    proc = cli.start("up", "-i", inv, "--sync", str(PROGRAMS), "--", "allreduce.py",
                     "--sleep", "60")
    proc.wait_for(lambda p: sum('"sleeping"' in line for line in p.out) >= 3, 120, "ranks asleep")
    established = ssh_nodes4.network.run_in(1, ["ss", "-Htn", "state", "established",
                                                "( sport = :22 )"]).stdout.split("\n")
    from_launcher = [line for line in established if line.strip()]
    assert len(from_launcher) == 1, from_launcher        # one login to the bastion, for 3 nodes
    os.kill(proc.popen.pid, 2)
    assert proc.wait(60) == 130, proc.dump()
