"""The small files of a run's folder on its node (tag, pgid, supervisor.pid, exit, ...): what
the supervisor records and every later look at the run (stop, status, clean) reads.

Standard library only, Python 3.8+; beside supervisor.py in the node's run directory.
"""
import json
import os


def path(d, name):
    return os.path.join(d, name)


def write_atomic(d, name, text):
    tmp = path(d, "." + name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path(d, name))


def read_json(d, name):
    try:
        with open(path(d, name)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def read_number(d, name, kind=int):
    """The number in one of the run directory's small files, or None."""
    try:
        with open(path(d, name)) as f:
            return kind(f.read().strip())
    except (OSError, ValueError):
        return None
