"""What a node reports, in words: how a stop went (cluster status) and a run's outcome
(cluster logs -f)."""
from __future__ import annotations

from cluster.nodes import NodeStatus, end_code, end_detail, node_row, outcome


def test_a_stop_that_ended_within_the_grace_is_not_called_a_kill() -> None:
    """torchrun killed once its workers had saved and exited is a graceful stop, not
    "signal 9"."""
    info = {"state": "stopped", "code": None, "signal": 9, "how": "term", "grace": 30.0,
            "reason": "stop requested"}
    assert end_detail(info) == "SIGTERM: ended within the 30 s grace; stop requested"
    assert "signal" not in end_detail(info) and "SIGKILL" not in end_detail(info)


def test_a_stop_that_needed_sigkill_says_so() -> None:
    info = {"state": "stopped", "signal": 9, "how": "kill", "grace": 5, "reason": None}
    assert end_detail(info) == "SIGTERM, then SIGKILL after the 5 s grace"


def test_an_end_that_was_no_stop_names_its_signal() -> None:
    assert end_detail({"state": "exited", "signal": 9, "how": None}) == "killed by SIGKILL"
    assert end_detail({"state": "exited", "code": 0}) == ""


def test_an_older_supervisors_record_still_reads() -> None:
    """A run folder written before stops were told apart has no `how`."""
    assert end_detail({"state": "stopped", "signal": 15, "reason": "stop requested"}) == \
        "killed by SIGTERM; stop requested"


def test_outcome_every_node_exited_zero() -> None:
    rows = [NodeStatus(0, "a", "exited", code=0), NodeStatus(1, "b", "exited", code=0)]
    assert outcome(rows) == (True, "every node exited 0 (2 node(s))")


def test_outcome_names_each_node_that_did_not_succeed() -> None:
    rows = [NodeStatus(0, "a", "exited", code=0), NodeStatus(1, "b", "exited", code=3),
            NodeStatus(2, "c", "stopped", detail="SIGTERM: ended within the 30 s grace")]
    ok, words = outcome(rows)
    assert not ok
    assert words == "b: exited 3; c: stopped (SIGTERM: ended within the 30 s grace)"


def test_outcome_of_a_scheduler_job_and_of_nothing() -> None:
    assert outcome([NodeStatus(0, "job 7", "completed", code=0)])[0] is True
    assert outcome([NodeStatus(0, "job 7", "failed", code=1)])[0] is False
    assert outcome([]) == (False, "no node reported")


# A stop's record as each node's supervisor writes it, the job's own end under it being a race:
# torchrun unwound in time (exit 1), or was killed once its workers were gone (SIGKILL).
STOPPED = {"state": "stopped", "how": "term", "grace": 30.0, "pgid": 7,
           "reason": "the launcher's connection closed"}


def test_every_node_of_one_stop_gets_the_stops_code_whatever_its_job_did() -> None:
    unwound = node_row(0, "a", {**STOPPED, "code": 1, "signal": None})
    killed = node_row(1, "b", {**STOPPED, "code": None, "signal": 9})
    assert (unwound.code, unwound.detail) == (killed.code, killed.detail) == (
        143, "SIGTERM: ended within the 30 s grace; the launcher's connection closed")
    assert killed.said() == unwound.said() == ("stopped 143 (SIGTERM: ended within the 30 s "
                                               "grace; the launcher's connection closed)")
    assert outcome([unwound, killed]) == (False, f"every node (2): {killed.said()}")


def test_a_stop_past_the_grace_is_137_and_other_ends_keep_their_code() -> None:
    assert end_code({**STOPPED, "how": "kill", "signal": 9}) == 137
    assert end_code({"state": "exited", "code": 3}) == 3
    assert end_code({"state": "exited", "signal": 9}) is None          # said as "killed by SIGKILL"
    # an older supervisor's record (no `how`), a stop before the start (nothing ran): their own
    assert end_code({"state": "stopped", "code": 1, "reason": "stop requested"}) == 1
    assert end_code({"state": "stopped", "code": None, "how": None}) is None
    assert end_code({"state": "running"}) is None
