"""The `cluster` command: thin verbs that parse options and call the library.

    cluster up      render, check every node, start every node, stream, stop all on failure
    cluster doctor  check every node and the network between them, before a run
    cluster status  one row per node of a run (the newest by default)
    cluster logs    a run's saved or live output
    cluster down    stop every node of a run
    cluster exec    one command on every node at once, output prefixed by node
    cluster clean   old run folders on the nodes and old run records here, never a running run
    cluster top     a run's nodes, refreshed: state, uptime, GPUs, the trainer's step and loss
    cluster pull    files from every node of a run into runs/<id>/pulled/<node>/
    cluster nodes   each node across runs (the node ledger): healthy or quarantined, and release
    cluster completion  the shell completion script (bash, zsh, fish)
"""
import time

STARTED = time.monotonic()   # the command's start, as near as cluster sees it (goodput counts from it)

from .main import entry, install_stop_handlers, main, run_cli  # each verb's module: at its first use (main.VERBS)

__all__ = ["entry", "install_stop_handlers", "main", "run_cli"]
