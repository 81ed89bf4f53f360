"""SSH backend: every node over SSH. This package alone imports Fabric and paramiko.

~/.ssh/config (parsed by paramiko: User, Port, IdentityFile, IdentitiesOnly, HostName, ProxyJump,
ProxyCommand, UserKnownHostsFile, HashKnownHosts) is looked up by the host's inventory name, then
its address; an inventory address that differs from the name is where we connect, whatever
HostName says (sshconfig.py). The inventory's own user, port and identity_file win when they are
set. Keys are offered as OpenSSH offers them, agent included, never prompting (identities.py).
Channels and SFTP are plain paramiko on the connection Fabric opened.

    transport.py   SshTransport, one node: run / spawn / put / upload, connected at first
                   use (so in parallel, from the backend's thread pool), never prompting
    sshconfig.py   ~/.ssh/config for a host's name and address; where to connect
    identities.py  which keys to offer (ssh-agent, IdentityFile, IdentitiesOnly) as OpenSSH does
    known_hosts.py the known_hosts format: patterns, negation, hashed names, ports, markers
    hostkeys.py    known_hosts checking and the three host-key policies
    errors.py      paramiko/socket exceptions -> the project's errors
    __init__.py    SshBackend: SupervisedBackend over SshTransport, plus `--sync` in the
                   check phase (cluster/backends/sync.py)

Host keys (an unknown key is never added silently):
    strict      the key must already be in known_hosts; unknown -> refused, with the fix
    accept-new  an unknown key is accepted and appended to known_hosts; a changed one refused
    off         anything is accepted, with one warning
A key marked @revoked is refused under strict and accept-new.

paramiko and socket exceptions are translated here, at the boundary, into the ClusterError
subclasses below; each message names the host and what was tried.
"""
from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from ...errors import ClusterError, InputError
from ...plan import LaunchPlan, NodePlan
from ...request import Request
from ...runs import RunDir
from ...spec import Host, Inventory, SshSettings
from ..supervised import SupervisedBackend
from ..sync import local_files, preview, summary, sync_dir
from .errors import (Attempt, AuthFailed, HostKeyChanged, HostKeyRevoked, HostKeyUnknown,
                     SshError, Unreachable, translate)
from .hostkeys import (AcceptNewPolicy, ChangedKey, KnownHosts, OffPolicy, RevokedKey,
                       StrictPolicy, UnknownKey, known_hosts_for)
from .identities import BatchAuth, KeysRefused
from .keepalive import Keepalive
from .transport import Gateways, SshChannel, SshTransport, fabric_config, sftp_path

TRAINER_SUBDIR = "cluster-train"

__all__ = ["AcceptNewPolicy", "Attempt", "AuthFailed", "BatchAuth", "ChangedKey",
           "HostKeyChanged", "HostKeyRevoked", "HostKeyUnknown", "KeysRefused", "KnownHosts",
           "OffPolicy", "RevokedKey", "SshBackend", "SshChannel", "SshError", "SshTransport",
           "StrictPolicy", "UnknownKey", "Unreachable", "known_hosts_for", "local_files",
           "sftp_path", "translate",
           "nodes", "configure", "create", "recorded"]      # the module's hooks (backends.BackendModule)


def _stderr_warn(text: str) -> None:
    sys.stderr.write(f"cluster: {text}\n")
    sys.stderr.flush()


class SshBackend(SupervisedBackend):
    """Every node over SSH, each running cluster/remote/supervisor.py.

    sync: directories copied to every node in the check phase. A plain path lands in the
    node's workdir; a (path, subdir) pair in <workdir>/<subdir> (the built-in trainer goes to
    <workdir>/cluster-train, which is where `cluster up` with no script points torchrun).
    sync_delete: also remove from each node what an earlier sync put there and the directory
    no longer has (cluster/backends/sync.py says what is never touched).
    """

    name = "ssh"

    def __init__(self, settings: SshSettings | None = None, *, host_key_policy: str | None = None,
                 sync: Iterable[str | tuple[str, str]] = (), sync_exclude: Iterable[str] = (),
                 sync_delete: bool = False, warn: Callable[[str], None] | None = None, max_workers: int = 64) -> None:
        self.settings = settings or SshSettings()
        self.policy = host_key_policy or self.settings.host_key_policy
        if self.policy not in ("strict", "accept-new", "off"):
            raise ClusterError(f"unknown host key policy {self.policy!r} "
                               f"(valid: strict, accept-new, off)")
        self.warn = warn or _stderr_warn
        self.note = self.warn         # --sync's line; launch.up points it at the run's console
        self.sync: list[tuple[str, str]] = [(s, ".") if isinstance(s, str) else (s[0], s[1])
                                            for s in sync]
        self.sync_exclude = list(sync_exclude)
        self.sync_delete = sync_delete
        self.config = fabric_config(self.settings.config)
        self.gateways = Gateways()            # jump hosts, one connection each for all nodes
        self.alive = Keepalive(self.settings.keepalive, self.warn)   # one for all nodes
        self.synced: dict[str, list[dict[str, Any]]] = {}
        super().__init__(self._connect, max_workers=max_workers, keepalive=self.settings.keepalive)

    def _connect(self, host: Host) -> SshTransport:
        return SshTransport(host, self.settings, self.policy, self.config, self.warn,
                            self.gateways, self.alive)

    def close(self) -> None:
        super().close()
        self.alive.close()
        self.gateways.close()             # after the nodes: their channels ride on these

    def check(self, plan: LaunchPlan, *, reach: bool = False,
              ready: Callable[[NodePlan], None] | None = None) -> dict[str, dict[str, Any]]:
        """--sync, then the check. With reach, each node's sync runs while its probe does (in
        the check's round trip: the probe looks for the job's script after its word, which
        waits for the sync); without, every sync first."""
        if not self.sync:
            return super().check(plan, reach=reach)
        if not reach:
            self._sync_all(plan)
            return super().check(plan, reach=reach)
        synced: dict[str, list[dict[str, Any]]] = {}

        def sync_node(node: NodePlan) -> None:
            synced[node.host.name] = self._sync_node(node)
        facts = super().check(plan, reach=reach, ready=sync_node)
        self._synced([(n, synced[n.host.name]) for n in plan.nodes])
        return facts

    def _sync_node(self, node: NodePlan) -> list[dict[str, Any]]:
        """Every --sync folder onto one node; a report each."""
        transport = self.transport(node.host)
        reports = []
        for local, sub in self.sync:
            remote = node.host.workdir.rstrip("/") or "/"
            if sub not in ("", "."):
                remote = f"{remote}/{sub}"
            reports.append(sync_dir(transport, local, remote, self.sync_exclude,
                                    delete=self.sync_delete))
        return reports

    def _sync_all(self, plan: LaunchPlan) -> None:
        self._synced(self.each_or_fail(plan.nodes, self._sync_node, phase="sync"))

    def _synced(self, results: list[tuple[NodePlan, list[dict[str, Any]]]]) -> None:
        """What the syncs did, said once for every node."""
        self.synced = {n.host.name: r for n, r in results}
        for i, (local, sub) in enumerate(self.sync):
            self.note(summary(local, sub, {n.host.name: reps[i] for n, reps in results},
                              self.sync_delete))
        skipped = sorted({link for _, reps in results for r in reps for link in r["skipped_links"]})
        if skipped:
            self.warn(f"sync: skipped {len(skipped)} symbolic link(s) leading out of the synced "
                      f"directory: {', '.join(skipped[:5])}{' ...' if len(skipped) > 5 else ''}")

    def preview(self, plan: LaunchPlan) -> tuple[str, list[str]]:
        """What a dry run shows besides the scripts: every file each sync would send, read
        from this machine alone (text for the plan's output, and a line each)."""
        nodes = [n.host.name for n in plan.nodes]
        shown = [preview(local, sub, self.sync_exclude, nodes, self.sync_delete)
                 for local, sub in self.sync]
        return "".join(text for text, _ in shown), [line for _, line in shown]


# --- the module's hooks (backends.BackendModule) -----------------------------------------------


def nodes(inventory: Inventory | None, request: Request) -> Inventory:
    """The inventory's hosts (or --hosts'), narrowed by --nodes, --hosts and --exclude."""
    if inventory is None:
        raise InputError("the ssh backend needs -i/--inventory or --hosts")
    return inventory.select(nodes=request.nodes, hosts=request.host_filter,
                            exclude=request.exclude)


def configure(inventory: Inventory, request: Request) -> Inventory:
    """Its settings (host keys, keepalive) are laid over the inventory with everyone's
    (cluster.resolve.settings), being recorded with the run; --sync goes to create()."""
    return inventory


def create(inventory: Inventory, request: Request,
           sync: Sequence[tuple[str, str]] = ()) -> SshBackend:
    return SshBackend(inventory.ssh, sync=list(sync), sync_exclude=request.sync_exclude,
                      sync_delete=request.sync_delete)


def recorded(run: RunDir) -> SshBackend:
    return SshBackend(run.inventory().ssh)



if TYPE_CHECKING:       # mypy holds this module and its class to the contract
    from .. import Backend, BackendModule, NodeChecks, ssh as _module
    _hooks: BackendModule = _module
    _backend: Backend[LaunchPlan] = SshBackend()
    _checks: NodeChecks = SshBackend()
