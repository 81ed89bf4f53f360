"""The transport contract: how the local and SSH backends reach a node. A Transport runs a
command and answers (Result), or starts one and streams it (Channel), like Fabric's Connection
and Invoke's Context reading the same; a subprocess here (backends/local.py), an SSH connection
there (backends/ssh/transport.py)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol


# What a shell command on a node prints before its answer (a login shell's greeting from
# ~/.bashrc, a profile script's echo) is not the answer: a listing prints this mark first, and
# its reader takes what follows the mark. `printf` writes it, so no file name or greeting made
# of ordinary text can be mistaken for it.
ANSWER_MARK = b"\x1ecluster-answer\x1f\n"
PRINT_MARK = "printf '\\036cluster-answer\\037\\n'"


def after_mark(data: bytes) -> bytes:
    """What a command printed after ANSWER_MARK (everything, where there is no mark)."""
    _, mark, rest = data.partition(ANSWER_MARK)
    return rest if mark else data


@dataclass
class Result:
    code: int | None                 # None: the connection broke before an exit status came
    stdout: bytes
    stderr: bytes

    def text(self) -> str:
        return (self.stdout + self.stderr).decode(errors="replace").strip()


class Channel(Protocol):
    def read(self) -> bytes:
        """The next chunk of output; b'' once it has ended."""

    def write(self, data: bytes) -> None:
        """Send bytes to the command's standard input (the supervisor's control channel)."""

    def wait(self) -> int | None:
        """The exit status, or None when the connection was lost."""

    def fileno(self) -> int:
        """Readable (select) when read() has output or the end for it without blocking: one
        thread reads every node's channel (cluster.observe.watch)."""

    def close(self) -> None: ...


class Transport(Protocol):
    """One node: run a shell command, start a streaming one, write a file, copy files both
    ways (--sync's SyncTarget and `cluster pull`'s PullSource are parts of this)."""
    label: str

    def open(self) -> None:
        """Connect now (otherwise the first use does); raises ClusterError."""

    def run(self, command: str, *, timeout: float | None = None, input: bytes = b"") -> Result: ...

    def spawn(self, command: str) -> Channel: ...

    def put(self, data: bytes, path: str, mode: int) -> None: ...

    def upload(self, local: Path, path: str, mode: int, mtime: int) -> None: ...

    def download(self, path: str, into: BinaryIO) -> int: ...

    def close(self) -> None: ...
