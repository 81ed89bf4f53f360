"""A node's output read for its workers' own errors, and torchrun's words that a worker
failed: what the attached watcher (cluster.observe.watch) and a detached run's wait (cluster.api) both
name as a failure's cause. Pure: lines in, the errors out."""
from __future__ import annotations

import itertools
import re
from collections import deque
from collections.abc import Callable

from ..console import TAIL_LINES
from ..nodes import signal_name

__all__ = ["TORCHRUN_FAILED", "WorkerErrors"]

# torchrun's last words when a worker of its node failed and no local restart is left: it
# prints this, then its interpreter takes about half a second more to end (measured at 8 nodes).
# The other nodes are stopped from this line, not from the exit.
TORCHRUN_FAILED = "torch.distributed.elastic.multiprocessing.errors.ChildFailedError"

# A worker's line as torch's excepthook prefixes it; python's own words when it cannot start
# the script at all (no traceback then); the root-cause rank in torchrun's closing report.
RANK_PREFIX = re.compile(r"^\[rank(\d+)\]: ?")
PYTHON_SAYS = re.compile(r"can't open file |: No module named |Error while finding module specification")
ROOT_RANK = re.compile(r"^\s*rank\s*: (\d+)")
ROOT_EXIT = re.compile(r"^\s*exitcode\s*: (-?\d+)")


class WorkerErrors:
    """A node's output read for its workers' own errors: the line each traceback ends with
    (`RuntimeError: ...`), or python's `can't open file ...`. torchrun's closing report
    (its ChildFailedError banner) names the root-cause rank but not its error, and comes
    last, so the worker's own words are further up than any tail of the output reaches."""

    def __init__(self, order: Callable[[], int] | None = None) -> None:
        self.found: list[tuple[int | None, str]] = []      # (global rank if prefixed, line)
        # When each rank first said an error, on a count every node's errors share (the order
        # they arrived in here, across nodes)
        self.order = order or itertools.count().__next__
        self.said_at: dict[int | None, int] = {}
        self.in_traceback: dict[int | None, bool] = {}
        # Each rank's traceback as it comes, and the last one it ended (frames, then the error
        # line): the evidence the final error shows, in place of torchrun's banner.
        self.reading: dict[int | None, deque[str]] = {}
        self.traces: dict[int | None, list[str]] = {}
        self.torchrun_failed = False
        self.in_root_cause = False
        self.root_rank: int | None = None
        self.root_exit: int | None = None                   # torchrun's exitcode of that rank

    def feed(self, line: str) -> None:
        if self.torchrun_failed:
            self._report(line)
            return
        if line.startswith(TORCHRUN_FAILED):              # torchrun's own traceback ends here
            self.torchrun_failed = True
            return
        m = RANK_PREFIX.match(line)
        rank, text = (int(m.group(1)), line[m.end():]) if m else (None, line)
        if text.startswith("Traceback (most recent call last)"):
            self.in_traceback[rank] = True
            self.reading[rank] = deque([text], maxlen=TAIL_LINES)   # a deep one: its last frames
        elif self.in_traceback.get(rank) and text.strip() and not text[0].isspace():
            self.in_traceback[rank] = False               # frames are indented; this is the error
            self._error(rank, text, self.reading.pop(rank, deque()))
        elif self.in_traceback.get(rank):
            self.reading.setdefault(rank, deque(maxlen=TAIL_LINES)).append(text)
        elif PYTHON_SAYS.search(text):
            self._error(rank, text, deque())

    def _error(self, rank: int | None, text: str, frames: deque[str]) -> None:
        frames.append(text)
        self.found.append((rank, text.strip()))
        self.said_at.setdefault(rank, self.order())
        self.traces[rank] = list(frames)

    def _report(self, line: str) -> None:
        if line.startswith("Root Cause"):
            self.in_root_cause = True
        elif self.in_root_cause and self.root_rank is None and (m := ROOT_RANK.match(line)):
            self.root_rank = int(m.group(1))
        elif self.in_root_cause and self.root_exit is None and (m := ROOT_EXIT.match(line)):
            self.root_exit = int(m.group(1))

    def cause(self, printed_only: bool = False) -> str | None:
        """The root-cause rank's last error (a chained exception ends with the one raised),
        else the first rank's that said one; else, for a worker that printed no error (an
        os._exit, a signal), how torchrun's report says it ended; None when nothing says.
        printed_only: only what the workers printed before torchrun's banner, which has all
        arrived when the banner does (its report comes after it, maybe not yet)."""
        if not self.found:
            return None if printed_only else self._silent_exit()
        return [text for r, text in self.found if r == self.cause_rank()][-1]

    def cause_rank(self) -> int | None:
        """The rank whose error is the cause: torchrun's root cause when it printed one, else
        the first that did (None: unprefixed output, or no error at all)."""
        if any(r == self.root_rank for r, _ in self.found):
            return self.root_rank
        return self.found[0][0] if self.found else None

    def traceback(self) -> list[str]:
        """The cause's own traceback (its last frames and the error line); [] when none."""
        return self.traces.get(self.cause_rank(), []) if self.found else []

    def others(self, but: int | None = None) -> list[tuple[int, int, str]]:
        """(when it first said one, rank, its last error) of each prefixed rank but `but`."""
        last: dict[int, str] = {}
        for rank, text in self.found:
            if rank is not None and rank != but:
                last[rank] = text
        return [(self.said_at[r], r, text) for r, text in last.items()]

    def _silent_exit(self) -> str | None:
        if self.root_rank is None or self.root_exit is None:
            return None
        if self.root_exit < 0:                  # torchrun writes a signal as its negative
            return f"worker rank {self.root_rank} was killed by {signal_name(-self.root_exit)}"
        return f"worker rank {self.root_rank} exited with code {self.root_exit}"
