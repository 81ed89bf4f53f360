"""backends/shipping.py, the one way onto a node, run for real through its bootloader: a
launch's check (the probe's facts), then either the end of the input or the start (files
written privately under a temporary name, renamed, then the supervisor runs in the same process
with the rest of the input); and the node-side programs it carries."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

from cluster.backends.shipping import BOOT, boot_command, bundle, file, program
from cluster.nodes import read_answer, read_answers

# Stands in for supervisor.py: says how it was called and what input was left for it.
FAKE_SUPERVISOR = b"""import os, sys
def main(argv):
    rest = b""
    while True:
        chunk = os.read(0, 4096)
        if not chunk:
            break
        rest += chunk
    print("SUPERVISOR", repr(argv), repr(rest))
    return 7
"""


def boot(data: bytes, umask: int = 0o022) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BOOT], input=data, capture_output=True,
                          preexec_fn=lambda: os.umask(umask), timeout=60)


def stage(tmp_path: Path, after: bytes, umask: int = 0o022) -> subprocess.CompletedProcess:
    return boot(program("probe", "facts", "--dir", str(tmp_path / "run")).data + after, umask)


def go(d: Path, files: list[tuple[str, bytes, int]], args: list[str]) -> bytes:
    return bundle(["supervisor", "run", str(d), *args], [file(*f) for f in files], str(d)).data


def facts_of(res: subprocess.CompletedProcess) -> dict:
    return read_answers(res.stdout)[0][0]


def test_end_of_input_after_the_facts_starts_nothing(tmp_path: Path) -> None:
    res = stage(tmp_path, b"")
    assert res.returncode == 0, res.stderr
    facts = facts_of(res)
    assert facts["dir"] == str(tmp_path / "run") and facts["executable"] == sys.executable
    assert res.stdout.decode().count("\n") == 1
    assert sorted(os.listdir(tmp_path / "run")) == []          # made, and nothing in it


def test_the_start_writes_the_files_then_runs_the_supervisor_with_the_rest(tmp_path: Path) -> None:
    d = tmp_path / "run"
    files = [("supervisor.py", FAKE_SUPERVISOR, 0o600), ("launch.sh", b"echo hi\n", 0o700)]
    res = stage(tmp_path, go(d, files, ["--run-id", "r1"]) + b'{"env": {}}\nbeat\n')
    assert res.returncode == 7, res.stderr
    last = res.stdout.decode().splitlines()[-1]
    assert last == "SUPERVISOR %r %r" % (["run", str(d), "--run-id", "r1"], b'{"env": {}}\nbeat\n')
    assert (d / "launch.sh").read_bytes() == b"echo hi\n"
    assert sorted(os.listdir(d)) == ["launch.sh", "supervisor.py"]   # no temporary name left


def test_each_file_gets_its_mode_whatever_the_umask(tmp_path: Path) -> None:
    d = tmp_path / "run"
    files = [("supervisor.py", FAKE_SUPERVISOR, 0o600), ("launch.sh", b"true\n", 0o700)]
    for umask in (0o022, 0o277):
        res = stage(tmp_path, go(d, files, []), umask=umask)
        assert res.returncode == 7, res.stderr
        assert stat.S_IMODE((d / "launch.sh").stat().st_mode) == 0o700, oct(umask)
        assert stat.S_IMODE((d / "supervisor.py").stat().st_mode) == 0o600, oct(umask)


def test_a_file_is_replaced_by_a_rename_never_rewritten_in_place(tmp_path: Path) -> None:
    """A reader of the old file (here a second link to it) never sees a half-written new one:
    the new bytes land under a temporary name, renamed over the old."""
    d = tmp_path / "run"
    d.mkdir()
    (d / "launch.sh").write_bytes(b"old\n")
    os.link(d / "launch.sh", tmp_path / "reader")
    files = [("launch.sh", b"new\n", 0o700), ("supervisor.py", FAKE_SUPERVISOR, 0o600)]
    res = stage(tmp_path, go(d, files, []))
    assert res.returncode == 7, res.stderr
    assert (d / "launch.sh").read_bytes() == b"new\n"
    assert (tmp_path / "reader").read_bytes() == b"old\n"
    assert not list(d.glob(".*.tmp"))


def test_end_of_input_in_the_middle_of_a_file_writes_nothing_and_runs_nothing(tmp_path: Path) -> None:
    d = tmp_path / "run"
    files = [("launch.sh", b"echo complete\n", 0o700), ("supervisor.py", FAKE_SUPERVISOR, 0o600)]
    word = go(d, files, [])
    cut = word[:len(word) - len(FAKE_SUPERVISOR) // 2]       # half of the supervisor's bytes
    res = stage(tmp_path, cut)
    assert res.returncode != 0
    assert b"the launcher closed its input inside a bundle" in res.stderr
    assert b"SUPERVISOR" not in res.stdout
    assert sorted(os.listdir(d)) == ["launch.sh"]            # whole, or not there at all


def test_a_tool_lands_under_the_workdir_before_the_probe_looks_for_it(tmp_path: Path) -> None:
    """doctor's collective rides with the check: the probe's script check finds it."""
    work = tmp_path / "work"
    tool = ".cluster/tools/collective.py"
    res = boot(program("probe", "facts", "--workdir", str(work), "--dir", str(tmp_path / "run"),
                       "--script", tool, dir=str(work), files=[(tool, b"print('hi')\n", 0o600)]).data)
    assert res.returncode == 0, res.stderr
    assert (work / tool).read_bytes() == b"print('hi')\n"
    assert stat.S_IMODE((work / tool).stat().st_mode) == 0o600
    assert stat.S_IMODE((work / ".cluster" / "tools").stat().st_mode) == 0o700
    assert facts_of(res)["script"]["file"] is True, facts_of(res)["script"]


def test_the_command_line_shows_the_program_which_runs_from_its_bundle(tmp_path: Path) -> None:
    """`ps` on a node tells what runs; the bootloader reads what to run from the bundle only."""
    facts = program("probe", "facts", "--dir", str(tmp_path / "run"))
    assert boot_command("python3", facts).endswith(f" probe facts --dir {tmp_path / 'run'}")
    res = subprocess.run([sys.executable, "-c", BOOT, "clean", "--workdir", "/"],
                         input=facts.data, capture_output=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert facts_of(res)["dir"] == str(tmp_path / "run")


# --- the node's code cache ---------------------------------------------------------------------

def connect_bundle() -> bytes:
    from cluster.backends.shipping import program
    return program("probe", "connect", "--addr", "127.0.0.1", "--port", "9", "--timeout", "0.2").data


def boot_at_home(home: Path, data: bytes) -> subprocess.CompletedProcess:
    env = {**os.environ, "HOME": str(home)}
    return subprocess.run([sys.executable, "-S", "-c", BOOT], input=data, capture_output=True,
                          env=env, timeout=60)


def cached(home: Path) -> list[Path]:
    from cluster.backends.shipping import CODE_CACHE
    return sorted(Path(CODE_CACHE.replace("~", str(home))).glob("*"))


def planted(home: Path, mode: int) -> None:
    """Every cached module replaced by code that says so: what a node runs if it trusts them."""
    import marshal
    for path in cached(home):
        path.write_bytes(marshal.dumps(compile("def main(a):\n print('PLANTED')\n return 0\n",
                                               "x.py", "exec")))
    cached(home)[0].parent.chmod(mode)


def test_a_node_compiles_once_then_runs_the_cached_code(tmp_path: Path) -> None:
    first = boot_at_home(tmp_path, connect_bundle())
    assert first.returncode == 0, first.stderr
    keys = {p.name.split(".")[0] for p in cached(tmp_path)}
    from cluster.backends.shipping import PROGRAMS, code_key
    assert keys == {code_key(m) for m in PROGRAMS["probe"]}      # one file per module, no temporaries
    assert stat.S_IMODE(cached(tmp_path)[0].parent.stat().st_mode) == 0o700
    planted(tmp_path, 0o700)
    again = boot_at_home(tmp_path, connect_bundle())
    assert again.stdout.decode().strip() == "PLANTED", again      # the cache is what ran


def test_a_cache_folder_others_may_write_is_not_trusted(tmp_path: Path) -> None:
    assert boot_at_home(tmp_path, connect_bundle()).returncode == 0
    planted(tmp_path, 0o770)
    res = boot_at_home(tmp_path, connect_bundle())
    assert res.returncode == 0 and b"PLANTED" not in res.stdout, res
    assert "ok" in read_answer(res.stdout)


def test_a_broken_cache_entry_is_compiled_again_and_replaced(tmp_path: Path) -> None:
    assert boot_at_home(tmp_path, connect_bundle()).returncode == 0
    for path in cached(tmp_path):
        path.write_bytes(b"\x00 not marshal")
    res = boot_at_home(tmp_path, connect_bundle())
    assert res.returncode == 0 and "ok" in read_answer(res.stdout), res
    assert all(p.read_bytes() != b"\x00 not marshal" for p in cached(tmp_path))


def test_a_home_where_nothing_can_be_written_still_runs(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.write_text("a file, not a folder: the cache cannot be made")
    res = boot_at_home(home, connect_bundle())
    assert res.returncode == 0 and "ok" in read_answer(res.stdout), res


# --- the working directory is not on a node program's path ------------------------------------

def standard_modules_of_the_node_programs() -> set[str]:
    """Every top-level module the bootloader and cluster/remote's programs import."""
    import ast
    from cluster.backends.shipping import REMOTE
    ours = {p.stem for p in REMOTE.glob("*.py")}
    names = {"os", "sys", "json", "types", "marshal"}
    for path in REMOTE.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module.split(".")[0])
    return names - ours - {"torch", "__future__"}


def test_modules_in_the_working_directory_do_not_shadow_the_standard_library(tmp_path: Path) -> None:
    """`python -c` puts the working directory first on sys.path: the user's project (local) or
    home (SSH) holding a types.py or json.py must not replace the standard library there."""
    shadows = standard_modules_of_the_node_programs()
    assert {"types", "json", "select", "signal", "os"} <= shadows
    for name in shadows:
        (tmp_path / f"{name}.py").write_text(f"raise ImportError('the cwd shadowed {name}')\n")
    res = subprocess.run([sys.executable, "-S", "-c", BOOT],
                         input=program("probe", "facts", "--dir", str(tmp_path / "run")).data,
                         capture_output=True, cwd=tmp_path, timeout=60)
    assert res.returncode == 0 and b"shadowed" not in res.stderr, res.stderr.decode()
    assert facts_of(res)["dir"] == str(tmp_path / "run")
