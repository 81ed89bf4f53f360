"""One exception tree for the whole tool; each class carries its exit code.

    ClusterError                 1  anything else that went wrong
    ├── InputError               2  bad command line, template or inventory; nothing ran
    │   └── InventoryError       2  names file, line and key
    │       └── InventoryProblems   every problem of one load, in file order, then the count
    ├── PreflightError           3  a node failed the checks before start; nothing started
    │   └── backends.ssh.SshError   unreachable, authentication, unknown, changed or revoked host key
    ├── RunFailed                4  a node exited non-zero or was killed; the others were stopped
    ├── NodeLost                 5  the connection to a node was lost; the others were stopped
    ├── BackendError             6  the scheduler or transport refused (sbatch errors, ...)
    └── Interrupted    128+signal  Ctrl-C (130), SIGTERM (143), SIGHUP (129); every node stopped

Third-party exceptions (paramiko, subprocess) are translated into these at the boundary of the
module that calls them, so callers only ever catch ClusterError.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

# A rank that exits with this code asks not to be run again: no restart by the launcher, no
# failure requeue under SLURM (docs/failures.md, docs/slurm.md).
STOP_CODE = 93

class ClusterError(Exception):
    exit_code = 1

    def __init__(self, message: str, *, details: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.details = details

    def __str__(self) -> str:
        return self.message + (f"\n{self.details}" if self.details else "")


class InputError(ClusterError):
    exit_code = 2


class InventoryError(InputError):
    def __init__(self, source: str | None, line: int | None, key: str | None, problem: str,
                 *, hint: str = "") -> None:
        where = source or "<inventory>"
        if line is not None:
            where += f":{line}"
        if key:
            where += f": {key}"
        text = f"{where}: {problem}"
        if hint:
            text += f" ({hint})"
        super().__init__(text)
        self.source, self.line, self.key, self.problem = source, line, key, problem


class InventoryProblems(InventoryError):
    """Several problems of one file, each on a line of its own in file order, then how many:
    the user fixes them all after one run instead of one per run."""

    def __init__(self, problems: list[InventoryError]) -> None:
        ordered = sorted(problems, key=lambda p: (p.line is None, p.line or 0))
        first = ordered[0]
        where = first.source or "<inventory>"
        text = "\n".join(p.message for p in ordered) + f"\n{len(ordered)} problems in {where}"
        ClusterError.__init__(self, text)
        self.source, self.line, self.key, self.problem = first.source, first.line, first.key, first.problem
        self.problems = ordered


class Problems:
    """What one load has found so far. Each independent part of a file is checked inside
    `noted()`, so a problem there is kept and the load goes on to the next part."""

    def __init__(self) -> None:
        self.found: list[InventoryError] = []

    @contextlib.contextmanager
    def noted(self) -> Iterator[None]:
        try:
            yield
        except InventoryError as exc:
            for problem in getattr(exc, "problems", None) or [exc]:
                if problem not in self.found:       # check() raises what was noted already
                    self.found.append(problem)

    def check(self) -> None:
        """Raise what was found: one problem as it is, several as InventoryProblems."""
        if len(self.found) == 1:
            raise self.found[0]
        if self.found:
            raise InventoryProblems(self.found)


class PreflightError(ClusterError):
    exit_code = 3
    nodes: list[str] = []          # the nodes that failed, where known


class RunFailed(ClusterError):
    exit_code = 4


class NodeLost(RunFailed):
    exit_code = 5


class BackendError(ClusterError):
    exit_code = 6


class Interrupted(ClusterError):
    """A stop was asked for (Ctrl-C, SIGTERM, SIGHUP); exit code 128 + the signal."""
    exit_code = 130

    def __init__(self, message: str, *, signum: int = 2, details: str = "") -> None:
        super().__init__(message, details=details)
        self.exit_code = 128 + signum


class StopRequested(KeyboardInterrupt):
    """Raised in the main thread by the launcher's handler for SIGINT, SIGTERM and SIGHUP,
    so each of them stops every node exactly as Ctrl-C does."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def signum_of(exc: BaseException) -> int:
    """The signal behind an interruption (a plain KeyboardInterrupt is SIGINT)."""
    return getattr(exc, "signum", 2)


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """'did you mean 'address'?' or, failing a close match, the list of valid choices."""
    import difflib           # here: only a mistake pays its import
    choices = sorted(choices)
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    if close:
        return f"did you mean '{close[0]}'?"
    return "valid keys are: " + ", ".join(choices)
