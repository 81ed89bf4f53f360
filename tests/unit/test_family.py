"""cluster/remote/family.py: a process's family is its descendants outside its own session
(its helpers share its session; a run never can)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "cluster" / "remote"))
import family  # noqa: E402


def test_family_is_the_descendants_outside_the_own_session() -> None:
    me = os.getpid()
    helper = subprocess.Popen(["sleep", "30"])                       # this session: a helper
    run = subprocess.Popen(["bash", "-c", "sleep 30 & wait"], start_new_session=True)
    grandchild = None
    try:
        for _ in range(200):
            kids = [p for p, st in family.table().items() if st[1] == run.pid]
            if kids:
                grandchild = kids[0]
                break
            subprocess.run(["sleep", "0.01"])
        assert grandchild is not None
        found = family.members(me)
        assert run.pid in found and grandchild in found
        assert helper.pid not in found
        assert family.belongs(grandchild, me) and not family.belongs(helper.pid, me)
        assert not family.belongs(me, me) and not family.belongs(1, me)
    finally:
        if grandchild is not None and family.alive(grandchild):
            os.kill(grandchild, 9)
        for p in (helper, run):
            p.kill()
            p.wait()


def test_start_time_names_a_process_once() -> None:
    p = subprocess.Popen(["sleep", "30"])
    try:
        born = family.start_time(p.pid)
        assert born is not None and born >= family.start_time(os.getpid())
    finally:
        p.kill()
        p.wait()
    assert family.start_time(p.pid) is None


def test_send_checks_with_the_handle_held() -> None:
    p = subprocess.Popen(["sleep", "30"])
    try:
        assert family.send(p.pid, 15, lambda: False) is False
        assert p.poll() is None, "a process that was not ours was signalled"
        assert family.send(p.pid, 15, lambda: True) is True
        assert p.wait(timeout=5) == -15
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_the_family_walked_down_the_kernels_child_lists_is_the_tables() -> None:
    """descendants(): the same family as the whole process table gives, read from the
    kernel's child lists (the run's own processes, not every process there)."""
    me = os.getpid()
    run = subprocess.Popen(["bash", "-c", "(sleep 30 & sleep 30 & wait) & sleep 30 & wait"],
                           start_new_session=True)
    try:
        for _ in range(300):
            if len(family.members(me)) >= 5:
                break
            subprocess.run(["sleep", "0.01"])
        procs = family.descendants(me)
        assert procs is not None, "this kernel keeps no child lists (CONFIG_PROC_CHILDREN)"
        assert family.members(me, procs) == family.members(me)
        assert len(family.members(me, procs)) >= 5
        assert set(procs) <= set(family.table())
        assert family.children(run.pid) and set(family.children(run.pid)) <= set(procs)
    finally:
        os.killpg(run.pid, 9)
        run.wait()


def test_a_process_is_the_subreaper_only_once_it_made_itself_one() -> None:
    code = ("import sys; sys.path.insert(0, %r); import family, os; "
            "before = family.is_subreaper(os.getpid()); ok = family.become_subreaper(); "
            "print(before, ok, family.is_subreaper(os.getpid()), family.is_subreaper(1))"
            % str(Path(family.__file__).parent))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.split()
    assert out == ["False", "True", "True", "False"]
