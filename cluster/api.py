"""cluster as a library, for programs that launch programs: the same flow as `cluster up`.

    import cluster

    run = cluster.up("inventory.yaml", "train.py", ["--epochs", "3"], env={"WANDB_MODE": "offline"})
    print(run.status())      # {'gpu-a': 'running', 'gpu-b': 'running'}
    code = run.wait()        # 0 once every node finished; run.error says why when not
    run.down()               # or stop every node early

`cluster up` is built on it: a Request is what its options say, prepare() checks all of it
(bad input raises InputError here, before anything is created or contacted), and
Prepared.run() does what the command does.
"""
from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from . import backends, launch, resolve, tuning
from .backends import (EXEC, NODE_CHECKS, REMOTE_NODES, REQUEUES, RESTARTS, SHARED_FILESYSTEM, SYNC,
                       Backend, supports)
from .console import Console, NodeProgress
from .errors import ClusterError, InputError, did_you_mean
from .observe.hang_timeout import valid as valid_hang_timeout
from .observe import metrics
from .plan import Job, Templates
from .request import Request
from .runs import RunDir, cache_root, new_run_id
from .spec import Inventory
from .texts import check_text, env_problem, redacted_url, redacted_words, url_problem

__all__ = ["Prepared", "Request", "Run", "Unanswered", "detached_error", "first_failed",
           "prepare", "up", "LogErrors"]

from .handle import LogErrors, Run, Unanswered, detached_error, first_failed  # noqa: E402


@dataclass
class Prepared:
    """A checked request: what to run, where, and how; nothing created yet."""
    inventory: Inventory
    job: Job
    templates: Templates
    backend: Backend[Any]
    backend_name: str
    options: launch.Options
    dry_run: bool
    notes: tuple[str, ...] = ()     # the node ledger's word on the hosts picked, said first

    def run(self, console: Console, argv: list[str],
            created: Callable[[RunDir], object] | None = None) -> int:
        """Record the run, then check, start and watch it (or only print it, for a dry run).
        created(run_dir) is called once the run directory (and its run.json) exists. An
        error is recorded in run.json too (`error`, `exit_code`): the record says why."""
        argv = redacted_words(argv, self.options.notify)   # recorded: a webhook's URL is a token
        progress = NodeProgress(stream=console.err)   # drawn only on a terminal, 8+ nodes
        if hasattr(self.backend, "progress"):
            self.backend.progress = progress
        run: RunDir | None = None
        try:
            run = RunDir.create(self.job.run_id, meta={"backend": self.backend_name,
                                                       "command": argv, "cwd": os.getcwd(),
                                                       "dry_run": self.dry_run})
            self.templates.save()        # the compiled templates, now that a run is made
            job = self.job
            if not supports(self.backend, REMOTE_NODES):    # simulated nodes: one folder here
                job = dataclasses.replace(job, node_root=run.node_root())
            if created is not None:
                created(run)
            for note in self.notes:
                console.info(note)
            if self.inventory.tuning:
                console.info(tuning.describe(self.inventory.tuning))
            if self.dry_run:
                if self.options.notify:
                    console.info(f"dry run: alerts would go to "
                                 f"{', '.join(map(redacted_url, self.options.notify))}")
                launch.dry_run(self.inventory, job, self.templates, run, self.backend, argv, console)
                return 0
            if self.inventory.gate.level == "deep" and supports(self.backend, NODE_CHECKS):
                from . import doctor          # here: only a deep gate needs it (13 ms)
                doctor.deep_gate(self.inventory, self.backend, self.templates, console)
            return launch.up(self.inventory, job, self.templates, self.backend, run, argv,
                             console, self.options)
        except ClusterError as exc:
            if run is not None:
                run.update(error=exc.message, exit_code=exc.exit_code)
            raise
        finally:
            progress.close()
            self.backend.close()


def prepare(request: Request, environ: Mapping[str, str] = os.environ,
            launched: float | None = None) -> Prepared:
    """Every check that needs no node, in one pass: the request's own values, the backend
    (chosen once) and its nodes with the command line over the inventory, the backend's own
    options, the secrets' presence, the rendered scripts. Raises InputError; creates and
    contacts nothing (the compiled templates reach their cache when the run starts).
    launched: time.monotonic() when the command began (the CLI's start), else now: where
    the run's goodput starts counting."""
    launched = time.monotonic() if launched is None else launched
    r = request
    secrets = _checked(r)
    served = _served(r)
    templates = Templates(r.templates_dir, cache_root(environ) / "templates")
    name, inventory = resolve.where(r, secrets, environ)
    chosen = resolve.picked(r, name, inventory, secrets, environ)
    inventory = chosen.inventory
    restarts = r.max_restarts or inventory.restarts
    if not supports(name, RESTARTS) and (r.min_nodes or r.grow or r.hang_timeout
                                         or inventory.hang_timeout
                                         or (restarts and not supports(name, REQUEUES))):
        raise InputError(f"--min-nodes, --grow and --hang-timeout are for "
                         f"{' and '.join(_with(RESTARTS))} runs (--max-restarts also for "
                         f"{' and '.join(_with(REQUEUES))}); under {name} a job requeues "
                         f"itself (--max-requeues)")
    inventory = backends.entry(name).load().configure(inventory, r)
    if supports(name, EXEC) and not r.no_tuning:      # measured by `cluster doctor`, which execs
        inventory = tuning.applied(inventory, tuning.Cache(tuning.cache_path(environ)))
    spares = tuning.extended(chosen.spares, inventory)     # a spare runs as the others do
    if not r.dry_run:     # a dry run needs no secret's value: it names the missing ones
        launch.secret_values(inventory, environ)  # a missing secret stops here: nothing is created
    if (r.sync_dir or r.sync_exclude or r.sync_delete) and not supports(name, SYNC):
        raise InputError(f"--sync is for the {' and '.join(_with(SYNC))} backend "
                         f"({' and '.join(_with(SHARED_FILESYSTEM))} "
                         f"nodes see this filesystem)")
    if r.sync_delete and not r.sync_dir:
        raise InputError("--sync-delete goes with --sync DIR (it removes what DIR no longer has)")
    run_id = new_run_id()
    script, args, code_dir = resolve.command(r.command, name, run_id)
    job = Job(run_id=run_id, script=script, args=args, master_port=r.master_port)
    # --sync DIR lands in each node's workdir; the built-in trainer in <workdir>/cluster-train.
    sync = [(d, sub) for d, sub in ((r.sync_dir, "."), (code_dir, resolve.TRAINER_SUBDIR)) if d]
    backend = backends.create(name, inventory, r, sync)
    try:
        backend.plan(inventory, job, templates)  # bad input fails here, before anything is written
    except BaseException:
        backend.close()
        raise
    options = launch.Options(
        detach=r.detach, preflight=not r.no_preflight,
        # a backend that REQUEUES restarts the job itself (configure handed it the count)
        restarts=(inventory.restarts if r.max_restarts is None else r.max_restarts)
        if supports(name, RESTARTS) else 0,
        restart_after=r.restart_after or 0.0, min_nodes=r.min_nodes,
        hang_timeout=inventory.hang_timeout if r.hang_timeout is None else r.hang_timeout,
        hang_auto=inventory.hang_auto, slow_node=inventory.slow_node, ledger=chosen.ledger,
        spares=spares, replace_slow=r.replace_slow, grow=r.grow,
        readmit_every=inventory.gate.readmit_every,
        metrics=None if r.detach else served or _endpoint(inventory), launched=launched,
        notify=tuple(dict.fromkeys(inventory.master.notify + _urls(r.notify))))
    notes = chosen.notes + _metrics_notes(r, inventory)
    return Prepared(inventory, job, templates, backend, name, options, r.dry_run, notes)


def _checked(r: Request) -> tuple[str, ...]:
    """The request's own values, before any file is read: its texts, the secrets' names."""
    for name, env_value in r.env.items():          # --env, --env-file and env= alike
        why = env_problem(str(name), str(env_value))
        if why:
            raise InputError(f"Invalid value for --env (env=): {why}")
    secrets = resolve.parse_secret_names(r.secret_names, dict(r.env))
    if r.hang_timeout is not None and not valid_hang_timeout(r.hang_timeout):
        raise InputError(f"Invalid value for --hang-timeout: {r.hang_timeout!r} is not 'auto' "
                         f"or a number of seconds >= 0")
    for url in _urls(r.notify):
        why = url_problem(url)
        if why:
            raise InputError(f"Invalid value for --notify (notify=): {why}")
    for what, value in (("--partition", r.partition), ("--time", r.time_limit),
                        ("--account", r.account), ("SCRIPT", r.command[0] if r.command else None)):
        if value is not None:
            check_text(value, what)
    for number, arg in enumerate(r.command[1:], 1):     # written into the node's script too
        check_text(arg, f"the script's argument {number}")
    return secrets


def _endpoint(inventory: Inventory) -> metrics.Endpoint | None:
    """The inventory's metrics: (address, port), or None when it names no port."""
    m = inventory.metrics
    return None if m.port is None else (m.address, m.port)


# A detached run serves no metrics: the way it has instead.
DETACHED_METRICS = ("a detached run has no launcher left to serve them; `cluster status RUN "
                    "--metrics-textfile PATH` writes them for node_exporter (docs/metrics.md)")


def _served(r: Request) -> metrics.Endpoint | None:
    """--metrics-port (metrics_port=) read, before any file is; refused with --detach."""
    if r.metrics_port is None:
        return None
    where = metrics.endpoint(r.metrics_port)
    if r.detach:
        raise InputError(f"--metrics-port serves while `cluster up` watches the run, and "
                         f"--detach leaves it: {DETACHED_METRICS}")
    return where


def _metrics_notes(r: Request, inventory: Inventory) -> tuple[str, ...]:
    """The inventory's metrics, left unserved by a detached run: said."""
    if r.detach and inventory.metrics.port is not None:
        return (f"metrics: not served ({DETACHED_METRICS})",)
    return ()


def _urls(notify: str | Sequence[str]) -> tuple[str, ...]:
    """notify= as the API may give it: one URL, or several."""
    return (notify,) if isinstance(notify, str) else tuple(notify)


def _with(capability: str) -> list[str]:
    return [name for name in backends.NAMES if supports(name, capability)]


# --- the handle ------------------------------------------------------------------------------


def up(inventory: str | os.PathLike[str] | None = None, script: str | None = None,
       args: Sequence[str] = (), *, env: Mapping[str, str] | None = None, echo: bool = True,
       **options: Any) -> "Run":
    """Start SCRIPT ARGS with torchrun on every node of the inventory (None: this machine;
    no script: the reference trainer) and return at once with a handle on the run. Keyword
    options are `cluster up`'s, by their Request names (nodes=2, backend="ssh",
    max_restarts=1, ...). Bad input raises InputError before anything starts; echo=False
    keeps the nodes' output out of this process's stdout (it is in the run's logs)."""
    if script is None and args:
        raise InputError("args without a script: give the script too")
    command = (str(script), *map(str, args)) if script is not None else ()
    _known_options(options)
    request = Request(inventory_path=None if inventory is None else os.fspath(inventory),
                      command=command, env=dict(env or {}), **options)
    return Run.start(prepare(request), echo=echo)


def _known_options(options: Mapping[str, Any]) -> None:
    """A misspelled keyword is an InputError naming the nearest option, not Request's
    TypeError."""
    own = {"inventory_path", "command", "env"}          # given by up()'s own parameters
    names = {f.name for f in dataclasses.fields(Request)} - own
    for key in options:
        if key not in names:
            raise InputError(f"up() got an unknown option {key!r}: {did_you_mean(key, names)}")
