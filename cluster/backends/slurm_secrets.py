"""The secret environment's file of a SLURM job: the values in a private file beside the job's
output (0600 in a folder of its own, 0700, made new), read by the batch script at every attempt,
removed once the job is over for good. Never in sbatch's environment, which the controller
saves (docs/slurm.md, "Secrets")."""
from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from ..errors import BackendError, InputError
from ..runs import RunDir

__all__ = ["forget_secrets", "secret_values", "secrets_file", "write_secrets"]


def secret_values(names: Sequence[str], secrets: Mapping[str, Mapping[str, str]]) -> dict[str, str]:
    """The values of the job's secret names, from the launch flow's per-host values (all
    taken from the launching shell, so the same for every host)."""
    values: dict[str, str] = {}
    for per_host in secrets.values():
        values.update(per_host)
    missing = [n for n in names if n not in values]
    if missing:
        raise InputError(f"secret environment variable(s) {', '.join(missing)} not set in this "
                         f"shell (secret_env / --secret-env take their values from it)")
    return {n: values[n] for n in names}


def write_secrets(path: Path, values: Mapping[str, str]) -> None:
    """The values as NAME=value records ended by NUL (a value may hold a newline), in a file
    only its owner reads (0600, created so), in a folder of its own (0700) made new: an
    existing one is refused rather than trusted."""
    try:
        path.parent.mkdir(mode=0o700)
        os.chmod(path.parent, 0o700)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        raise BackendError(f"cannot write the secret environment's file {path} for the job: "
                           f"{exc.strerror}") from None
    with os.fdopen(fd, "wb") as f:
        f.write(b"".join(f"{k}={v}".encode() + b"\0" for k, v in values.items()))


def forget_secrets(path: str) -> str:
    """Remove the secrets' file and its folder, if still there (the job may have). What went
    wrong, or "": the run's outcome matters more than this, so the caller warns."""
    if not path:
        return ""
    for remove, what in ((os.unlink, Path(path)), (os.rmdir, Path(path).parent)):
        try:
            remove(what)
        except FileNotFoundError:
            pass
        except OSError as exc:
            return f"cannot remove {what} (the secret environment's file): {exc.strerror}; remove it by hand"
    return ""


def secrets_file(run: RunDir) -> str:
    return str((run.meta().get("slurm") or {}).get("secrets_file") or "")
