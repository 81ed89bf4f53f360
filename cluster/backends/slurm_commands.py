"""The seam under the SLURM backend: every SLURM program (sbatch, squeue, sacct, scancel,
scontrol, sinfo) runs through one SlurmCommands object, and what a call that fails for a moment
(a busy or failing-over controller) is worth asking again, with its backoff."""
from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass

from ..errors import BackendError

__all__ = ["Completed", "IDEMPOTENT", "Retry", "SlurmCommands", "TRANSIENT"]


@dataclass(frozen=True)
class Completed:
    argv: tuple[str, ...]
    code: int
    stdout: str
    stderr: str


# What slurmctld says when it is briefly out of reach (busy, restarting, failing over): worth
# asking again, unlike a refusal.
TRANSIENT = re.compile(r"Socket timed out|Unable to contact slurm controller|Connection refused|"
                       r"Connection reset|Zero Bytes were transmitted|Resource temporarily "
                       r"unavailable|Transport endpoint|Communication connection failure|"
                       r"did not answer within|Slurm backup controller in standby", re.I)
# Queries and scancel may be repeated safely; sbatch may not (a timeout may hide a submission).
IDEMPOTENT = frozenset({"squeue", "sacct", "scontrol", "scancel", "sinfo"})


@dataclass(frozen=True)
class Retry:
    """Backoff for SLURM calls that fail for a moment: waits 1, 2, 4 ... up to `cap` seconds
    between tries, for at most `budget` seconds in all."""
    budget: float = 300.0
    first: float = 1.0
    cap: float = 30.0

    def delays(self) -> Iterator[float]:
        delay, spent = self.first, 0.0
        while spent + delay <= self.budget:
            yield delay
            spent += delay
            delay = min(self.cap, delay * 2)


class SlurmCommands:
    """Runs one SLURM program and returns what it said. The only place that starts them."""

    def __init__(self, env: Mapping[str, str] | None = None, timeout: float = 60.0) -> None:
        self.env = dict(env) if env is not None else None    # None: this process's environment
        self.timeout = timeout

    def run(self, argv: Sequence[str], *, without: Collection[str] = ()) -> Completed:
        """`without`: names left out of the program's environment."""
        env = self.env
        if without:
            env = {k: v for k, v in (os.environ if env is None else env).items() if k not in without}
        try:
            p = subprocess.run(list(argv), env=env, capture_output=True, text=True,
                               timeout=self.timeout, stdin=subprocess.DEVNULL)
        except FileNotFoundError:
            raise BackendError(f"{argv[0]} not found: run this on a machine with the SLURM "
                               f"client commands (a login node)") from None
        except subprocess.TimeoutExpired:
            raise BackendError(f"`{' '.join(argv)}` did not answer within {self.timeout:.0f} s") from None
        return Completed(tuple(argv), p.returncode, p.stdout, p.stderr)
