"""`cluster completion [bash|zsh|fish]`: the shell completion script, as click makes it."""
from __future__ import annotations

import os

import click

from .main import CONTEXT, main

SHELLS = ("bash", "zsh", "fish")
COMPLETE_VAR = "_CLUSTER_COMPLETE"       # click's name for prog "cluster"


@main.command(context_settings=CONTEXT)
@click.argument("shell", required=False, type=click.Choice(SHELLS))
def completion(shell: str | None) -> None:
    """Print the completion script for SHELL (default: the one $SHELL names).

    \b
    bash:  eval "$(cluster completion bash)"        (in ~/.bashrc)
    zsh:   eval "$(cluster completion zsh)"         (in ~/.zshrc)
    fish:  cluster completion fish > ~/.config/fish/completions/cluster.fish
    """
    from click.shell_completion import get_completion_class
    shell = shell or _login_shell()
    cls = get_completion_class(shell)
    if cls is None:        # click knows the three above; kept for a click without one of them
        raise click.BadParameter(f"{shell!r} (valid: {', '.join(SHELLS)})", param_hint="SHELL")
    click.echo(cls(main, {}, "cluster", COMPLETE_VAR).source())


def _login_shell() -> str:
    name = os.path.basename(os.environ.get("SHELL", ""))
    return name if name in SHELLS else "bash"
