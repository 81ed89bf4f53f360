"""The `cluster` command's group and entry point: our error handling (a message on stderr, an
exit code per error class) and the stop signals (SIGINT, SIGTERM, SIGHUP) every verb honours.

Each verb is a module of its own (up.py, doctor.py, runs.py, execute.py, clean.py, top.py, pull.py,
nodes.py, completion.py), imported when its verb is asked for (VERBS); cluster.resolve turns options into an inventory and a backend, cluster.api
runs `up`. The verbs parse options and call the library, nothing more.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import click

from ..errors import ClusterError, StopRequested
from ..texts import control_char, url_problem

if TYPE_CHECKING:
    from click.shell_completion import CompletionItem

Command = TypeVar("Command", bound=Callable[..., Any])

CONTEXT = {"help_option_names": ["-h", "--help"]}
_ARGV: list[str] | None = None      # the command line as given, recorded in the run directory


def argv() -> list[str]:
    return list(_ARGV or ["cluster", *sys.argv[1:]])


class NotifyUrl(click.ParamType):
    """--notify: an http(s) URL, refused with the URL shown redacted (its path is a token)."""
    name = "url"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        why = url_problem(str(value))
        if why:
            self.fail(why, param, ctx)
        return str(value)


class SafePath(click.Path):
    """click.Path that refuses a control character (a NUL would reach os.stat as a traceback,
    a newline a script) with the usual 'Invalid value for ...' and exit 2."""

    def convert(self, value: str | os.PathLike[str], param: click.Parameter | None,
                ctx: click.Context | None) -> Any:
        bad = control_char(str(value))
        if bad:
            self.fail(f"control character {bad} in {str(value)!r}", param, ctx)
        return super().convert(value, param, ctx)


class SafeText(click.ParamType):
    """A non-empty string without a control character (the inventory's rule for a field that
    reaches a script), else the usual 'Invalid value for ...' and exit 2."""
    name = "text"

    def convert(self, value: object, param: click.Parameter | None,
                ctx: click.Context | None) -> str:
        bad = control_char(str(value))
        if bad or not str(value):
            self.fail(f"control character {bad} in {str(value)!r}" if bad else "must not be empty",
                      param, ctx)
        return str(value)


def host_options(command: Command) -> Command:
    """--python, --user, --port, --identity: one setting for every host, over the inventory's
    (and with --hosts alone, the only way to give them). cluster.resolve.host_settings applies them."""
    for option in reversed((
            click.option("--python", metavar="PATH", type=SafeText(),
                         help="The nodes' python (the one with torch); over the inventory's 'python'."),
            click.option("--user", metavar="NAME", type=SafeText(),
                         help="SSH login name on every node; over the inventory's 'user'."),
            click.option("--port", type=click.IntRange(1, 65535),
                         help="SSH port of every node; over the inventory's 'port'."),
            click.option("--identity", "identity_file", metavar="FILE", type=SafePath(dir_okay=False),
                         help="SSH private key; over the inventory's 'identity_file'."))):
        command = option(command)
    return command


# Each verb's module (cluster/cli/<module>.py), imported when that verb is asked for: `cluster
# up --local` never loads paramiko, nor `cluster up` the doctor's or top's code.
VERBS = {"clean": "clean", "completion": "completion", "doctor": "doctor", "down": "runs",
         "exec": "execute", "logs": "runs", "nodes": "nodes", "pull": "pull", "status": "runs",
         "top": "top", "up": "up"}


class Verbs(click.Group):
    """The group whose verbs are imported at first use (VERBS); each module registers its own
    on `main`."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(VERBS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in VERBS and name not in self.commands:
            import importlib
            importlib.import_module(f"{__package__}.{VERBS[name]}")
        return super().get_command(ctx, name)


@click.group(cls=Verbs, context_settings=CONTEXT)
@click.version_option(package_name="cluster")
def main() -> None:
    """Launch PyTorch distributed training on many machines at once."""


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


def complete_run(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[CompletionItem]:
    """Shell completion of a RUN argument: the run ids in ./runs (CLUSTER_RUNS_DIR), newest
    first, that start with what was typed."""
    from click.shell_completion import CompletionItem
    from ..runs import runs_root
    root = runs_root()
    try:
        names = sorted((p.name for p in root.iterdir() if (p / "run.json").is_file()), reverse=True)
    except OSError:
        return []
    return [CompletionItem(n) for n in names if n.startswith(incomplete)]
