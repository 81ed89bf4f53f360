"""Failure classes, as data: what ended an attempt, read from the first failure's evidence,
and what the restart loop does about it. Pure: no I/O.

    node         the hardware or the node (a lost node, a failed gate, a GPU's own error, the
                 hang's odd one out): restart without that node (set_aside)
    transient    the store, the rendezvous, the network, a peer that died, a rank that died
                 without a Python error: restart
    program      the program's own error (any other Python exception; CUDA out of memory too):
                 restart once; the same error at the same step as the attempt before: stop
    no_progress  a hang with no node to blame: restart, until attempts make no progress

Each row of PATTERNS was taken from a real error text kept as a test fixture
(tests/unit/failure_texts/<name>.txt, its source's address on its first line), and
tests/unit/test_failure_classes.py fails on a row without one. The first matching row names
the class, so a more telling row comes before a broader one.
"""
from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import STOP_CODE

__all__ = ["PATTERNS", "Pattern", "Verdict", "Decision", "classify", "decide", "match",
           "node_pattern", "normalise"]

NODE, TRANSIENT, PROGRAM, NO_PROGRESS = "node", "transient", "program", "no_progress"
SET_ASIDE, RESTART, STOP = "set_aside", "restart", "stop"


@dataclass(frozen=True)
class Pattern:
    name: str                     # the rule a verdict names, and its fixture's file name
    cls: str
    regex: re.Pattern[str]
    what: str                     # what it means, in the user's words


def row(name: str, cls: str, regex: str, what: str) -> Pattern:
    return Pattern(name, cls, re.compile(regex, re.I), what)


PATTERNS: tuple[Pattern, ...] = (
    # The program's, first: an OOM names the GPU and its memory, never a fault of either.
    row("cuda_oom", PROGRAM, r"CUDA out of memory|OutOfMemoryError|CUDA error: out of memory",
        "the GPU ran out of memory"),
    # The node's: CUDA's, NCCL's and the driver's words for a GPU or its links that failed.
    row("ecc", NODE, r"uncorrectable ECC|\bECC error|cudaErrorECCUncorrectable|"
        r"CUDA_ERROR_ECC_UNCORRECTABLE", "an uncorrectable ECC error"),
    row("unspecified_launch_failure", NODE, r"unspecified launch failure",
        "a CUDA kernel launch failed"),
    row("cuda_unknown_error", NODE, r"CUDA error: unknown error|cudaErrorUnknown",
        "CUDA's unknown error"),
    row("gpu_unavailable", NODE,
        r"CUDA-capable device(\(s\) is/are| is|s are) busy or unavailable|"
        r"cudaErrorDevicesUnavailable", "the GPU is busy or unavailable"),
    row("nccl_cuda_error", NODE, r"unhandled cuda error|ncclUnhandledCudaError",
        "a CUDA call inside NCCL failed"),
    row("nccl_system_error", NODE, r"unhandled system error|ncclSystemError",
        "a system call inside NCCL failed"),
    row("gpu_lost", NODE, r"GPU is lost|GPU lost from the bus", "the GPU is lost"),
    row("fallen_off_bus", NODE, r"fallen off the bus", "the GPU has fallen off the bus"),
    row("nvlink", NODE, r"NVLink", "an NVLink error"),
    row("xid", NODE, r"\bXid\b", "the driver reported an Xid error"),
    # Transient: the store, the rendezvous, a peer or the network between the nodes; NCCL's
    # own words before the socket's that it may quote.
    row("socket_timeout", TRANSIENT, r"Socket Timeout", "the store's socket timed out"),
    row("store_timeout", TRANSIENT,
        r"DistStoreError|Timed out after \d+ seconds waiting for (clients|workers)",
        "the store timed out waiting for the other ranks"),
    row("rendezvous_timeout", TRANSIENT, r"RendezvousTimeoutError",
        "the rendezvous timed out"),
    row("rendezvous_connection", TRANSIENT, r"RendezvousConnectionError|RendezvousClosedError",
        "the connection to the rendezvous failed"),
    row("nccl_remote_error", TRANSIENT,
        r"remote process exited or there was a network error|ncclRemoteError",
        "NCCL lost a remote rank or the network"),
    row("nccl_watchdog", TRANSIENT, r"NCCL communicator was aborted|"
        r"Watchdog caught collective operation timeout", "an NCCL collective timed out"),
    row("connection_reset", TRANSIENT, r"Connection reset by peer",
        "a connection between the nodes was reset"),
    row("connection_closed", TRANSIENT, r"Connection closed by (remote )?peer",
        "a peer closed its connection (a remote rank died)"),
    row("gloo_timeout", TRANSIENT, r"Timed out waiting \d+ms for (recv|send) operation",
        "a gloo collective timed out"),
    row("agent_signal", TRANSIENT, r"SignalException: Process \d+ got signal",
        "torchrun was sent a signal (a preemption, a hangup)"),
)

# cluster's own words (cluster.observe.worker_errors) for a rank that printed no Python
# error: torchrun's report says how it ended, nothing says why.
SILENT_EXIT = re.compile(r"^worker rank \d+ (was killed by \S+|exited with code -?\d+)\Z")

# A rank that exited with the stop code, as cluster's words for it say it (a node's report of
# the death, or torchrun's report of the failed worker).
STOPPED = re.compile(rf"(?:exited with code|died: exit code) {STOP_CODE}\b")

# The rules that are not rows: what classify decides before the table and after it.
MEANING = {"lost": "the connection to the node was lost",
           "gate": "the health gate failed the node",
           "hang_odd_one_out": "the hang's odd one out",
           "hang": "no progress on any node",
           "no_python_error": "a rank died without a Python error",
           "no_error": "a rank ended with no error seen",
           "python_error": "the program raised an error",
           "stop_code": f"a rank exited with {STOP_CODE}, the stop code: the program asked not "
                        f"to be run again",
           **{p.name: p.what for p in PATTERNS}}


@dataclass(frozen=True)
class Verdict:
    cls: str                      # node, transient, program, no_progress
    rule: str                     # a row's name, or one of MEANING's other keys
    evidence: str                 # the text judged (the first failure's cause), or what was seen


@dataclass(frozen=True)
class Decision:
    action: str                   # set_aside, restart, stop
    why: str                      # one plain line for the user


def match(text: str) -> Pattern | None:
    """The first row whose pattern is found in `text`."""
    return next((p for p in PATTERNS if p.regex.search(text)), None)


def node_pattern() -> re.Pattern[str]:
    """Every node row in one pattern: an error that is the hardware's (the ledger's strike)."""
    return re.compile("|".join(f"(?:{p.regex.pattern})" for p in PATTERNS if p.cls == NODE),
                      re.I)


def classify(cause: str | None, lost: bool, hang: bool, gate_failed: bool, *,
             odd_one_out: str | None = None, ended: str = "") -> Verdict:
    """The class of an attempt's end. cause: the first failure's worker's own error (as
    WatchResult.causes has it); lost: that node's connection broke; hang: the watchdog
    stopped the run; gate_failed: the health gate failed the node; odd_one_out: the hang's
    odd one out, when the caller found one ("node3: where its ranks were"); ended: how the
    node said its first rank ended ("rank 1 (pid 7) died: exit code 93")."""
    for said in (ended, cause or ""):
        if STOPPED.search(said):
            return Verdict(PROGRAM, "stop_code", said)
    if lost:
        return Verdict(NODE, "lost", cause or MEANING["lost"])
    if gate_failed:
        return Verdict(NODE, "gate", cause or MEANING["gate"])
    if hang:
        if odd_one_out:
            return Verdict(NODE, "hang_odd_one_out", odd_one_out)
        return Verdict(NO_PROGRESS, "hang", cause or MEANING["hang"])
    if not cause:
        return Verdict(TRANSIENT, "no_error", MEANING["no_error"])
    if SILENT_EXIT.match(cause):
        return Verdict(TRANSIENT, "no_python_error", cause)
    found = match(cause)
    if found is not None:
        return Verdict(found.cls, found.name, cause)
    return Verdict(PROGRAM, "python_error", cause)


def decide(history: Sequence[Mapping[str, Any]], verdict: Verdict, *, step: int | None,
           progress_attempts: int = 3) -> Decision:
    """What the restart loop does after an attempt that ended as `verdict` at training step
    `step` (None: not known). history: the attempts BEFORE this one, oldest first, as
    launch.py records them ("cause", and "step" where known); not this attempt's record."""
    said = f"{MEANING.get(verdict.rule, verdict.rule)}{_quoted(verdict)}"
    if verdict.rule == "stop_code":
        return Decision(STOP, said)
    if verdict.cls == NODE:
        return Decision(SET_ASIDE, f"{said}: restarting without that node")
    if verdict.cls == TRANSIENT:
        return Decision(RESTART, f"{said}: transient, restarting")
    if verdict.cls == NO_PROGRESS:
        stuck = _no_progress(history, step, progress_attempts)
        return (Decision(STOP, stuck) if stuck
                else Decision(RESTART, f"{said}: restarting"))
    twice = _same_failure(history, verdict, step)
    if twice:
        return Decision(STOP, f"the program failed the same way twice ({twice}); "
                              f"a restart would fail again")
    return Decision(RESTART, f"{said}: restarting; the same error twice in a row (at the "
                             f"same step, where steps are known) stops the job")


def _same_failure(history: Sequence[Mapping[str, Any]], verdict: Verdict,
                  step: int | None) -> str | None:
    """The error and where, when the attempt before failed with the same text (numbers and
    addresses masked), at the same step where both steps are known; else None."""
    if not history or not history[-1].get("cause"):
        return None
    before = history[-1]
    if normalise(str(before["cause"])) != normalise(verdict.evidence):
        return None
    step_before = before.get("step")
    if step is not None and step_before is not None:
        if step != step_before:
            return None
        return f"{_short(verdict.evidence)}, at step {step} both times"
    return _short(verdict.evidence)


def _no_progress(history: Sequence[Mapping[str, Any]], step: int | None,
                 attempts: int) -> str | None:
    """Why the job stops for want of progress: the last `attempts` attempts (this one
    included) all reached a known step, and none got beyond the step the first of them
    reached. None while steps are not known or progress was made."""
    steps = [h.get("step") for h in history] + [step]
    window = steps[-attempts:]
    if attempts < 2 or len(window) < attempts or any(s is None for s in window):
        return None
    first, *later = [int(s) for s in window if s is not None]
    if any(s > first for s in later):
        return None
    return (f"no progress: {attempts} attempts in a row got no further than step {first}; "
            f"a restart would hang again")


# Numbers and addresses change between two runs of one failure; the words do not.
MASKS = (
    (re.compile(r"\b[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}\b", re.I), "<uuid>"),
    (re.compile(r"\b0x[0-9a-f]+\b", re.I), "0x#"),
    (re.compile(r"\d+"), "#"),
    (re.compile(r"\s+"), " "),
)


def normalise(text: str) -> str:
    """An error's text with its numbers and addresses masked, to compare two failures."""
    for pattern, mask in MASKS:
        text = pattern.sub(mask, text)
    return text.strip()


def _quoted(verdict: Verdict) -> str:
    """' (its evidence)' where the evidence says more than the rule's meaning."""
    if verdict.evidence == MEANING.get(verdict.rule):
        return ""
    return f" ({_short(verdict.evidence)})"


def _short(text: str, limit: int = 160) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[:limit - 3] + "..."
