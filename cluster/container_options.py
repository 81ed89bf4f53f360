"""The `RUNTIME run` options cluster sets itself, so that `container.options` may not hold them.

They belong to the container code (the node's `docker run` / `podman run`, rendered from
templates/); they sit here, below the inventory, so that the inventory can refuse them at load
with the file's line.
"""
from __future__ import annotations

# Each option that would undo what cluster sets itself, and why. Matched on the option's name,
# alone or with '=value'; short ones also when combined (-it, -dit).
RESERVED_RUN_OPTIONS = {
    "--network": "host networking keeps the interface choice and MASTER_ADDR valid",
    "--net": "host networking keeps the interface choice and MASTER_ADDR valid",
    "--ipc": "host IPC gives NCCL and DataLoader workers the node's shared memory",
    "--shm-size": "with host IPC the container uses the node's /dev/shm (podman refuses both)",
    "--name": "the container is named after the run and node, which is how it is stopped",
    "--rm": "cluster removes the container itself",
    "--detach": "the node's supervisor follows the container to its end",
    "--interactive": "standard input carries the secret environment",
    "--tty": "standard input carries the secret environment",
    "--env": "values on a command line are visible in ps: use env or secret_env",
    "--env-file": "cluster writes the environment file itself: use env or secret_env",
    "--env-host": "the node's whole environment would leak into the container: use env",
}
RESERVED_SHORT_OPTIONS = {"d": "--detach", "i": "--interactive", "t": "--tty", "e": "--env"}
SHORT_BOOLEANS = "dit" + "P"          # docker's short flags that take no value: they combine


def reserved_run_option(word: str) -> str | None:
    """Why one `RUNTIME run` word may not be given (cluster sets that option itself), or None."""
    name = word.split("=", 1)[0] if word.startswith("--") else _short_reserved(word)
    return RESERVED_RUN_OPTIONS.get(name or "")


def _short_reserved(word: str) -> str | None:
    """The reserved long option a short-option word sets (-it: --interactive), else None.
    Boolean letters combine; the first letter that takes a value ends the word (-v/data:/d)."""
    if not word.startswith("-"):
        return None
    for letter in word[1:]:
        if letter in RESERVED_SHORT_OPTIONS:
            return RESERVED_SHORT_OPTIONS[letter]
        if letter not in SHORT_BOOLEANS:
            return None
    return None
