"""--hang-timeout auto on a fake clock: heartbeats in (a node, a time), the timeout out. The
start-up allowance until the pace is known, then a multiple of the interval between beats
within the floor and the cap; a gradual slowdown never fires; a hang after steady beats does,
on time; the one line is said only when the timeout changed materially. Then the same through
the Watcher, and the setting through the CLI, the Python API and the inventory."""
from __future__ import annotations

import threading
from pathlib import Path

import pytest

from cluster import api, inventory
from cluster.cli import run_cli
from cluster.errors import InputError, InventoryError
from cluster.observe.hang_timeout import FORGET_S, MIN_SAMPLES, FixedTimeout, LearnedTimeout, timeout_of
from cluster.spec import HangAuto
from tests.unit.test_restarts import prepared_options
from tests.unit.test_watch import console
from tests.unit.test_watchdog import FakeClock, QuietNode

DEFAULTS = HangAuto()


def learned(settings: HangAuto = DEFAULTS) -> tuple[LearnedTimeout, list[str]]:
    said: list[str] = []
    return LearnedTimeout(settings, said.append), said


def beat_every(t: LearnedTimeout, interval: float, start: float, until: float,
               node: str = "a 0") -> float:
    """Beats of one node from `start` every `interval` up to `until`; the last one's time."""
    now = start
    while now <= until + 1e-9:
        t.beat(node, now)
        last, now = now, now + interval
    return last


def silence_fires(t: LearnedTimeout, quiet: float) -> bool:
    """Would the watchdog fire after `quiet` seconds without progress (the Watcher's test)?"""
    return quiet >= t.seconds()


def test_the_start_up_allowance_holds_until_the_pace_is_known() -> None:
    t, said = learned()
    assert t.seconds() == DEFAULTS.startup == 1200 and t.learning()
    t.beat("a 0", 0.0)                      # the trainer's first beat, as it starts
    t.beat("a 0", 600.0)                    # after ten minutes of set-up: not a sample
    assert t.seconds() == 1200 and t.learning()
    for i in range(1, MIN_SAMPLES):
        t.beat("a 0", 600.0 + 4.2 * i)
        assert t.seconds() == 1200, "learned from too few intervals"
    t.beat("a 0", 600.0 + 4.2 * MIN_SAMPLES)
    assert not t.learning() and t.seconds() == pytest.approx(42)
    assert said == ["hang timeout now 42 s: 10x the 4.2 s between heartbeats"]
    assert t.why() == "--hang-timeout auto: 10x the 4.2 s between heartbeats"


def test_a_silent_start_gets_the_start_up_allowance_then_fires() -> None:
    t, _ = learned(HangAuto(startup=300))
    assert not silence_fires(t, 299.9) and silence_fires(t, 300)
    assert "start-up allowance" in t.why()


def test_the_floor_and_the_cap() -> None:
    fast, said = learned()
    beat_every(fast, 0.5, 0.0, 12.0)
    assert fast.seconds() == DEFAULTS.floor == 30
    assert said == ["hang timeout now 30 s: the floor (hang_auto.floor; 10x the 0.5 s between "
                    "heartbeats is less)"]
    slow, said = learned()
    beat_every(slow, 600.0, 0.0, 6000.0)
    assert slow.seconds() == DEFAULTS.cap == 1800
    assert said == ["hang timeout now 1800 s: the cap (hang_auto.cap; 10x the 600.0 s between "
                    "heartbeats is more)"]


def test_a_job_that_beats_faster_than_the_reports_is_said_at_its_own_pace() -> None:
    """A node reports one beat a second at most: a job beating 3 times a second shows 1 s
    between reports. The timeout rests on those (the watchdog sees nothing finer), but the
    line says the job's own pace, which each report carries, not the reporting cap as it."""
    t, said = learned()
    for i in range(13):
        t.beat("a 0", float(i), pace=None if i < 2 else 1 / 3)
    assert t.seconds() == DEFAULTS.floor
    assert said == ["hang timeout now 30 s: the floor (hang_auto.floor; 10x the 1.0 s between "
                    "reported heartbeats (the job beats every 0.33 s; a node reports one a second "
                    "at most) is less)"]
    slow, said = learned(HangAuto(floor=5))
    for i in range(13):                               # a pace the reports show as it is
        slow.beat("a 0", 4.2 * i, pace=4.2)
    assert said == ["hang timeout now 42 s: 10x the 4.2 s between heartbeats"]


def test_a_hang_after_steady_beats_is_detected_at_the_right_time() -> None:
    """The issue's case: beats every half second for 12 s, then nothing. The node's supervisor
    reports a beat at most once a second, so the launcher sees 1 s intervals."""
    t, _ = learned()
    beat_every(t, 1.0, 0.0, 12.0)
    assert t.seconds() == 30
    assert not silence_fires(t, 29.9)
    assert silence_fires(t, 30.0)      # 30 s after the last beat: well within 60


def test_a_gradual_slowdown_is_never_stopped() -> None:
    """Each interval 5% longer than the one before, from 1 s to ten minutes: every silence
    before a beat is shorter than the timeout learned from the beats before it."""
    t, said = learned()
    now, interval = 0.0, 1.0
    t.beat("a 0", now)
    while interval < 600:
        assert not silence_fires(t, interval), f"stopped at a {interval:.1f} s step"
        now += interval
        t.beat("a 0", now)
        interval *= 1.05
    assert t.seconds() == DEFAULTS.cap
    assert 5 < len(said) < 20, "said on every beat, or not as it changed"


def test_one_fast_step_does_not_lower_it_and_one_slow_step_raises_it() -> None:
    t, _ = learned()
    now = beat_every(t, 5.0, 0.0, 100.0)
    assert t.seconds() == pytest.approx(50)
    t.beat("a 0", now + 0.5)                               # one fast step
    assert t.seconds() == pytest.approx(50, rel=0.01)
    t.beat("a 0", now + 0.5 + 20.0)                        # one slow step: more patient
    assert t.seconds() == pytest.approx(200)


def test_a_long_pause_is_forgotten_slowly() -> None:
    """A checkpoint of two minutes among 5 s steps: the next one, half an hour later, still
    finds a timeout longer than itself; hours later the timeout is back near the steps'."""
    t, _ = learned()
    now = beat_every(t, 5.0, 0.0, 100.0)
    now += 120.0
    t.beat("a 0", now)
    now = beat_every(t, 5.0, now + 5.0, now + FORGET_S)
    assert t.seconds() > 120
    now = beat_every(t, 5.0, now + 5.0, now + 6 * FORGET_S)
    assert t.seconds() == pytest.approx(50, rel=0.1)


def test_intervals_are_per_node_not_between_any_two_beats() -> None:
    """Two nodes beating every 4 s, half a period apart: a beat every 2 s in all, 4 s each."""
    t, _ = learned()
    for i in range(10):
        t.beat("a 0", 4.0 * i)
        t.beat("b 1", 4.0 * i + 2.0)
    assert t.seconds() == pytest.approx(40)


def test_the_line_is_said_only_on_a_material_change() -> None:
    t, said = learned()
    now = 0.0
    for i in range(200):                                   # 4.0 to 4.4 s: jitter, no change
        now += 4.0 + 0.4 * ((i * 7) % 5) / 4
        t.beat("a 0", now)
    assert len(said) == 1 and said[0].startswith("hang timeout now 4")
    now = beat_every(t, 12.0, now + 12.0, now + 120.0)    # three times slower: said once more
    assert len(said) == 2 and said[1] == "hang timeout now 120 s: 10x the 12.0 s between heartbeats"


def test_a_fixed_timeout_is_a_number() -> None:
    assert isinstance(timeout_of(45.0), FixedTimeout) and timeout_of(45.0).seconds() == 45
    assert timeout_of(0.0).seconds() == 0
    assert isinstance(timeout_of("auto", HangAuto(floor=5)), LearnedTimeout)


# --- through the Watcher --------------------------------------------------------------------


def test_the_watcher_stops_a_job_that_hangs_after_steady_beats() -> None:
    """Beats every second for 12 s, then silence: the learned 10 s (floor 5) fires 10 s after
    the last beat, not before; the learned value was said once, on the console."""
    from cluster.observe.watch import Watcher
    clock, node = FakeClock(), QuietNode("a 0")
    c, _, err = console()
    timeout = LearnedTimeout(HangAuto(startup=100, multiple=10, floor=5, cap=50), c.info)
    watcher = Watcher([node], c, {}, settle=5, hang_timeout=timeout, clock=clock, poll=0.01)
    results: list = []
    thread = threading.Thread(target=lambda: results.append(watcher.run()), daemon=True)
    thread.start()
    for second in range(13):
        clock.set(float(second))
        node.say({"beat": float(second), "pace": 0.333})
    clock.set(12.0 + 9.9)
    clock.looked(thread)
    assert not node.stacks_asked.is_set() and thread.is_alive(), "fired before the timeout"
    clock.set(12.0 + 10.0)
    thread.join(10)
    assert node.stacks_asked.is_set() and results[0].hang is not None
    assert results[0].hang.seconds == pytest.approx(10)
    said = err.getvalue()
    assert said.count("hang timeout now") == 1, said
    assert ("hang timeout now 10 s: 10x the 1.0 s between reported heartbeats (the job beats "
            "every 0.33 s; a node reports one a second at most)") in said
    assert "(--hang-timeout auto: 10x the 1.0 s between reported heartbeats (the job" in said


# --- the setting: CLI, Python API, inventory -------------------------------------------------


def inv_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "inv.yaml"
    path.write_text(text + "hosts: [{name: a, address: 10.0.0.1}]\n")
    return path


def test_auto_reaches_the_launch_from_the_inventory_and_the_api(tmp_path: Path) -> None:
    path = inv_file(tmp_path, "hang_timeout: auto\nhang_auto: {floor: 10, multiple: 4}\n")
    options = prepared_options(path)
    assert options.hang_timeout == "auto"
    assert options.hang_auto == HangAuto(startup=1200, multiple=4, floor=10, cap=1800)
    assert prepared_options(inv_file(tmp_path, ""), hang_timeout="auto").hang_timeout == "auto"
    assert prepared_options(path, hang_timeout=20.0).hang_timeout == 20.0


@pytest.mark.parametrize("value", ["soon", -1, float("nan"), True])
def test_the_api_refuses_a_garbage_hang_timeout(tmp_path: Path, value: object) -> None:
    with pytest.raises(InputError, match="--hang-timeout"):
        prepared_options(inv_file(tmp_path, ""), hang_timeout=value)


def test_the_cli_takes_auto_and_refuses_garbage(tmp_path: Path, capsys) -> None:
    path = inv_file(tmp_path, "")
    assert run_cli(["up", "-i", str(path), "--hang-timeout", "auto", "--dry-run", "--", "t.py"]) == 0
    capsys.readouterr()
    assert run_cli(["up", "-i", str(path), "--hang-timeout", "soon", "--dry-run", "--", "t.py"]) == 2
    err = capsys.readouterr().err
    assert "--hang-timeout" in err and "'soon' is not 'auto' or a number of seconds >= 0" in err


@pytest.mark.parametrize("text, line, key, words", [
    ("hang_timeout: soon\n", 1, "hang_timeout", "must be 'auto' or a positive number of seconds"),
    ("hang_timeout: -3\n", 1, "hang_timeout", "must be 'auto' or a positive number of seconds"),
    ("restarts: 1\nhang_auto: {floor: 0}\n", 2, "floor", "positive number of seconds"),
    ("hang_auto:\n  multiple: 0.5\n", 2, "multiple", "must be a number >= 1"),
    ("hang_auto:\n  startup: 60\n  floor: 90\n  cap: 60\n", 3, "floor", "above the cap"),
    ("hang_auto: {flor: 10}\n", 1, "flor", "did you mean 'floor'"),
])
def test_the_inventory_refuses_garbage_with_file_line_and_key(tmp_path: Path, text: str, line: int,
                                                              key: str, words: str) -> None:
    path = inv_file(tmp_path, text)
    with pytest.raises(InventoryError) as info:
        inventory.load(path)
    msg = str(info.value)
    assert msg.startswith(f"{path}:{line}: {key}:"), msg
    assert words in msg, msg


def test_a_section_gets_the_start_up_allowance_and_its_length_is_not_the_pace() -> None:
    """A checkpoint written for 5 minutes by a job that steps every second: the learned 30 s
    would stop it; in its section the timeout is the start-up allowance, and after it the
    learned value is back, unchanged by the pause."""
    t, said = learned()
    last = beat_every(t, 1.0, 0.0, 60.0)
    assert t.seconds() == DEFAULTS.floor
    t.beat("a 0", last + 1.0, section="checkpoint")
    assert t.seconds() == DEFAULTS.startup and "[a 0] is in its checkpoint section" in t.why()
    assert not silence_fires(t, 300.0)
    t.beat("a 0", last + 301.0)                 # the section ends: a plain beat
    assert t.seconds() == DEFAULTS.floor and t.interval < 2.0
    beat_every(t, 1.0, last + 302.0, last + 310.0)
    assert t.seconds() == DEFAULTS.floor and silence_fires(t, 31.0)
    assert all("300" not in line for line in said)


def test_a_section_that_hangs_is_still_stopped_and_one_node_in_it_is_enough() -> None:
    t, _ = learned()
    beat_every(t, 1.0, 0.0, 60.0, node="a 0")
    beat_every(t, 1.0, 0.0, 60.0, node="b 1")
    t.beat("b 1", 61.0, section="checkpoint")
    t.beat("a 0", 61.5)                         # another node beating changes nothing
    assert t.seconds() == DEFAULTS.startup
    assert silence_fires(t, DEFAULTS.startup + 1) and not silence_fires(t, DEFAULTS.startup - 1)


def test_a_fixed_timeout_ignores_sections() -> None:
    t = FixedTimeout(12.0)
    t.beat("a 0", 1.0, section="checkpoint")
    assert t.seconds() == 12.0
