"""The probe's container facts (remote/containers.py) with a stand-in runtime on PATH: the runtime's
version and the image's id are asked at once (each a process of tens of milliseconds on every
node of a launch), and what each says still lands where it did when they ran one after the
other."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from cluster.remote import containers

# A runtime that answers as docker does, slowly: SLEEP seconds per command.
RUNTIME = """#!/bin/sh
sleep {sleep}
case "$1" in
  --version) {version} ;;
  image) {image} ;;
  manifest) echo '{{"schemaVersion": 2}}' ;;
esac
"""


def runtime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sleep: float = 0.0,
            version: str = "echo 'Docker version 27.0.1, build abc'",
            image: str = "echo sha256:1234") -> str:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    exe = bin_dir / "fakerun"
    exe.write_text(RUNTIME.format(sleep=sleep, version=version, image=image))
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    return "fakerun"


def test_the_version_and_the_image_are_asked_at_once(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    rt = runtime(tmp_path, monkeypatch, sleep=0.8)
    t0 = time.monotonic()
    out = containers.container_facts(rt, "img:1", look_remote=False)
    took = time.monotonic() - t0
    assert out["version"] == "Docker version 27.0.1, build abc"
    assert out["image_id"] == "sha256:1234"
    assert "error" not in out
    assert took < 1.5, f"{took:.2f} s: one after the other would take 1.6 s or more"


def test_a_runtime_that_fails_says_so_and_its_image_question_is_not_waited_for(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The image's question, still running (a child of its own holding its output open), is
    ended with what it started, not waited for."""
    pid_file = tmp_path / "inspect.pid"
    rt = runtime(tmp_path, monkeypatch,
                 version="sleep 0.3; echo 'cannot connect to the daemon' >&2; exit 1",
                 image=f"echo $$ > {pid_file}; sleep 30; echo sha256:late")
    t0 = time.monotonic()
    out = containers.container_facts(rt, "img:1", look_remote=False)
    assert time.monotonic() - t0 < 10
    assert out["error"] == "fakerun: cannot connect to the daemon"
    assert out["version"] is None and out["image_id"] is None
    group = int(pid_file.read_text())
    deadline = time.monotonic() + 5               # SIGKILL is sent; its ending takes a moment
    while alive_in_group(group) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert alive_in_group(group) == []


def alive_in_group(pgid: int) -> list[int]:
    """Processes of process group pgid that are not zombies (an orphan's exit may be collected
    late, by whichever process reaps it)."""
    alive = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            alive.append(int(entry))
    return alive


def test_an_image_not_here_is_looked_for_in_its_registry(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    rt = runtime(tmp_path, monkeypatch,
                 image="echo 'Error: No such image: img:1' >&2; exit 1")
    out = containers.container_facts(rt, "img:1", look_remote=True)
    assert out["version"] == "Docker version 27.0.1, build abc"
    assert out["image_id"] is None and out["pullable"] is True
    assert "error" not in out
    out = containers.container_facts(rt, "img:1", look_remote=False)
    assert "pullable" not in out and "error" not in out


def test_an_image_question_that_fails_otherwise_is_an_error(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    rt = runtime(tmp_path, monkeypatch, image="echo 'permission denied' >&2; exit 125")
    out = containers.container_facts(rt, "img:1", look_remote=False)
    assert out["error"] == "fakerun: permission denied"
