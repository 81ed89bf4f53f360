"""The hang watchdog's evidence read from stacks as faulthandler and py-spy print them."""
from __future__ import annotations

from cluster.observe.hang import Group, last_lines, main_thread, summary, where

FAULTHANDLER = """Thread 0x00007f1 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 320 in wait
  File "/usr/lib/python3.11/threading.py", line 1002 in run

Current thread 0x00007f0 (most recent call first):
  File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 2501 in all_reduce
  File "/work/train.py", line 212 in step
  File "/work/train.py", line 300 in main
"""

PY_SPY = """Thread 4242 (idle): "pt_elastic"
    wait (threading.py:320)
Thread 4241 (active): "MainThread"
    __next__ (data.py:88)
    epoch (train.py:150)
    main (train.py:300)
"""


def stacks(*texts_by_node):
    out = {}
    for rank, (node, text) in enumerate(texts_by_node):
        out.setdefault(f"{node} {rank}", []).append({"rank": rank, "text": text})
    return out


def test_the_main_thread_is_read_from_either_format() -> None:
    assert [f.func for f in main_thread(FAULTHANDLER)] == ["all_reduce", "step", "main"]
    assert [f.func for f in main_thread(PY_SPY)] == ["__next__", "epoch", "main"]


def test_where_names_the_wait_and_the_users_line_that_made_it() -> None:
    assert where(main_thread(FAULTHANDLER)) == "all_reduce in train.py:212 (step)"
    assert where(main_thread(PY_SPY)) == "__next__ in data.py:88"
    assert where([]).startswith("no Python stack")


def test_a_group_shows_its_ranks_as_ranges() -> None:
    def text(*ranks: int) -> str:
        return Group("wait", ranks, ("gpu1",)).text()
    assert text(0, 1, 2, 5, 7, 8) == "ranks 0-2,5,7-8 (gpu1): wait"
    assert text(3) == "rank 3 (gpu1): wait"
    assert text(4, 6) == "ranks 4,6 (gpu1): wait"


def test_the_summary_groups_ranks_and_names_the_odd_one() -> None:
    found = stacks(("gpu1", FAULTHANDLER), ("gpu1", FAULTHANDLER), ("gpu2", FAULTHANDLER),
                   ("gpu2", PY_SPY))
    lines = summary(found)
    assert lines[0] == "ranks 0-2 (gpu[1-2]): all_reduce in train.py:212 (step)"
    assert lines[-1] == "odd one(s) out: rank 3 (gpu2): __next__ in data.py:88"
    assert summary({}) == ["no stacks came back from any node"]


def test_last_lines_have_a_section_per_node() -> None:
    text = last_lines({"node2 1": ["b1", "b2"], "node1 0": ["a1"]})
    assert text.index("== node1 0: its last 1 line(s)\na1\n") < text.index("== node2 1: its last 2 line(s)\nb1\nb2\n")
    assert last_lines({}) == ""
