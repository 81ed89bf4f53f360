"""The `cluster` command: thin verbs that parse options and call the library.

    cluster up      render, check every node, start every node, stream, stop all on failure
    cluster status  one row per node of a run (the newest by default)
    cluster logs    a run's saved or live output
    cluster down    stop every node of a run
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import click

from . import inventory as inv_mod
from .errors import ClusterError, InputError, StopRequested
from .spec import check_text, reserved_env
from .plan import Job, Templates
from .runs import RunDir, new_run_id
from .watch import Console

CONTEXT = {"help_option_names": ["-h", "--help"]}
CHECKPOINTS = "checkpoints"          # the reference trainer's, in the working directory
_ARGV: list[str] | None = None      # the command line as given, recorded in the run directory


def default_train_dir() -> Path:
    """train/ of a source checkout, or the installed copy (package cluster.train)."""
    checkout = Path(__file__).resolve().parent.parent / "train"
    if (checkout / "train.py").is_file():
        return checkout
    from importlib import resources
    return Path(str(resources.files("cluster.train")))


@click.group(context_settings=CONTEXT)
@click.version_option(package_name="cluster")
def main() -> None:
    """Launch PyTorch distributed training on many machines at once."""


@main.command(context_settings={**CONTEXT, "allow_interspersed_args": False})
@click.option("-i", "--inventory", "inventory_path", type=click.Path(dir_okay=False),
              help="Hosts: YAML inventory, MPI/DeepSpeed hostfile. None: this machine.")
@click.option("--nodes", type=int, help="Use the first N selected hosts (or N simulated local nodes).")
@click.option("--hosts", help="Only these hosts: names or hostlists, e.g. gpu[01-04],cpu1.")
@click.option("--exclude", help="Leave out these hosts (names or hostlists).")
@click.option("--backend", type=click.Choice(["local", "ssh", "slurm"]),
              help="Where to run. Default: the inventory's 'backend', else ssh; local with no inventory.")
@click.option("--local", "force_local", is_flag=True, help="Run on this machine (same as --backend local).")
@click.option("--dry-run", is_flag=True, help="Render and record the plan, print every script; contact nothing.")
@click.option("--detach", is_flag=True, help="Start and return; use status/logs/down later.")
@click.option("--no-preflight", is_flag=True,
              help="Skip the cross-node checks (same torch, every node reaching the master port) "
                   "and let each node choose its interface at start.")
@click.option("--templates", "templates_dir", type=click.Path(file_okay=False),
              help="A directory whose templates override the built-in ones by name.")
@click.option("--nproc-per-node", type=int, help="Processes per node (overrides the inventory).")
@click.option("--master-port", type=click.IntRange(1, 65535), help="Rendezvous port on the first node.")
@click.option("--env", "env_pairs", multiple=True, metavar="KEY=VALUE", help="Extra environment (repeatable).")
@click.option("--secret-env", "secret_names", multiple=True, metavar="NAME",
              help="Pass NAME from this shell to every node without writing its value anywhere (repeatable).")
@click.option("--max-restarts", type=click.IntRange(0), metavar="N",
              help="After a failure, start the whole job again up to N times (default: the "
                   "inventory's restarts, else 0). Not after a failure before every node joined.")
@click.option("--restart-after", type=click.FloatRange(min=0), metavar="SECONDS",
              help="A failure in the first SECONDS of running is configuration: never restarted.")
@click.option("--min-nodes", type=click.IntRange(1), metavar="M",
              help="Leave a lost node out of the next attempt while M nodes remain.")
@click.option("--hang-timeout", type=click.FloatRange(min=0), metavar="SECONDS",
              help="No progress on any node for SECONDS: collect every rank's stack, then stop "
                   "(or restart). Default: the inventory's hang_timeout, else off.")
@click.option("--stop-grace", type=click.FloatRange(min=0, min_open=True), metavar="SECONDS",
              help="SIGTERM to SIGKILL when stopping a node (default 30; the inventory's stop_grace).")
@click.option("--keepalive", type=click.FloatRange(min=0, min_open=True), metavar="SECONDS",
              help="SSH: silence after which a node counts as lost, and a node stops itself "
                   "without the launcher (default 60; the inventory's ssh.keepalive).")
@click.option("--sync", "sync_dir", type=click.Path(file_okay=False, exists=True),
              help="SSH: copy this directory into every node's workdir first (unchanged files skipped).")
@click.option("--sync-exclude", multiple=True, metavar="PATTERN",
              help="Leave out of --sync what matches (gitignore syntax, repeatable); "
                   "DIR/.clusterignore, else DIR/.gitignore, is honoured too.")
@click.option("--host-key-policy", type=click.Choice(["strict", "accept-new", "off"]),
              help="SSH host keys: strict (default) needs known_hosts to match.")
@click.option("--partition", help="SLURM partition.")
@click.option("--time", "time_limit", help="SLURM time limit, e.g. 01:00:00.")
@click.option("--account", help="SLURM account.")
@click.option("--max-requeues", type=click.IntRange(0), help="SLURM: requeue at most this often.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def up(inventory_path: str | None, nodes: int | None, hosts: str | None, exclude: str | None,
       backend: str | None, force_local: bool, dry_run: bool, detach: bool, no_preflight: bool,
       templates_dir: str | None, nproc_per_node: int | None, master_port: int | None,
       env_pairs: tuple[str, ...], secret_names: tuple[str, ...], max_restarts: int | None,
       restart_after: float | None, min_nodes: int | None, hang_timeout: float | None,
       stop_grace: float | None,
       keepalive: float | None, sync_dir: str | None, sync_exclude: tuple[str, ...],
       host_key_policy: str | None,
       partition: str | None, time_limit: str | None, account: str | None,
       max_requeues: int | None, command: tuple[str, ...]) -> None:
    """Start SCRIPT [ARGS...] with torchrun on every node (default: train/train.py)."""
    argv = list(_ARGV or ["cluster", *sys.argv[1:]])
    extra_env = _parse_env(env_pairs)
    secrets = _parse_secret_names(secret_names, extra_env)
    for what, value in (("--partition", partition), ("--time", time_limit), ("--account", account),
                        ("SCRIPT", command[0] if command else None)):
        if value is not None:
            check_text(value, what)
    templates = Templates(templates_dir)
    if force_local:
        if backend not in (None, "local"):
            raise InputError("--local and --backend " + backend + " contradict each other")
        backend = "local"
    inventory = _inventory(inventory_path, hosts, exclude, nodes, backend, nproc_per_node, extra_env)
    inventory = _settings(inventory, secrets, stop_grace, keepalive, host_key_policy)
    backend = backend or inventory.backend
    from . import launch
    launch.secret_values(inventory)          # a missing secret stops here: nothing is created
    if (sync_dir or sync_exclude) and backend != "ssh":
        raise InputError("--sync is for the ssh backend (local and SLURM nodes see this filesystem)")
    run_id = new_run_id()
    script, args, code_dir = _command(command, backend, run_id)
    job = Job(run_id=run_id, script=script, args=args, master_port=master_port,
              node_root=None)
    console = Console()

    if backend == "slurm":
        from .backends import slurm
        count = None if inventory.slurm.nodelist else nodes    # a nodelist fixed the count
        settings = slurm.cli_settings(inventory.slurm, nodes=count, partition=partition,
                                      time=time_limit, account=account, max_requeues=max_requeues)
        code = slurm.up(inventory, job, templates, settings, argv=argv, console=console,
                        dry_run=dry_run, detach=detach, nproc_per_node=nproc_per_node)
        sys.exit(code)

    run = RunDir.create(run_id)
    if backend == "local":
        job = Job(run_id=run_id, script=script, args=args, master_port=master_port,
                  node_root=str((run.path / "nodes").resolve()))
    if dry_run:
        launch.dry_run(inventory, job, templates, run, backend, argv, console)
        return
    # --sync DIR lands in each node's workdir; the built-in trainer in <workdir>/cluster-train.
    sync = [(d, sub) for d, sub in ((sync_dir, "."), (code_dir, "cluster-train")) if d]
    impl = _backend(backend, inventory, sync=sync, sync_exclude=sync_exclude)
    try:
        options = launch.Options(
            detach=detach, preflight=not no_preflight,
            restarts=inventory.restarts if max_restarts is None else max_restarts,
            restart_after=restart_after or 0.0, min_nodes=min_nodes,
            hang_timeout=inventory.hang_timeout if hang_timeout is None else hang_timeout)
        launch.up(inventory, job, templates, impl, run, argv, console, options)
    finally:
        impl.close()


def _parse_env(pairs: tuple[str, ...]) -> dict[str, str]:
    env: dict[str, str] = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not inv_mod.ENV_KEY.match(key):
            raise InputError(f"Invalid value for --env: {pair!r} (expected KEY=VALUE, KEY an identifier)")
        why = reserved_env(key)
        if why:
            raise InputError(f"Invalid value for --env: {why}")
        env[key] = value
    return env


def _parse_secret_names(names: tuple[str, ...], env: dict[str, str]) -> tuple[str, ...]:
    for name in names:
        if not inv_mod.ENV_KEY.match(name):
            raise InputError(f"Invalid value for --secret-env: {name!r} is not an environment "
                             f"variable name (give the NAME; its value comes from this shell)")
        why = reserved_env(name) or (f"{name} is also given with --env" if name in env else None)
        if why:
            raise InputError(f"Invalid value for --secret-env: {why}")
    return tuple(dict.fromkeys(names))


def _settings(inventory: inv_mod.Inventory, secrets: tuple[str, ...], stop_grace: float | None,
              keepalive: float | None, host_key_policy: str | None) -> inv_mod.Inventory:
    """Command-line settings over the inventory's; recorded with the run, so that status,
    logs and down later connect and stop the same way."""
    import dataclasses
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


def _inventory(path: str | None, hosts: str | None, exclude: str | None, nodes: int | None,
               backend: str | None, nproc: int | None, extra_env: dict[str, str]) -> inv_mod.Inventory:
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
            inventory = inv_mod.Inventory(hosts=(inv_mod.Host(name="slurm", address="slurm"),),
                                          backend="slurm", hosts_given=False)
            return _override(_slurm_nodes(inventory, nodes, None, exclude), nproc, extra_env)
        raise InputError(f"the {backend} backend needs -i/--inventory or --hosts")
    else:
        inventory = inv_mod.load(path)
    if backend == "slurm" or (backend is None and inventory.backend == "slurm"):
        return _override(_slurm_nodes(inventory, nodes, hosts, exclude), nproc, extra_env)
    return _override(inventory.select(nodes=nodes, hosts=hosts, exclude=exclude), nproc, extra_env)


def _slurm_nodes(inventory: inv_mod.Inventory, nodes: int | None, hosts: str | None,
                 exclude: str | None) -> inv_mod.Inventory:
    """Which nodes SLURM may use. Hosts the inventory lists (narrowed by --hosts, --exclude and
    --nodes, as over SSH) become --nodelist; with none listed SLURM chooses, --hosts becomes
    --nodelist, --exclude --exclude and --nodes the count."""
    import dataclasses
    import hostlist
    slurm = inventory.slurm
    if inventory.hosts_given:
        chosen = inventory.select(nodes=nodes, hosts=hosts, exclude=exclude)
        names = [h.name for h in chosen.hosts]
        slurm = dataclasses.replace(slurm, nodelist=hostlist.collect_hostlist(names),
                                    nodes=len(names))
        return dataclasses.replace(chosen, slurm=slurm)
    if hosts:
        names = inv_mod.expand_names(hosts, "--hosts")
        slurm = dataclasses.replace(slurm, nodelist=hostlist.collect_hostlist(names),
                                    nodes=max(len(names), nodes or slurm.nodes or 1))
    if exclude:
        slurm = dataclasses.replace(slurm, exclude=hostlist.collect_hostlist(
            inv_mod.expand_names(exclude, "--exclude")))
    return dataclasses.replace(inventory, slurm=slurm)


def _override(inventory: inv_mod.Inventory, nproc: int | None,
              extra_env: dict[str, str]) -> inv_mod.Inventory:
    import dataclasses
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


def _command(command: tuple[str, ...], backend: str,
             run_id: str) -> tuple[str, tuple[str, ...], str | None]:
    """The script and its arguments; with none given, the reference trainer. For SSH the
    trainer's directory is synced to the nodes, so the path is relative to the workdir."""
    train_dir = default_train_dir()
    if command:
        # `-- cluster-train/train.py ARGS` over SSH: the built-in trainer with your arguments.
        synced = str(train_dir) if backend == "ssh" and command[0].startswith("cluster-train/") else None
        return command[0], tuple(command[1:]), synced
    # Checkpoints go to a place that outlives one run, so that every attempt of a restarted
    # job, and the next `cluster up`, resumes from the newest one.
    if backend == "ssh":
        return "cluster-train/train.py", ("--out", f".cluster/{run_id}/train", "--checkpoint-dir",
                                          CHECKPOINTS), str(train_dir)
    if backend == "slurm":
        return str(train_dir / "train.py"), ("--out", f"runs/{run_id}/train", "--checkpoint-dir",
                                             str(Path(CHECKPOINTS).resolve())), None
    out = (Path(os.environ.get("CLUSTER_RUNS_DIR", "runs")) / run_id / "train").resolve()
    return str(train_dir / "train.py"), ("--out", str(out), "--checkpoint-dir",
                                         str(Path(CHECKPOINTS).resolve())), None


def _backend(name: str, inventory: inv_mod.Inventory, sync: list[tuple[str, str]],
             sync_exclude: tuple[str, ...] = ()):
    if name == "local":
        from .backends.local import LocalBackend
        return LocalBackend()
    from .backends.ssh import SshBackend
    return SshBackend(inventory.ssh, sync=sync, sync_exclude=sync_exclude)


@main.command(context_settings=CONTEXT)
@click.option("-i", "--inventory", "inventory_path", type=click.Path(dir_okay=False),
              help="Hosts: YAML inventory, MPI/DeepSpeed hostfile. None: this machine.")
@click.option("--nodes", type=int, help="Only the first N selected hosts.")
@click.option("--hosts", help="Only these hosts: names or hostlists.")
@click.option("--exclude", help="Leave out these hosts.")
@click.option("--local", "force_local", is_flag=True, help="Check this machine (simulated nodes).")
@click.option("--master-port", type=click.IntRange(1, 65535), help="The port to check (default: derived).")
@click.option("--host-key-policy", type=click.Choice(["strict", "accept-new", "off"]))
@click.option("--deep", is_flag=True, help="Also run a collective across all nodes: sum, bandwidth, slow links.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (schema in the README).")
def doctor(inventory_path: str | None, nodes: int | None, hosts: str | None, exclude: str | None,
           force_local: bool, master_port: int | None, host_key_policy: str | None, deep: bool,
           as_json: bool) -> None:
    """Check every node, and the network between them, before a run: exit 0 only when nothing fails."""
    import dataclasses
    import json as json_mod
    from . import doctor as doc
    from . import launch
    backend_name = "local" if force_local else None
    inventory = _inventory(inventory_path, hosts, exclude, nodes, backend_name, None, {})
    inventory = _settings(inventory, (), None, None, host_key_policy)
    name = backend_name or inventory.backend
    if name == "slurm":
        raise InputError("cluster doctor checks SSH or local nodes; under SLURM, run it inside "
                         "an allocation with the allocated hosts (--hosts)")
    if master_port:
        inventory = dataclasses.replace(inventory, hosts=tuple(
            h.replace(master_port=master_port) for h in inventory.hosts))
    templates = Templates()
    sync = [(str(doc.REMOTE), doc.TOOLS_SUBDIR)] if deep and name == "ssh" else []
    backend = _backend(name, inventory, sync=sync)
    console = Console()

    def run_deep() -> dict:
        job = doc.collective_job(new_run_id(), over_ssh=name == "ssh")
        run = RunDir.create(job.run_id)
        if name == "local":
            job = dataclasses.replace(job, node_root=str((run.path / "nodes").resolve()))
        env = doc.collective_env([65536, 1 << 20, 16 << 20], iters=5)
        return doc.measure_collective(
            inventory, lambda inv, j, c: launch.up(inv, j, templates, backend, run,
                                                   ["cluster", "doctor", "--deep"], c), job, env)
    try:
        report = doc.diagnose(inventory, backend, templates, deep=deep, run_deep=run_deep)
    finally:
        backend.close()
    if as_json:
        click.echo(json_mod.dumps(report.to_json(), indent=2))
    else:
        click.echo(doc.render_text(report))
    if not report.ok:
        sys.exit(3)


def _recorded_backend(run: RunDir):
    name = run.meta()["backend"]
    if name == "slurm":
        from .backends.slurm import SlurmBackend
        return SlurmBackend()
    if name == "local":
        from .backends.local import LocalBackend
        return LocalBackend()
    from .backends.ssh import SshBackend
    return SshBackend(run.inventory().ssh)


@main.command(context_settings=CONTEXT)
@click.argument("run", required=False)
def status(run: str | None) -> None:
    """Each node of RUN (default: the newest): running / exited with code / stopped / lost."""
    from rich.console import Console as RichConsole
    from rich.table import Table
    rd = RunDir.find(run)
    backend = _recorded_backend(rd)
    try:
        rows = backend.status(rd)
    finally:
        backend.close()
    table = Table(title=f"run {rd.run_id} ({rd.meta()['backend']})")
    for col in ("rank", "node", "state", "exit code", "pid", "uptime", "detail"):
        table.add_column(col)
    for r in rows:
        uptime = time.strftime("%H:%M:%S", time.gmtime(r.uptime)) if r.uptime else ""
        table.add_row(str(r.rank), r.name, r.state, "" if r.code is None else str(r.code),
                      "" if r.pid is None else str(r.pid), uptime, r.detail)
    out = RichConsole()
    out.print(table)
    attempts = rd.meta().get("attempts") or []
    if len(attempts) > 1 or rd.meta().get("attempt"):
        for a in attempts:
            out.print(f"attempt {a['attempt'] + 1} ({', '.join(a['nodes'])}): {a['ended']}",
                      markup=False, highlight=False)


@main.command(context_settings=CONTEXT)
@click.argument("run", required=False)
@click.option("-f", "--follow", is_flag=True, help="Keep printing until the run ends.")
@click.option("--node", help="Only this node (by name).")
def logs(run: str | None, follow: bool, node: str | None) -> None:
    """The output of RUN (default: the newest), prefixed by node."""
    rd = RunDir.find(run)
    names = [n["name"] for n in rd.meta()["nodes"]]
    if node and node not in names:
        raise InputError(f"Invalid value for --node: {node!r} is not in run {rd.run_id} ({', '.join(names)})")
    from .watch import LineSplitter
    console = Console()
    backend = _recorded_backend(rd)
    splitters: dict[str, LineSplitter] = {}
    try:
        for label, chunk in backend.logs(rd, node=node, follow=follow):
            sp = splitters.setdefault(label, LineSplitter())
            for line in sp.feed(chunk):
                console.node_line(label, list(splitters).index(label), line)
        for label, sp in splitters.items():
            for line in sp.flush():
                console.node_line(label, list(splitters).index(label), line)
    finally:
        backend.close()


@main.command(context_settings=CONTEXT)
@click.argument("run", required=False)
def down(run: str | None) -> None:
    """Stop every node of RUN (default: the newest) and verify nothing is left."""
    rd = RunDir.find(run)
    backend = _recorded_backend(rd)
    console = Console()
    try:
        reports = backend.stop_run(rd)
    finally:
        backend.close()
    bad = False
    for name, rep in reports.items():
        if rep.get("error"):
            bad = True
            console.info(f"[{name}] {rep['error']}")
        elif rep.get("left"):
            bad = True
            console.info(f"[{name}] still alive after SIGKILL: {rep['left']}")
        elif "state" in rep:       # a scheduler job: its state after the cancel
            console.info(f"[{name}] {rep['state']}")
        else:
            console.info(f"[{name}] stopped ({len(rep.get('signalled', []))} process(es) signalled)")
    if bad:
        raise ClusterError(f"run {rd.run_id}: not every node could be stopped")


def install_stop_handlers() -> None:
    """SIGINT, SIGTERM and SIGHUP each stop every node, as Ctrl-C does. Installed explicitly:
    a launcher started with SIGINT ignored (`cluster up &` from a script, some CI runners)
    inherits that disposition, and Python then never raises KeyboardInterrupt."""
    import signal

    def stop(signum: int, _frame: object) -> None:
        raise StopRequested(signum)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop)


def run_cli(args: list[str] | None = None) -> int:
    """Entry point with our error handling: message on stderr, exit code per error class."""
    global _ARGV
    _ARGV = ["cluster", *(sys.argv[1:] if args is None else args)]
    try:
        main.main(args=args, prog_name="cluster", standalone_mode=False)
    except ClusterError as exc:
        click.echo(f"cluster: error: {exc}", err=True)
        return exc.exit_code
    except click.exceptions.Abort as exc:   # click's wrapping of a KeyboardInterrupt
        click.echo("cluster: interrupted", err=True)
        return 128 + getattr(exc.__cause__, "signum", 2)
    except click.ClickException as exc:
        exc.show()
        return 2
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 0
    except KeyboardInterrupt as exc:
        click.echo("cluster: interrupted", err=True)
        return 128 + getattr(exc, "signum", 2)
    return 0


def entry() -> None:
    install_stop_handlers()
    sys.exit(run_cli())
