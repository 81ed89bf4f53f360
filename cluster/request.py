"""What a user asks of `cluster up`, by the names of its options (the Python API's keywords):
plain data, checked by cluster.api on its way to a run. Backend-free, so that each backend
module can read the options that are its own (backends/__init__.py: the module hooks)."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Request:
    """Everything `cluster up` can be asked, by the names of its options."""
    inventory_path: str | None = None          # None: this machine
    command: tuple[str, ...] = ()              # SCRIPT ARGS...; () the reference trainer
    nodes: int | None = None
    hosts: str | None = None
    exclude: str | None = None
    python: str | None = None                  # over every host's (resolve.host_settings)
    user: str | None = None
    port: int | None = None                    # SSH
    identity_file: str | None = None
    backend: str | None = None
    force_local: bool = False
    dry_run: bool = False
    detach: bool = False
    no_preflight: bool = False
    no_tuning: bool = False                    # ignore `cluster doctor --tune-nccl`'s cache
    templates_dir: str | None = None
    nproc_per_node: int | None = None
    master_port: int | None = None
    env: Mapping[str, str] = field(default_factory=dict)   # over the inventory's and forwarded
    secret_names: tuple[str, ...] = ()
    max_restarts: int | None = None
    restart_after: float | None = None
    min_nodes: int | None = None
    replace_slow: bool = False                  # a node named slow is set aside for a spare
    grow: bool = False                          # a lost node back: full size at a checkpoint
    hang_timeout: float | str | None = None     # seconds (0: off), or 'auto': learned
    metrics_port: str | int | None = None       # [HOST:]PORT: the live metrics served there
    gate: str | None = None                     # the health gate: off, basic or deep
    stop_grace: float | None = None
    keepalive: float | None = None
    sync_dir: str | None = None
    sync_exclude: tuple[str, ...] = ()
    sync_delete: bool = False
    host_key_policy: str | None = None
    partition: str | None = None
    time_limit: str | None = None
    account: str | None = None
    max_requeues: int | None = None
    notify: tuple[str, ...] = ()                # alerts' URLs, besides the inventory's notify:

    @property
    def host_filter(self) -> str | None:
        """--hosts as a filter over an inventory file's hosts; without a file, --hosts made
        the inventory and filters nothing more."""
        return self.hosts if self.inventory_path else None
