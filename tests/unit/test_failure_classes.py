"""The failure classes (cluster.recovery.classes), by table: every real error text kept in
tests/unit/failure_texts/ is classed as its header says, every row of the table has one;
classify's special cases; decide's cases on plain attempt records."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from cluster.observe.worker_errors import WorkerErrors
from cluster.recovery.classes import (PATTERNS, Verdict, classify, decide, node_pattern,
                                      normalise)
from cluster.recovery.pool import HARDWARE_ERRORS
from tests.unit.test_layers import ROOT, imports

TEXTS = Path(__file__).parent / "failure_texts"
TORCHRUN = Path(__file__).parent / "torchrun_failures"
CLASSES = {"node", "transient", "program"}


def texts() -> list[Path]:
    return sorted(TEXTS.glob("*.txt"))


def rule_of(path: Path) -> str:
    """'ecc.2.txt' -> 'ecc': a fixture is named for the row it was taken from."""
    return path.name.split(".")[0]


def read(path: Path) -> tuple[dict[str, str], list[str]]:
    """The header ('# from: URL', '# class: node') and the text as it was printed."""
    header, lines = {}, path.read_text().splitlines()
    while lines and lines[0].startswith("# "):
        key, _, value = lines.pop(0)[2:].partition(": ")
        header[key] = value.strip()
    return header, lines


def cause_of(lines: list[str]) -> str:
    """What the watcher names as the cause: the worker's own error line, read as the watcher
    reads a node's output; for a text with no traceback (a kernel log, nvidia-smi, a
    one-line excerpt), the text itself."""
    return watcher_cause(lines) or "\n".join(lines)


# An excerpt that starts inside a traceback: its frames are indented (after torch's prefix).
TAIL = re.compile(r"^(\[rank\d+\]: )?\s+\S")


def watcher_cause(lines: list[str]) -> str | None:
    """The cause as cluster.observe.worker_errors reads it; an excerpt cut below its
    traceback's first line gets that line back, as the node printed it."""
    errors = WorkerErrors()
    cut = TAIL.match(lines[0]) if lines else None
    if cut:
        errors.feed(f"{cut.group(1) or ''}Traceback (most recent call last):")
    for line in lines:
        errors.feed(line)
    return errors.cause()


def judged(cause: str | None, lost: bool = False, hang: bool = False, gate: bool = False,
           odd: str | None = None) -> Verdict:
    return classify(cause, lost, hang, gate, odd_one_out=odd)


@pytest.mark.parametrize("path", texts(), ids=lambda p: p.name)
def test_each_real_text_is_classed_as_its_fixture_says(path: Path) -> None:
    header, lines = read(path)
    assert header.get("from", "").startswith("https://"), f"{path.name}: no '# from: URL' line"
    assert header.get("class") in CLASSES, f"{path.name}: no '# class: CLASS' line"
    verdict = judged(cause_of(lines))
    assert (verdict.cls, verdict.rule) == (header["class"], rule_of(path))


def test_every_row_has_a_real_text_and_every_text_a_rule() -> None:
    names = [p.name for p in PATTERNS]
    assert len(names) == len(set(names))
    have = {rule_of(p) for p in texts()}
    assert [n for n in names if n not in have] == []
    assert have - set(names) == {"python_error"}       # the fallback: any other Python error


def test_a_traceback_is_read_to_its_error_line() -> None:
    """Where a fixture keeps a traceback (or its tail), the watcher's reading names one line,
    and the pattern matched that line, not the text around it."""
    read_by_watcher = 0
    for path in texts():
        lines = read(path)[1]
        cause = watcher_cause(lines)
        if cause is None or len(lines) == 1:
            continue
        read_by_watcher += 1
        assert "\n" not in cause and judged(cause).rule == rule_of(path), (path.name, cause)
    assert read_by_watcher >= 10


def test_the_ledgers_hardware_errors_are_the_node_rows() -> None:
    """pool.HARDWARE_ERRORS (a strike in the ledger) says node exactly where classify does,
    on every real text."""
    assert HARDWARE_ERRORS.pattern == node_pattern().pattern
    for path in texts():
        header, lines = read(path)
        assert bool(HARDWARE_ERRORS.search(cause_of(lines))) == (header["class"] == "node"), \
            path.name


@pytest.mark.parametrize("log, expected", [
    ("runtime_error.log", ("program", "python_error")),
    ("import_error.log", ("program", "python_error")),
    ("missing_script.log", ("program", "python_error")),
    ("worker_exit_code.log", ("transient", "no_python_error")),
])
def test_torchruns_own_outputs_through_the_watchers_reading(log: str, expected: tuple) -> None:
    """This project's recorded torchrun outputs: a worker's exception is the program's; a
    rank that exited with a code and no Python error restarts."""
    lines = (TORCHRUN / log).read_text().splitlines()
    errors = WorkerErrors()
    for line in lines:
        errors.feed(line)
    verdict = judged(errors.cause())
    assert (verdict.cls, verdict.rule) == expected


ECC = "RuntimeError: CUDA error: uncorrectable ECC error encountered"


@pytest.mark.parametrize("case, verdict", [
    (judged(None, lost=True), ("node", "lost", "the connection to the node was lost")),
    (judged("RuntimeError: boom", lost=True), ("node", "lost", "RuntimeError: boom")),
    (judged(None, gate=True), ("node", "gate", "the health gate failed the node")),
    (judged(None, hang=True, odd="node3: ranks 8-11 in all_reduce"),
     ("node", "hang_odd_one_out", "node3: ranks 8-11 in all_reduce")),
    (judged(None, hang=True), ("no_progress", "hang", "no progress on any node")),
    (judged(None), ("transient", "no_error", "a rank ended with no error seen")),
    (judged(""), ("transient", "no_error", "a rank ended with no error seen")),
    (judged("worker rank 3 was killed by SIGKILL"),
     ("transient", "no_python_error", "worker rank 3 was killed by SIGKILL")),
    (judged("worker rank 1 exited with code 7"),
     ("transient", "no_python_error", "worker rank 1 exited with code 7")),
    (judged("ZeroDivisionError: division by zero"),
     ("program", "python_error", "ZeroDivisionError: division by zero")),
    (judged(ECC), ("node", "ecc", ECC)),
    (judged(ECC, hang=True), ("no_progress", "hang", ECC)),       # the hang decides first
    (judged("ValueError: the Xid column is missing"), ("node", "xid",
                                                       "ValueError: the Xid column is missing")),
], ids=lambda x: x.rule if isinstance(x, Verdict) else "")
def test_classify_special_cases(case: Verdict, verdict: tuple) -> None:
    assert (case.cls, case.rule, case.evidence) == verdict


PROGRAM = judged("RuntimeError: boom: the loss is NaN at step 1200")


def attempt(cause: str | None = None, step: int | None = None, n: int = 0) -> dict:
    """One attempt's record, as launch.py keeps it ("step" where known)."""
    return {"attempt": n, "nodes": ["a", "b"], "ended": "node [b 1] failed: exit code 1",
            **({"cause": cause} if cause else {}), **({"step": step} if step is not None else {})}


@pytest.mark.parametrize("history, verdict, step, action, why", [
    # the program: the same error at the same step as the attempt before stops the job
    ([attempt(PROGRAM.evidence, 1200)], PROGRAM, 1200, "stop",
     "the program failed the same way twice (RuntimeError: boom: the loss is NaN at step "
     "1200, at step 1200 both times); a restart would fail again"),
    ([attempt(PROGRAM.evidence, 800)], PROGRAM, 1200, "restart", "the program raised"),
    ([attempt(PROGRAM.evidence)], PROGRAM, None, "stop", "the program failed the same way"),
    ([attempt(PROGRAM.evidence)], PROGRAM, 1200, "stop", "the program failed the same way"),
    ([attempt("RuntimeError: boom: the loss is NaN at step 7", 7)],
     judged("RuntimeError: boom: the loss is NaN at step 9"), None, "stop", "the program failed"),
    ([attempt("KeyError: 'x'", 1200)], PROGRAM, 1200, "restart", "the program raised"),
    ([], PROGRAM, 1200, "restart", "the program raised an error (RuntimeError: boom: the loss "
     "is NaN at step 1200): restarting; the same error twice in a row (at the same step, "
     "where steps are known) stops the job"),
    ([attempt(PROGRAM.evidence, 1200), attempt(None, 1200)], PROGRAM, 1200, "restart", ""),
    # transient, node
    ([attempt(PROGRAM.evidence, 1200)], judged("RuntimeError: Socket Timeout"), 1200,
     "restart", "the store's socket timed out (RuntimeError: Socket Timeout): transient, "
                "restarting"),
    ([], judged(None), None, "restart", "a rank ended with no error seen: transient, restarting"),
    ([], judged(ECC), 5, "set_aside", f"an uncorrectable ECC error ({ECC}): restarting "
                                      f"without that node"),
    ([], judged(None, lost=True), None, "set_aside",
     "the connection to the node was lost: restarting without that node"),
    # no progress: 3 attempts that got no further than the first of them stop
    ([attempt(step=5000), attempt(step=5000)], judged(None, hang=True), 5000, "stop",
     "no progress: 3 attempts in a row got no further than step 5000; a restart would hang "
     "again"),
    ([attempt(step=5000), attempt(step=4990)], judged(None, hang=True), 5000, "stop", "no "),
    ([attempt(step=4000), attempt(step=5000)], judged(None, hang=True), 5000, "restart",
     "no progress on any node: restarting"),
    ([attempt(step=5000)], judged(None, hang=True), 5000, "restart", "no progress on any"),
    ([attempt(), attempt()], judged(None, hang=True), 5000, "restart", "no progress on any"),
    ([attempt(step=5000), attempt(step=5000)], judged(None, hang=True), None, "restart", ""),
])
def test_decide(history: list, verdict: Verdict, step: int | None, action: str,
                why: str) -> None:
    decision = decide(history, verdict, step=step)
    assert decision.action == action and decision.why.startswith(why), decision
    assert "\n" not in decision.why


def test_no_progress_counts_the_attempts_asked_for() -> None:
    hang = judged(None, hang=True)
    two = [attempt(step=10)]
    assert decide(two, hang, step=10, progress_attempts=2).action == "stop"
    assert decide(two, hang, step=10, progress_attempts=3).action == "restart"
    assert decide([], hang, step=10, progress_attempts=1).action == "restart"


def test_a_long_error_is_cut_in_the_why() -> None:
    long = judged("RuntimeError: " + "x" * 400)
    assert len(decide([], long, step=None).why) < 300


@pytest.mark.parametrize("a, b", [
    ("RuntimeError: NaN at step 3", "RuntimeError: NaN at step 17"),
    ("segfault at 0x7fe222fa3193 in libc10.so", "segfault at 0x7f00aa in libc10.so"),
    ("GPU-0b6b7808-c002-f593-ac86-cd8e57757b94 failed", "GPU-11111111-2222-3333-4444-"
                                                          "555555555555 failed"),
    ("Read error [10.1.3.122]:42916: reset", "Read error [10.1.3.7]:1: reset"),
    ("a  b\tc", "a b c"),
])
def test_normalise_masks_numbers_and_addresses(a: str, b: str) -> None:
    assert normalise(a) == normalise(b)


def test_normalise_keeps_the_words() -> None:
    assert normalise("KeyError: 'x'") != normalise("KeyError: 'y'")


def test_the_module_imports_nothing_of_cluster_but_errors() -> None:
    found = {name for name, _ in imports(ROOT / "recovery" / "classes.py")}
    assert found <= {"cluster.errors"}


@pytest.mark.parametrize("cause, ended", [
    ("worker rank 1 exited with code 93", ""),                    # torchrun's report
    (None, "rank 1 (pid 4242) died: exit code 93"),               # the node's, at once
])
def test_the_stop_code_stops_the_job_whatever_restarts_are_left(cause, ended) -> None:
    verdict = classify(cause, lost=False, hang=False, gate_failed=False, ended=ended)
    assert (verdict.cls, verdict.rule) == ("program", "stop_code")
    decision = decide([], verdict, step=None)
    assert decision.action == "stop" and "a rank exited with 93, the stop code" in decision.why


def test_an_exit_code_that_only_begins_with_93_is_no_stop_code() -> None:
    verdict = classify("worker rank 1 exited with code 930", lost=False, hang=False,
                       gate_failed=False, ended="rank 1 (pid 7) died: exit code 930")
    assert verdict.rule == "no_python_error"
