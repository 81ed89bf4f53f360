"""Checks of the integration-test fixtures themselves (fake SSH nodes and a fake SLURM cluster).

Needs root, iproute2, openssh-server/-client, util-linux (unshare/nsenter); the SLURM tests also
slurm-wlm and munge.  Bring-up times are printed and recorded as junit properties.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

try:
    from tests.integration.fixtures import (Network, SlurmCluster, SshNodes, cleanup_stale,
                                            list_fixture_leftovers, processes_of_user,
                                            processes_with_env)
    from tests.integration.fixtures.netns import pid_alive
except ImportError:  # run with tests/integration on sys.path
    from fixtures import (Network, SlurmCluster, SshNodes, cleanup_stale,  # type: ignore
                          list_fixture_leftovers, processes_of_user, processes_with_env)
    from fixtures.netns import pid_alive  # type: ignore

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _have(*names: str) -> bool:
    return all(shutil.which(n) or os.path.exists(f"/usr/sbin/{n}") for n in names)


pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces)"),
    pytest.mark.skipif(not _have("ip", "unshare", "nsenter"), reason="needs iproute2, util-linux"),
]
needs_ssh = pytest.mark.skipif(not _have("sshd", "ssh", "ssh-keygen"), reason="needs openssh")
needs_slurm = pytest.mark.skipif(
    not _have("slurmctld", "slurmd", "sbatch", "munged", "munge"), reason="needs slurm-wlm, munge")


def _report(record_property, capsys, name: str, seconds: float) -> None:
    record_property(name, round(seconds, 3))
    with capsys.disabled():
        print(f"\n[fixture timing] {name}: {seconds:.3f} s", file=sys.stderr)


def _ns_of_tag(tag: str) -> list[str]:
    return [ns for ns in list_fixture_leftovers()["namespaces"] if ns.startswith(f"cn{tag}-")]


@needs_ssh
def test_ssh_nodes(tmp_path, record_property, capsys):
    t0 = time.monotonic()
    with SshNodes(3) as sn:
        _report(record_property, capsys, "ssh_bringup_3_nodes_s", time.monotonic() - t0)
        tag, net = sn.tag, sn.network
        sshd_pids = list(sn.sshd_pids().values())
        assert len(sshd_pids) == 3
        assert [n.name for n in sn.nodes] == ["node1", "node2", "node3"]

        for n in sn.nodes:
            r = sn.ssh(n.index, "hostname; hostname -I; id -un")
            assert r.returncode == 0, r.stderr
            host, addr, user = r.stdout.split()
            assert (host, addr, user) == (n.name, n.address, sn.user)
            assert n.hostkey_pub.startswith("ssh-ed25519 ")

        # known_hosts by name and by address: plain ssh with explicit options
        n2 = sn.nodes[1]
        for target in (n2.name, n2.address):
            r = subprocess.run(["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
                                "-o", f"UserKnownHostsFile={sn.known_hosts_path}",
                                "-o", "GlobalKnownHostsFile=/dev/null", "-o", "IdentitiesOnly=yes",
                                "-o", f"HostKeyAlias={target}",
                                "-i", sn.identity_file, f"{sn.user}@{n2.address}", "hostname"],
                               capture_output=True, text=True, timeout=30)
            assert r.returncode == 0 and r.stdout.strip() == "node2", r.stderr

        # node1 reaches node2 through the bridge and resolves its name
        probe = textwrap.dedent(f"""\
            import socket
            socket.create_connection(("{n2.address}", 22), timeout=5).close()
            print(socket.gethostbyname("node2"))""")
        r = sn.ssh(1, f"{sn.python} -c '{probe}'")
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == n2.address

        # several sessions over one connection (MaxSessions) via ControlMaster
        ctl = os.path.join(sn.dir, "client", "ctl")
        base = ["ssh", "-F", sn.ssh_config_path, "-o", f"ControlPath={ctl}"]
        m = subprocess.Popen(base + ["-o", "ControlMaster=yes", "-N", "node3"],
                             stdin=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 10
            while not os.path.exists(ctl):
                assert m.poll() is None and time.monotonic() < deadline, "ssh master failed"
                time.sleep(0.05)
            procs = [subprocess.Popen(base + ["-o", "ControlMaster=no", "node3", "sleep 1; echo ok"],
                                      stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True) for _ in range(12)]
            results = [p.communicate(timeout=60) for p in procs]
            assert [o.strip() for o, _ in results] == ["ok"] * 12, results
        finally:
            m.kill()
            m.wait(10)

        # inventory
        inv = sn.write_inventory(tmp_path / "inv.yaml", nproc_per_node=2)
        import yaml
        data = yaml.safe_load(open(inv))
        assert data["defaults"]["user"] == sn.user and data["defaults"]["nproc_per_node"] == 2
        assert data["defaults"]["network"] == {"ifname": "eth0", "ib": False}
        assert data["defaults"]["identity_file"] == sn.identity_file
        assert [h["name"] for h in data["hosts"]] == ["node1", "node2", "node3"]
        assert len({h["workdir"] for h in data["hosts"]}) == 3
        assert oct(os.stat(sn.identity_file).st_mode & 0o777) == "0o600"

        # a user process left running on a node is found, and killed at teardown
        r = sn.ssh(2, "CLUSTER_TEST_MARK=xyz-%s nohup sleep 300 >/dev/null 2>&1 & echo started" % tag)
        assert r.stdout.strip() == "started"
        deadline = time.monotonic() + 5
        while not processes_with_env("CLUSTER_TEST_MARK", f"xyz-{tag}") and time.monotonic() < deadline:
            time.sleep(0.05)
        left = processes_with_env("CLUSTER_TEST_MARK", f"xyz-{tag}")
        assert left and set(left) <= set(processes_of_user(sn.user))
        assert set(left) <= set(net.processes_in(2))

        # stop_sshd: node unreachable; start_sshd: back
        sn.stop_sshd(3)
        assert not net.tcp_open(sn.nodes[2].address, 22)
        r = sn.ssh(3, "true", timeout=30)
        assert r.returncode == 255
        t1 = time.monotonic()
        sn.start_sshd(3)
        _report(record_property, capsys, "ssh_restart_one_sshd_s", time.monotonic() - t1)
        assert sn.ssh(3, "hostname").stdout.strip() == "node3"

        # cut the cable
        net.set_link(3, False)
        assert not net.tcp_open(sn.nodes[2].address, 22, timeout=0.5)
        net.set_link(3, True)
        assert sn.ssh(3, "hostname").stdout.strip() == "node3"
        ssh_dir = sn.dir

    t2 = time.monotonic()
    # teardown happened in __exit__; check that nothing is left
    assert not _ns_of_tag(tag)
    leftovers = list_fixture_leftovers()
    assert net.bridge not in leftovers["links"]
    assert not [l for l in leftovers["links"] if l.startswith(f"cv{tag}-")]
    assert tag not in leftovers["states"]
    assert not any(os.path.exists(f"/etc/netns/{n.ns}") for n in net.nodes)
    assert not any(pid_alive(p) for p in sshd_pids)
    assert not processes_with_env("CLUSTER_TEST_MARK", f"xyz-{tag}")
    assert not processes_with_env("CLUSTER_FIXTURE_TAG", tag)
    assert not os.path.exists(ssh_dir)
    _report(record_property, capsys, "ssh_checks_after_teardown_s", time.monotonic() - t2)


# What a fixture may change while it lives and must leave byte for byte as it found it.
SYSTEM_FILES = ["/etc/hosts", "/etc/passwd", "/etc/group", "/etc/shadow", "/etc/gshadow",
                "/etc/subuid", "/etc/subgid", "/etc/munge/munge.key"]


def system_files() -> dict[str, bytes | None]:
    out: dict[str, bytes | None] = {}
    for name in SYSTEM_FILES:
        try:
            out[name] = Path(name).read_bytes()
        except FileNotFoundError:
            out[name] = None
    return out


def changed(before: dict[str, bytes | None]) -> list[str]:
    after = system_files()
    return [name for name in SYSTEM_FILES if after[name] != before[name]]


@needs_ssh
def test_ssh_nodes_leave_users_and_hosts_as_they_found_them():
    """A user the fixture had to create is gone after it, home and all; the root /etc/hosts
    block is taken out byte for byte; the sessions see no GPU (CPU nodes)."""
    user = f"cft{os.getpid()}"          # no such user yet
    with pytest.raises(KeyError):
        pwd.getpwnam(user)
    before = system_files()
    with SshNodes(2, user=user, hosts_in_root=True) as sn:
        home = sn.home
        assert pwd.getpwnam(user).pw_dir == home
        assert f"{sn.nodes[1].address}\tnode2\n" in Path("/etc/hosts").read_text()
        r = sn.ssh(2, "id -un; echo \"[${CUDA_VISIBLE_DEVICES-unset}]\"; "
                      "command -v nvidia-smi || echo no-nvidia-smi")
        assert r.stdout.split() == [user, "[]", "no-nvidia-smi"], r
        assert changed(before), "the fixture was to add a user and hosts lines"
    assert changed(before) == []
    with pytest.raises(KeyError):
        pwd.getpwnam(user)
    assert not os.path.exists(home)


def test_a_user_in_use_by_another_live_network_is_deleted_by_the_last():
    user = f"cfu{os.getpid()}"
    before = system_files()
    with Network(1) as a:
        a.claim_user(user)
        with Network(1) as b:
            b.claim_user(user)
            a.close()
            assert pwd.getpwnam(user), "b still uses it"
        with pytest.raises(KeyError):
            pwd.getpwnam(user)
    assert changed(before) == []


@needs_ssh
def test_ssh_nodes_8_bringup(record_property, capsys):
    t0 = time.monotonic()
    with SshNodes(8) as sn:
        _report(record_property, capsys, "ssh_bringup_8_nodes_s", time.monotonic() - t0)
        r = sn.ssh(8, "hostname")
        assert r.stdout.strip() == "node8", r.stderr
        t1 = time.monotonic()
    _report(record_property, capsys, "ssh_teardown_8_nodes_s", time.monotonic() - t1)


def test_stale_leftovers_are_cleaned(tmp_path):
    """A run killed with SIGKILL leaves namespaces/bridge; the next run removes them."""
    script = tmp_path / "crash.py"
    script.write_text(textwrap.dedent(f"""\
        import os, subprocess, sys, time
        sys.path.insert(0, {ROOT!r})
        from tests.integration.fixtures import Network
        net = Network(2).start()
        subprocess.Popen(["ip", "netns", "exec", net.nodes[0].ns, "sleep", "300"],
                         env=dict(os.environ, CLUSTER_FIXTURE_TAG=net.tag))
        print(net.tag, flush=True)
        time.sleep(300)
        """))
    p = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        tag = p.stdout.readline().strip()
        assert tag, "crash helper did not start"
        assert len(_ns_of_tag(tag)) == 2
    finally:
        p.kill()
        p.wait()
    assert len(_ns_of_tag(tag)) == 2  # still there: nobody tore it down
    removed = cleanup_stale()
    assert tag in removed
    assert not _ns_of_tag(tag)
    assert not [l for l in list_fixture_leftovers()["links"] if tag in l]
    assert not processes_with_env("CLUSTER_FIXTURE_TAG", tag)


def test_two_networks_at_once():
    with Network(1) as a, Network(1) as b:
        assert a.subnet != b.subnet and a.bridge != b.bridge
        assert a.nodes[0].ns != b.nodes[0].ns
        r = a.run_in(1, ["hostname", "-I"])
        assert r.stdout.split() == [a.nodes[0].address]


@needs_slurm
def test_slurm_cluster(tmp_path, record_property, capsys):
    before = system_files()     # /etc/hosts gets a block; munged runs on a key of its own
    t0 = time.monotonic()
    with SlurmCluster(2) as sc:
        _report(record_property, capsys, "slurm_bringup_2_nodes_s", time.monotonic() - t0)
        tag = sc.tag
        assert sc.env["SLURM_CONF"] == sc.conf_path
        r = sc.run(["sinfo", "-h", "-o", "%P %D %t"])
        assert r.returncode == 0, r.stderr
        assert "debug* 2 idle" in r.stdout, r.stdout

        out = tmp_path / "out.txt"
        t1 = time.monotonic()
        r = subprocess.run(["sbatch", "--parsable", "-N2", "-p", sc.partition, "-D", str(tmp_path),
                            "-o", str(out), "--wrap", "srun hostname"],
                           env=sc.env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        job = r.stdout.strip().split(";")[0]
        sc.wait_jobs_done(timeout=120)
        _report(record_property, capsys, "slurm_2_node_srun_job_s", time.monotonic() - t1)
        assert sc.job_state(job) == "COMPLETED"
        assert sorted(out.read_text().split()) == ["node1", "node2"]
        r = subprocess.run(["srun", "-N1", "-p", sc.partition, "sh", "-c",
                            'echo "[${CUDA_VISIBLE_DEVICES-unset}]"'],
                           env=sc.env, capture_output=True, text=True, timeout=60)
        assert r.stdout.split() == ["[]"], r      # CPU nodes: a job sees no GPU
        deadline = time.monotonic() + 10
        while f"JobId={job} " not in (open(sc.jobcomp_path).read()
                                      if os.path.exists(sc.jobcomp_path) else ""):
            assert time.monotonic() < deadline, "job not in the jobcomp file"
            time.sleep(0.2)

        # a running job is cancelled at teardown
        r = sc.run(["sbatch", "--parsable", "-N1", "-D", str(tmp_path),
                    "-o", str(tmp_path / "sleep.out"), "--wrap", "sleep 300"])
        assert r.returncode == 0, r.stderr
        deadline = time.monotonic() + 30
        while sc.run(["squeue", "-h", "-t", "R", "-o", "%i"]).stdout.split() == []:
            assert time.monotonic() < deadline, "job did not start"
            time.sleep(0.2)
        slurm_dir, conf = sc.dir, sc.conf_path
        assert processes_with_env("SLURM_CONF", conf)  # the daemons and the job
        t2 = time.monotonic()
    _report(record_property, capsys, "slurm_teardown_s", time.monotonic() - t2)
    assert not _ns_of_tag(tag)
    assert not processes_with_env("CLUSTER_FIXTURE_TAG", tag)
    assert not processes_with_env("SLURM_CONF", conf)
    assert not os.path.exists(slurm_dir)
    assert tag not in list_fixture_leftovers()["states"]
    assert changed(before) == []
