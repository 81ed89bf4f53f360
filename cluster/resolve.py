"""From what a user asks (command-line options, or the Python API's arguments) to what the
library takes: the backend (chosen once, from the registry) and its nodes with the options laid
over the inventory's, and the job's script."""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import backends
from . import inventory as inv_mod
from .backends import Backend
from .errors import InputError
from .recovery.ledger import Ledger
from .recovery.pool import ledger_for, pick
from .request import Request
from .runs import RunDir

from .spec import Host, Inventory
from .texts import ENV_KEY, check_text, reserved_env

if TYPE_CHECKING:
    from .backends.supervised import SupervisedBackend

CHECKPOINTS = "checkpoints"          # the reference trainer's, in the working directory
TRAINER_SUBDIR = "cluster-train"     # where the trainer lands in a node's workdir when copied


def default_train_dir() -> Path:
    """train/ of a source checkout, or the installed copy (package cluster.train)."""
    checkout = Path(__file__).resolve().parent.parent / "train"
    if (checkout / "train.py").is_file():
        return checkout
    from importlib import resources
    return Path(str(resources.files("cluster.train")))



def parse_env(pairs: tuple[str, ...], files: tuple[str, ...] = (),
              environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """--env-file FILE (dotenv), then --env KEY=VALUE or --env NAME (NAME's value from this
    shell; not set is an error), later ones over earlier ones."""
    environ = os.environ if environ is None else environ
    env: dict[str, str] = {}
    for path in files:
        env.update(inv_mod.load_env_file(path))
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not ENV_KEY.match(key):
            raise InputError(f"Invalid value for --env: {pair!r} (expected KEY=VALUE, or NAME to "
                             f"pass NAME's value from this shell; KEY an identifier)")
        why = reserved_env(key)
        if why:
            raise InputError(f"Invalid value for --env: {why}")
        if not eq:
            if key not in environ:
                raise InputError(f"Invalid value for --env: {key} is not set in this shell "
                                 f"(--env {key} passes its value from here; export it first)")
            value = environ[key]
        env[key] = value
    return env


def parse_secret_names(names: tuple[str, ...], env: dict[str, str]) -> tuple[str, ...]:
    for name in names:
        if not ENV_KEY.match(name):
            raise InputError(f"Invalid value for --secret-env: {name!r} is not an environment "
                             f"variable name (give the NAME; its value comes from this shell)")
        why = reserved_env(name) or (f"{name} is also given with --env" if name in env else None)
        if why:
            raise InputError(f"Invalid value for --secret-env: {why}")
    return tuple(dict.fromkeys(names))


def settings(inventory: Inventory, secrets: tuple[str, ...], stop_grace: float | None,
              keepalive: float | None, host_key_policy: str | None,
              gate: str | None = None) -> Inventory:
    """Command-line settings over the inventory's; recorded with the run, so that status,
    logs and down later connect and stop the same way."""
    ssh = inventory.ssh
    if host_key_policy:
        ssh = dataclasses.replace(ssh, host_key_policy=host_key_policy)
    if keepalive is not None:
        ssh = dataclasses.replace(ssh, keepalive=keepalive)
    hosts = inventory.hosts
    if secrets:
        clash = sorted({n for h in hosts for n in secrets if n in dict(h.env)})
        if clash:
            raise InputError(f"Invalid value for --secret-env: {', '.join(clash)} is set in the "
                             f"inventory's env too; a secret's value comes only from this shell")
        hosts = tuple(h.replace(secret_env=tuple(dict.fromkeys(h.secret_env + secrets)))
                      for h in hosts)
    return dataclasses.replace(inventory, ssh=ssh, hosts=hosts,
                               stop_grace=stop_grace or inventory.stop_grace,
                               gate=dataclasses.replace(inventory.gate, level=gate or
                                                        inventory.gate.level))


def host_settings(inventory: Inventory, python: str | None = None,
                  user: str | None = None, port: int | None = None,
                  identity_file: str | None = None) -> Inventory:
    """--python, --user, --port, --identity over every host's own value (the only way to give
    them with --hosts alone); the inventory's rules for these keys hold."""
    changes: dict[str, object] = {}
    for key, option, value in (("python", "--python", python), ("user", "--user", user),
                               ("identity_file", "--identity", identity_file)):
        if value is not None:
            if not value:
                raise InputError(f"Invalid value for {option}: must not be empty")
            changes[key] = check_text(value, option)
    if port is not None:
        if not 1 <= port <= 65535:
            raise InputError(f"Invalid value for --port: {port} is not a port number (1 to 65535)")
        changes["port"] = port
    hosts = tuple(h.replace(**changes) for h in inventory.hosts)
    bare = [h.name for h in hosts if h.python == "auto" and not h.setup]
    if bare:
        raise InputError(f"Invalid value for --python: 'auto' takes the python that 'setup' leaves "
                         f"on PATH, and {', '.join(bare)} has no setup (name the interpreter)")
    return dataclasses.replace(inventory, hosts=hosts)


def loaded(path: str | None, hosts: str | None) -> Inventory | None:
    """The inventory file, or one made from --hosts' names; None when neither is given."""
    if path is not None:
        return inv_mod.load(path)
    return inv_mod.from_hostnames(hosts) if hosts is not None else None


def where(request: Request, secrets: tuple[str, ...] = (),
          environ: Mapping[str, str] = os.environ) -> tuple[str, Inventory]:
    """The request's backend (chosen once, from the registry) and its nodes, the command
    line's settings laid over the inventory's: loaded (or made from hostnames), narrowed by
    the backend, the environment and the host settings applied."""
    r = request
    found = loaded(r.inventory_path, r.hosts)
    name = backends.choose(r.backend, r.force_local, found)
    inventory = backends.entry(name).load().nodes(found, r)
    inventory = override(inventory, r.nproc_per_node, dict(r.env), environ, r.dry_run)
    inventory = settings(inventory, secrets, r.stop_grace, r.keepalive, r.host_key_policy, r.gate)
    return name, host_settings(inventory, r.python, r.user, r.port, r.identity_file)


@dataclasses.dataclass(frozen=True)
class Picked:
    inventory: Inventory                 # its hosts: those that run
    ledger: Ledger | None = None
    spares: tuple[Host, ...] = ()        # the selected hosts --nodes left waiting, healthy
    notes: tuple[str, ...] = ()          # said in the launch's first lines


def picked(request: Request, name: str, inventory: Inventory, secrets: tuple[str, ...] = (),
           environ: Mapping[str, str] = os.environ) -> Picked:
    """For `cluster up` on nodes it checks: the node ledger of this inventory, the hosts
    picked with it (a quarantined node is left out while others are available: with --nodes,
    from all of the selected hosts, not only the first N), the rest of them as spares, and
    what the launch says of it."""
    if not backends.supports(name, backends.NODE_CHECKS):
        return Picked(inventory)
    ledger = ledger_for(request.inventory_path, inventory.gate, environ)
    wider, count = inventory, None
    if request.inventory_path:                 # else --nodes made the nodes
        if request.nodes is not None:
            wider = where(dataclasses.replace(request, nodes=None), secrets, environ)[1]
        count = running_count(request.nodes, wider)
    hosts = sorted(wider.hosts, key=lambda h: h.spare)      # spare: true last, else in order
    bad = ledger.quarantined(h.name for h in hosts)
    chosen = pick(hosts, bad, nodes=count, min_nodes=request.min_nodes)
    running = {h.name for h in chosen.hosts}
    spares = tuple(h for h in wider.hosts if h.name not in running and h.name not in bad)
    notes = chosen.notes + ((f"spares: {', '.join(h.name for h in spares)} wait to take the "
                             f"place of a node that fails",) if spares else ())
    return Picked(dataclasses.replace(inventory, hosts=chosen.hosts), ledger, spares, notes)


def running_count(asked: int | None, inventory: Inventory) -> int | None:
    """How many hosts run: --nodes, else the inventory's nodes:, else every host not marked
    spare: true (None: all of them)."""
    spares = sum(h.spare for h in inventory.hosts)
    count = asked or inventory.nodes or (len(inventory.hosts) - spares if spares else None)
    if count is not None and count > len(inventory.hosts):
        raise InputError(f"Invalid value for {'--nodes' if asked else 'nodes'}: {count} "
                         f"requested but only {len(inventory.hosts)} host(s) selected from "
                         f"{inventory.source or 'the inventory'}")
    if count == 0:
        raise InputError(f"every host of {inventory.source or 'the inventory'} is spare: true; "
                         f"mark the ones that run spare: false (or give --nodes N)")
    return count


def override(inventory: Inventory, nproc: int | None, extra_env: dict[str, str],
             environ: Mapping[str, str] = os.environ, dry_run: bool = False) -> Inventory:
    """The inventory's env, then what its env_forward copies from this shell (a dry run
    leaves out a name it does not set), then --env."""
    inventory = inv_mod.forward_env(inventory, environ, dry_run)
    hosts = []
    for h in inventory.hosts:
        changes: dict[str, object] = {}
        if nproc is not None:
            if nproc < 1:
                raise InputError("Invalid value for --nproc-per-node: must be at least 1")
            changes["nproc_per_node"] = nproc
        if extra_env:
            changes["env"] = tuple({**dict(h.env), **extra_env}.items())
        hosts.append(h.replace(**changes))
    return dataclasses.replace(inventory, hosts=tuple(hosts))


def command(command: tuple[str, ...], backend: str,
            run_id: str) -> tuple[str, tuple[str, ...], str | None]:
    """The script and its arguments, and the directory to copy to every node (None: none);
    with no script, the reference trainer. Nodes that do not see this filesystem get the
    trainer's directory copied into their workdir, so its path is relative to that."""
    train_dir = default_train_dir()
    here = backends.supports(backend, backends.SHARED_FILESYSTEM)
    # `cluster up -- --epochs 3`: no script can start with '-', so these are the reference
    # trainer's own options, after its defaults (argparse takes the last, so yours win).
    extra = command if command and command[0].startswith("-") else ()
    if command and not extra:
        # `-- cluster-train/train.py ARGS` over SSH: the built-in trainer with your arguments.
        copied = not here and command[0].startswith(f"{TRAINER_SUBDIR}/")
        return command[0], tuple(command[1:]), str(train_dir) if copied else None
    # Checkpoints go to a place that outlives one run (checkpoints/, git-ignored), so that
    # every attempt of a restarted job, and the next `cluster up`, resumes an unfinished run
    # from its newest one; the trainer starts anew over a finished run's (train/train.py).
    if not here:
        return f"{TRAINER_SUBDIR}/train.py", ("--out", f".cluster/{run_id}/train",
                                             "--checkpoint-dir", CHECKPOINTS, *extra), str(train_dir)
    out = (Path(os.environ.get("CLUSTER_RUNS_DIR", "runs")) / run_id / "train").resolve()
    return str(train_dir / "train.py"), ("--out", str(out), "--checkpoint-dir",
                                         str(Path(CHECKPOINTS).resolve()), *extra), None


def backend(name: str, inventory: Inventory,
            sync: Sequence[tuple[str, str]] = ()) -> SupervisedBackend:
    """The backend that runs cluster's programs on these nodes (cluster doctor; the EXEC
    capability); sync: (dir, subdir of the workdir) to copy there first."""
    return backends.with_exec(backends.create(name, inventory, Request(), sync))


def recorded_backend(run: RunDir) -> Backend[Any]:
    return backends.recorded(run)
