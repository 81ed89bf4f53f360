"""From what a user asks (command-line options, or the Python API's arguments) to what the
library takes: the inventory (with the options laid over it), the job's script, and the
backend; and the backend of a recorded run."""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path

from . import inventory as inv_mod
from .errors import InputError
from .runs import RunDir
from .spec import ENV_KEY, Host, Inventory, check_text, expand_names, reserved_env

CHECKPOINTS = "checkpoints"          # the reference trainer's, in the working directory


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
              keepalive: float | None, host_key_policy: str | None) -> Inventory:
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
                               stop_grace=stop_grace or inventory.stop_grace)


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


def inventory(path: str | None, hosts: str | None, exclude: str | None, nodes: int | None,
              backend: str | None, nproc: int | None, extra_env: dict[str, str],
              environ: Mapping[str, str] = os.environ) -> Inventory:
    if backend == "local" or (path is None and hosts is None and backend in (None, "local")):
        if path:
            raise InputError("--local runs on this machine; leave out -i/--inventory")
        from .backends.local import local_inventory
        return local_inventory(1 if nodes is None else nodes, nproc_per_node=nproc, env=extra_env)
    if path is None and hosts is not None:
        inventory = inv_mod.from_hostnames(hosts)
        hosts = None
    elif path is None:
        if backend == "slurm":
            inventory = Inventory(hosts=(Host(name="slurm", address="slurm"),),
                                          backend="slurm", hosts_given=False)
            return override(slurm_nodes(inventory, nodes, None, exclude), nproc, extra_env, environ)
        raise InputError(f"the {backend} backend needs -i/--inventory or --hosts")
    else:
        inventory = inv_mod.load(path)
    if backend == "slurm" or (backend is None and inventory.backend == "slurm"):
        return override(slurm_nodes(inventory, nodes, hosts, exclude), nproc, extra_env, environ)
    return override(inventory.select(nodes=nodes, hosts=hosts, exclude=exclude), nproc, extra_env,
                    environ)


def slurm_nodes(inventory: Inventory, nodes: int | None, hosts: str | None,
                 exclude: str | None) -> Inventory:
    """Which nodes SLURM may use. Hosts the inventory lists (narrowed by --hosts, --exclude and
    --nodes, as over SSH) become --nodelist; with none listed SLURM chooses, --hosts becomes
    --nodelist, --exclude --exclude and --nodes the count."""
    import hostlist
    slurm = inventory.slurm
    if inventory.hosts_given:
        chosen = inventory.select(nodes=nodes, hosts=hosts, exclude=exclude)
        names = [h.name for h in chosen.hosts]
        slurm = dataclasses.replace(slurm, nodelist=hostlist.collect_hostlist(names),
                                    nodes=len(names))
        return dataclasses.replace(chosen, slurm=slurm)
    if hosts:
        names = expand_names(hosts, "--hosts")
        slurm = dataclasses.replace(slurm, nodelist=hostlist.collect_hostlist(names),
                                    nodes=max(len(names), nodes or slurm.nodes or 1))
    if exclude:
        slurm = dataclasses.replace(slurm, exclude=hostlist.collect_hostlist(
            expand_names(exclude, "--exclude")))
    return dataclasses.replace(inventory, slurm=slurm)


def override(inventory: Inventory, nproc: int | None, extra_env: dict[str, str],
             environ: Mapping[str, str] = os.environ) -> Inventory:
    """The inventory's env, then what its env_forward copies from this shell, then --env."""
    inventory = inv_mod.forward_env(inventory, environ)
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
    """The script and its arguments; with none given, the reference trainer. For SSH the
    trainer's directory is synced to the nodes, so the path is relative to the workdir."""
    train_dir = default_train_dir()
    # `cluster up -- --epochs 3`: no script can start with '-', so these are the reference
    # trainer's own options, after its defaults (argparse takes the last, so yours win).
    extra = command if command and command[0].startswith("-") else ()
    if command and not extra:
        # `-- cluster-train/train.py ARGS` over SSH: the built-in trainer with your arguments.
        synced = str(train_dir) if backend == "ssh" and command[0].startswith("cluster-train/") else None
        return command[0], tuple(command[1:]), synced
    # Checkpoints go to a place that outlives one run (checkpoints/, git-ignored), so that
    # every attempt of a restarted job, and the next `cluster up`, resumes an unfinished run
    # from its newest one; the trainer starts anew over a finished run's (train/train.py).
    if backend == "ssh":
        return "cluster-train/train.py", ("--out", f".cluster/{run_id}/train", "--checkpoint-dir",
                                          CHECKPOINTS, *extra), str(train_dir)
    if backend == "slurm":
        return str(train_dir / "train.py"), ("--out", f"runs/{run_id}/train", "--checkpoint-dir",
                                             str(Path(CHECKPOINTS).resolve()), *extra), None
    out = (Path(os.environ.get("CLUSTER_RUNS_DIR", "runs")) / run_id / "train").resolve()
    return str(train_dir / "train.py"), ("--out", str(out), "--checkpoint-dir",
                                         str(Path(CHECKPOINTS).resolve()), *extra), None


def backend_name(chosen: str | None, force_local: bool) -> str | None:
    if force_local:
        if chosen not in (None, "local"):
            raise InputError(f"--local and --backend {chosen} contradict each other")
        return "local"
    return chosen


def backend(name: str, inventory: Inventory, sync: list[tuple[str, str]],
            sync_exclude: tuple[str, ...] = (), sync_delete: bool = False):
    if name == "local":
        from .backends.local import LocalBackend
        return LocalBackend()
    if name == "slurm":
        from .backends.slurm import SlurmBackend
        return SlurmBackend(cwd=os.getcwd())
    from .backends.ssh import SshBackend
    return SshBackend(inventory.ssh, sync=sync, sync_exclude=sync_exclude, sync_delete=sync_delete)


def recorded_backend(run: RunDir):
    name = run.meta()["backend"]
    if name == "slurm":
        from .backends.slurm import SlurmBackend
        return SlurmBackend()
    if name == "local":
        from .backends.local import LocalBackend
        return LocalBackend()
    from .backends.ssh import SshBackend
    return SshBackend(run.inventory().ssh)


