"""Shared fixtures for the integration tests: fake SSH nodes and the real `cluster` CLI.

    ssh_nodes4   module-scoped SshNodes(4) (network namespaces, one sshd each)
    ssh_home     a fresh HOME whose ~/.ssh/known_hosts holds every node's key
    cli          runs `python -m cluster ...` as a user would (cwd: a temp dir, so runs/ lands
                 there; HOME: ssh_home); at teardown kills what it started, here and on the nodes
    canary       a path, in a folder of the test's own that the nodes' user can write to, that
                 only an injected command would create
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

try:
    from tests.integration.fixtures import (SshNodes, kill_pids, processes_with_env)
except ImportError:  # run with tests/integration on sys.path
    from fixtures import SshNodes, kill_pids, processes_with_env  # type: ignore

PROGRAMS = Path(__file__).resolve().parent / "programs"
HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test under tests/integration is of the integration tier (marked, so that
    CLUSTER_REQUIRE_INTEGRATION=1 fails its skips), whether or not its file says so."""
    for item in items:
        if HERE in Path(item.path).parents:
            item.add_marker(pytest.mark.integration)


def _have(*names: str) -> bool:
    return all(shutil.which(n) or os.path.exists(f"/usr/sbin/{n}") for n in names)


def skip_unless_ssh_nodes() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (network namespaces)")
    if not _have("ip", "unshare", "sshd", "ssh", "ssh-keygen"):
        pytest.skip("needs iproute2, util-linux and openssh")


@pytest.fixture(scope="module")
def ssh_nodes4():
    skip_unless_ssh_nodes()
    with SshNodes(4) as nodes:
        yield nodes


def home_for(tmp_path: Path, nodes: SshNodes) -> Path:
    """tmp_path/home, whose known_hosts has the host keys of `nodes`."""
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True, mode=0o700, exist_ok=True)
    shutil.copy(nodes.known_hosts_path, home / ".ssh" / "known_hosts")
    return home


@pytest.fixture
def ssh_home(tmp_path: Path, ssh_nodes4: SshNodes) -> Path:
    return home_for(tmp_path, ssh_nodes4)


class Proc:
    """A running `cluster` command whose stdout/stderr lines are collected by threads."""

    def __init__(self, popen: subprocess.Popen) -> None:
        self.popen = popen
        self.out: list[str] = []
        self.err: list[str] = []
        self.cond = threading.Condition()
        self.threads = [threading.Thread(target=self._pump, args=(s, l), daemon=True)
                        for s, l in ((popen.stdout, self.out), (popen.stderr, self.err))]
        for t in self.threads:
            t.start()

    def _pump(self, stream, lines: list[str]) -> None:
        for line in stream:
            with self.cond:
                lines.append(line.rstrip("\n"))
                self.cond.notify_all()
        with self.cond:
            self.cond.notify_all()

    def wait_for(self, pred: Callable[["Proc"], bool], timeout: float, what: str = "") -> None:
        deadline = time.monotonic() + timeout
        with self.cond:
            while not pred(self):
                left = deadline - time.monotonic()
                if left <= 0 or (self.popen.poll() is not None and not any(t.is_alive() for t in self.threads)):
                    if pred(self):
                        return
                    raise AssertionError(f"timed out waiting for {what or pred}\n{self.dump()}")
                self.cond.wait(min(left, 0.2))

    def wait(self, timeout: float) -> int:
        code = self.popen.wait(timeout=timeout)
        for t in self.threads:
            t.join(timeout=5)
        return code

    @property
    def stdout(self) -> str:
        return "\n".join(self.out)

    @property
    def stderr(self) -> str:
        return "\n".join(self.err)

    def run_id(self) -> str | None:
        m = re.search(r"run (\d{8}-\d{6}-[0-9a-f]{4})", self.stderr)
        return m.group(1) if m else None

    def dump(self) -> str:
        return f"--- stdout\n{self.stdout[-4000:]}\n--- stderr\n{self.stderr[-4000:]}"


class Cli:
    """The `cluster` command, run in `cwd` with HOME=`home`."""

    def __init__(self, cwd: Path, home: Path, command: list[str] | None = None) -> None:
        self.cwd = cwd
        self.home = home
        self.command = command or [sys.executable, "-m", "cluster"]
        self.started: list[Proc] = []
        self.env = dict(os.environ, HOME=str(home), COLUMNS="200", NO_COLOR="1",
                        PYTHONUNBUFFERED="1")
        self.env.pop("SSH_AUTH_SOCK", None)
        self.env.pop("CLUSTER_RUNS_DIR", None)

    def start(self, *args: str, ignore: tuple[int, ...] = ()) -> Proc:
        """Start `cluster ARGS` with a known signal disposition: SIGINT, SIGTERM and SIGHUP at
        their defaults, except those in `ignore` (as `cluster up &` from a script gets SIGINT),
        whatever this test process inherited."""
        def dispositions() -> None:
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                signal.signal(sig, signal.SIG_IGN if sig in ignore else signal.SIG_DFL)
        popen = subprocess.Popen([*self.command, *args], cwd=self.cwd,
                                 env=self.env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, start_new_session=True,
                                 preexec_fn=dispositions)
        proc = Proc(popen)
        self.started.append(proc)
        return proc

    def run(self, *args: str, timeout: float = 180) -> Proc:
        proc = self.start(*args)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"cluster {' '.join(args)} did not end in {timeout} s\n{proc.dump()}")
        return proc

    def run_ids(self) -> list[str]:
        runs = self.cwd / "runs"
        return sorted(p.name for p in runs.iterdir()) if runs.is_dir() else []

    def cleanup(self) -> None:
        for proc in self.started:
            if proc.popen.poll() is None:
                try:
                    os.killpg(proc.popen.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.popen.wait(timeout=10)
        for run_id in self.run_ids():
            kill_pids(processes_with_env("CLUSTER_RUN_ID", run_id))


@pytest.fixture
def canary() -> Path:
    """A path that only a command smuggled into a shell would create: in a folder of this test's
    own that any node user can write to (world-writable and sticky, as /tmp), removed after."""
    folder = Path(tempfile.mkdtemp(prefix="cluster-canary-"))
    folder.chmod(0o1777)
    try:
        yield folder / "canary"
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def cli_for(tmp_path: Path, nodes: SshNodes) -> Iterator[Cli]:
    """A Cli in tmp_path/work whose HOME knows the host keys of `nodes` (a test module's own
    nodes); its processes are stopped after."""
    work = tmp_path / "work"
    work.mkdir()
    c = Cli(work, home_for(tmp_path, nodes))
    try:
        yield c
    finally:
        c.cleanup()


@pytest.fixture
def cli(tmp_path: Path, ssh_nodes4: SshNodes, ssh_home: Path):
    with cli_for(tmp_path, ssh_nodes4) as c:
        yield c


def node_leftovers(ssh_nodes: SshNodes, *nodes: int) -> dict[str, list[str]]:
    """What runs in each node's network namespace besides its sshd daemon, read from /proc
    (independent of the run-id scan the code under test uses): node name -> command lines."""
    daemons = set(ssh_nodes.sshd_pids().values())
    out: dict[str, list[str]] = {}
    for i in nodes or range(1, ssh_nodes.k + 1):
        node = ssh_nodes.network.node(i)
        found = []
        for pid in ssh_nodes.network.processes_in(i):
            if pid in daemons:
                continue
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
            except OSError:
                continue
            found.append(f"{pid} {cmd}")
        if found:
            out[node.name] = found
    return out


def run_processes_in(ssh_nodes: SshNodes, node: int) -> list[str]:
    """Every process in one node's network namespace but sshd's own (its daemon, and the
    sessions of a connection that is cut but not yet timed out): what a run left there."""
    out = []
    for pid in ssh_nodes.network.processes_in(node):
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        except OSError:
            continue
        if comm != "sshd":
            out.append(f"{pid} {cmd}")
    return out


def wait_until(pred: Callable[[], object], timeout: float, interval: float = 0.05) -> float | None:
    """Seconds until pred() held, or None if it did not within timeout."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if pred():
            return time.monotonic() - t0
        time.sleep(interval)
    return None


def make_venv(where: Path) -> Path:
    """A real venv (its own activate script and interpreter) that sees this python's packages
    (torch) through a .pth file, readable by the nodes' user."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    purelib = sysconfig.get_paths()["purelib"]
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    (where / "lib" / version / "site-packages" / "parent.pth").write_text(purelib + "\n")
    for path in [where, *where.rglob("*")]:
        path.chmod(0o755 if path.is_dir() or os.access(path, os.X_OK) else 0o644)
    return where
