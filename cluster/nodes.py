"""What a running node reports, as plain data: how it ended (NodeExit), a row of `cluster status`
(NodeStatus), and the control records its supervisor sends among its output (Demux).

Backend-free: the watcher and every backend use these, and import nothing of each other.
"""
from __future__ import annotations

import json
import signal as _signal
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .errors import NodeLost

RECORD_START, RECORD_END = b"\x1e", b"\x1f"     # ASCII record / unit separators


@dataclass(frozen=True)
class NodeExit:
    """How one node's work ended."""
    code: int | None = None          # exit status, when it exited
    signal: int | None = None        # the signal that killed it, when one did
    lost: bool = False               # the connection to the node broke first
    reason: str = ""
    detail: str = ""                 # how the backend puts it (a scheduler's final state)

    @property
    def ok(self) -> bool:
        return self.code == 0 and not self.lost

    def describe(self) -> str:
        if self.detail:
            return self.detail
        if self.lost:
            return f"connection lost{': ' + self.reason if self.reason else ''}"
        if self.signal:
            return f"killed by {signal_name(self.signal)}"
        if self.code is not None and self.code > 128 and self.code - 128 < 65:
            return f"exit code {self.code} ({signal_name(self.code - 128)})"
        return f"exit code {self.code}"


def signal_name(num: int) -> str:
    try:
        return _signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def end_detail(info: dict[str, Any]) -> str:
    """How a node's run ended, from its supervisor's status: a stop says whether every
    process ended within the grace after SIGTERM or had to be killed after it (the launcher
    killed once its workers are gone is not "killed": its work was over); an end that was no
    stop names the signal that killed it; then the reason."""
    grace = f"the {info['grace']:g} s grace" if isinstance(info.get("grace"), (int, float)) else "the grace"
    if info.get("how") == "term":
        how = f"SIGTERM: ended within {grace}"
    elif info.get("how") == "kill":
        how = f"SIGTERM, then SIGKILL after {grace}"
    elif info.get("signal"):
        how = f"killed by {signal_name(info['signal'])}"
    else:
        how = ""
    return "; ".join(x for x in (how, info.get("reason") or "") if x)


# A stopped node's exit code, by how its stop went, as a shell says a process ended by a signal:
# every process ended within the grace after SIGTERM, or SIGKILL ended what was left after it.
STOP_CODES = {"term": 128 + _signal.SIGTERM, "kill": 128 + _signal.SIGKILL}


def end_code(info: dict[str, Any]) -> int | None:
    """A node's exit code, from its supervisor's status or exit record. A stop's code is that
    of the stop, the same on every node of it: 143 when every process ended within the grace
    after SIGTERM, 137 when SIGKILL ended what was left after it. The job's own code under a
    stop is a race, no outcome: torchrun exits 1 when it unwinds before the stop kills it
    (once its workers are gone), none when it does not, node by node. An end that was no stop
    (or an older supervisor's record, without `how`) keeps the job's code."""
    if info.get("state") == "stopped" and info.get("how") in STOP_CODES:
        return STOP_CODES[info["how"]]
    code = info.get("code")
    return code if isinstance(code, int) and not isinstance(code, bool) else None


@dataclass
class NodeStatus:
    rank: int
    name: str
    state: str                       # running | exited | lost | unknown | pending | ...
    code: int | None = None
    pid: int | None = None
    uptime: float | None = None
    detail: str = ""
    ended: float | None = None       # when it ended, by the node's clock, when it says

    def said(self) -> str:
        """'stopped 143 (SIGTERM: ended within the 30 s grace; the launcher's connection
        closed)': how every verb that tells a node's end puts it."""
        return (f"{self.state}" + ("" if self.code is None else f" {self.code}")
                + (f" ({self.detail})" if self.detail else ""))


def node_row(rank: int, name: str, info: dict[str, Any]) -> NodeStatus:
    """A row of `cluster status` from a node's supervisor's status (its exit record, once
    the run has ended there), its code and words as every verb tells them."""
    return NodeStatus(rank, name, info.get("state", "unknown"), code=end_code(info),
                      pid=info.get("pgid"), uptime=info.get("uptime"), detail=end_detail(info),
                      ended=info.get("ended"))


# A node's state when it did not answer (backends' status rows): not an end, and not known.
UNREACHABLE = frozenset({"unreachable", "unknown"})


def unreachable_error(run_id: str, labels: Sequence[str], why: str) -> NodeLost:
    """A detached run's nodes judged lost by whoever follows it (`cluster logs -f`, the API's
    Run.wait()): said one way, with what to do. labels: "name rank" each."""
    nodes = ", ".join(f"[{label}]" for label in labels)
    names = ", ".join(label.rsplit(" ", 1)[0] for label in labels)
    return NodeLost(f"run {run_id}: node {nodes} cannot be reached ({why}); whether its work "
                    f"still runs there is unknown. `cluster status {run_id}` looks again; "
                    f"`cluster down {run_id}` stops what it can reach (run it again once "
                    f"{names} answers)")


def outcome(rows: list[NodeStatus]) -> tuple[bool, str]:
    """A finished run's outcome from its nodes' status: whether every node exited 0, and in
    words what each that did not did."""
    failed = [r for r in rows if not (r.state in ("exited", "completed") and r.code == 0)]
    if rows and not failed:
        return True, f"every node exited 0 ({len(rows)} node(s))"
    ends = {r.said() for r in failed}
    if len(rows) > 1 and len(failed) == len(rows) and len(ends) == 1:
        return False, f"every node ({len(rows)}): {ends.pop()}"      # one stop, said once
    return False, "; ".join(f"{r.name}: {r.said()}" for r in failed) or "no node reported"


class Demux:
    """A node's stream: its output bytes with the supervisor's control records among them
    (RS, a JSON object, US). The supervisor doubles every RS byte of the output (its Out),
    so an RS followed by RS is one output byte and only the supervisor can open a record:
    whatever a job prints, `{"final": ...}` or a lone RS included, comes out as its output.
    feed() returns the pieces in order: bytes, or a dict per record; a record, or an RS
    whose next byte has not come yet, is held until it is whole; flush() gives what is held
    at the end of the stream."""

    def __init__(self) -> None:
        self.pending = b""

    def feed(self, data: bytes) -> list[bytes | dict[str, Any]]:
        self.pending += data
        out: list[bytes | dict[str, Any]] = []
        text = b""                       # output bytes not yet handed out
        while True:
            start = self.pending.find(RECORD_START)
            if start < 0 or start + 1 == len(self.pending):     # none, or its next byte to come
                cut = len(self.pending) if start < 0 else start
                text += self.pending[:cut]
                self.pending = self.pending[cut:]
                break
            text += self.pending[:start]
            if self.pending[start + 1:start + 2] == RECORD_START:   # an output RS, doubled
                text += RECORD_START
                self.pending = self.pending[start + 2:]
                continue
            end = self.pending.find(RECORD_END, start)
            if end < 0:
                self.pending = self.pending[start:]
                break
            if text:
                out.append(text)
                text = b""
            out.append(_record(self.pending[start + 1:end]))
            self.pending = self.pending[end + 1:]
        if text:
            out.append(text)
        return out

    def flush(self) -> bytes:
        """What is held when the stream ends (a record cut short): output, as it came."""
        held, self.pending = self.pending, b""
        return held


def _record(body: bytes) -> bytes | dict[str, Any]:
    """A record's JSON object. The supervisor writes nothing else between RS and US; anything
    else there is shown as output, never raised."""
    try:
        record = json.loads(body)
    except ValueError:
        record = None
    return record if isinstance(record, dict) else RECORD_START + body + RECORD_END


def read_answers(data: bytes) -> tuple[list[dict[str, Any]], bytes]:
    """A node program's whole output read the one way (its answers framed as the
    supervisor's records are: remote/options.answer): (its records in order, everything
    else). What a node's shell printed first, a line that is itself a JSON object included,
    is in the second: noise, never an answer."""
    demux = Demux()
    records: list[dict[str, Any]] = []
    noise = b""
    for piece in [*demux.feed(data), demux.flush()]:
        if isinstance(piece, dict):
            records.append(piece)
        else:
            noise += piece
    return records, noise


def read_answer(data: bytes) -> dict[str, Any] | None:
    """A node program's answer: its last record; None when it gave none."""
    records, _ = read_answers(data)
    return records[-1] if records else None
