"""Every shipped example's "Run:" line (inventory/*) and every dry run the docs show for a
shipped inventory, run as written by a newcomer: in a fresh folder holding a copy of the files
the line names, with none of the environment the inventory forwards or keeps secret set."""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cluster import inventory as inv_mod

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted(p for p in (REPO / "inventory").iterdir() if p.is_file())
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
DOC_DRY_RUN = re.compile(r"cluster up [^`#|\n]*inventory/[^`#|\n]*--dry-run[^`#|\n]*")


def run_lines() -> list[tuple[str, str]]:
    """(where, command) for each `# Run: cluster ...` line of the examples, without the
    remark in parentheses after it."""
    found = []
    for path in EXAMPLES:
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            m = re.match(r"#\s*Run:\s*(cluster .*?)\s*(\(.*\))?\s*$", line)
            if m:
                found.append((f"{path.relative_to(REPO)}:{lineno}", m.group(1)))
    return found


def doc_lines() -> list[tuple[str, str]]:
    return [(f"{path.relative_to(REPO)}:{lineno}", m.group(0).strip())
            for path in DOCS for lineno, line in enumerate(path.read_text().splitlines(), 1)
            for m in DOC_DRY_RUN.finditer(line)]


def test_every_example_has_a_run_line() -> None:
    named = {shlex.split(cmd)[shlex.split(cmd).index("-i") + 1] for _, cmd in run_lines()}
    assert named == {str(p.relative_to(REPO)) for p in EXAMPLES}
    assert len(doc_lines()) >= 3, "the docs' dry runs of shipped inventories were not found"


def referenced_env(files: list[Path]) -> tuple[set[str], set[str]]:
    """The names the inventories take from the launching shell: (secret_env, env_forward)."""
    secrets: set[str] = set()
    forwarded: set[str] = set()
    for path in files:
        for host in inv_mod.load(path).hosts:
            secrets.update(host.secret_env)
            forwarded.update(n for n in host.env_forward if "*" not in n)
    return secrets, forwarded


@pytest.mark.parametrize("where,command", run_lines() + doc_lines())
def test_the_line_runs_as_written(tmp_path: Path, where: str, command: str) -> None:
    argv = shlex.split(command)
    assert argv[0] == "cluster" and "--dry-run" in argv, where
    files = [REPO / a for a in argv[1:] if "/" in a and (REPO / a).is_file()]
    for path in files:                        # the newcomer's copy of what the line names
        (tmp_path / path.relative_to(REPO)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, tmp_path / path.relative_to(REPO))
    secrets, forwarded = referenced_env(files)
    unset = secrets | forwarded | {"CLUSTER_RUNS_DIR"}
    env = {k: v for k, v in os.environ.items() if k not in unset and not k.startswith("WANDB_")}
    # this checkout's cluster first, as installed; what else the path held (the packages of
    # a machine that has them there) after it
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-m", "cluster", *argv[1:]], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{where}: {command}\n{proc.stderr[-2000:]}"
    assert "nothing was" in proc.stderr, proc.stderr[-2000:]    # contacted / submitted
    for name in sorted(secrets):              # named as not set, never with a value
        assert f"secret_env {name}=<not set in this shell>" in proc.stderr, proc.stderr[-2000:]
    for name in sorted(forwarded):
        assert f"env_forward {name}=<not set in this shell>" in proc.stderr, proc.stderr[-2000:]
