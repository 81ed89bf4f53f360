"""docs/RELIABILITY.md, generated from the fault tests' own measurements.

Each fault test (tests/integration/test_faults.py and the bad-input tests) records what it did
and what it measured through the `reliability` fixture. Running the suite with
CLUSTER_WRITE_RELIABILITY=1 merges those rows into docs/reliability.json (keyed by test, so a
partial run updates only its rows) and renders docs/RELIABILITY.md from it:

    CLUSTER_WRITE_RELIABILITY=1 tests/run tests/integration/test_faults.py tests/unit/test_bad_input.py
"""
from __future__ import annotations

import json
import platform
import time
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"
DATA = DOCS / "reliability.json"
PAGE = DOCS / "RELIABILITY.md"

HEADER = """# Reliability: every fault the suite injects, and what happened

Generated from the suite's own results by `tests/reliability.py`; do not edit by hand. Rerun
(as root, on a machine like the one below) with:

```sh
CLUSTER_WRITE_RELIABILITY=1 tests/run tests/integration/test_faults.py tests/unit/test_bad_input.py
```

Each row is one automated test on real nodes: one network namespace and one `sshd` per node
(tests/integration/fixtures), real torchrun with gloo. "Clean" is checked by what is left in
each node's network namespace (every process but sshd's own), not by the run-id scan cluster
itself uses. Times are from the fault to the moment the check saw it, on a 2-core machine that
runs every node; a real cluster's figures are bounded by the same settings (ssh.keepalive,
stop_grace), not by these.

"""


def write(rows: list[dict]) -> None:
    DOCS.mkdir(exist_ok=True)
    data = json.loads(DATA.read_text()) if DATA.exists() else {"rows": {}}
    for row in rows:
        data["rows"][row["test"]] = {**row, "measured": time.strftime("%Y-%m-%d")}
    data["machine"] = f"{platform.machine()}, {_cores()} cores, Linux {platform.release()}"
    DATA.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    PAGE.write_text(render(data))


def _cores() -> int:
    import os
    return os.cpu_count() or 0


def render(data: dict) -> str:
    lines = [HEADER, f"Machine of the last run: {data.get('machine', 'unknown')}.\n",
             "| fault | what the test does | outcome (measured) | exit | test |",
             "| --- | --- | --- | --- | --- |"]
    for test, row in sorted(data["rows"].items(), key=lambda kv: (kv[1].get("order", 99), kv[0])):
        figures = "; ".join(f"{k.replace('_', ' ')} {v}" for k, v in sorted(row.get("figures", {}).items()))
        outcome = row.get("outcome", "") + (f" ({figures})" if figures else "")
        lines.append(f"| {row.get('fault', '')} | {row.get('does', '')} | {outcome} | "
                     f"{row.get('exit', '')} | `{test}` ({row.get('measured', '')}) |")
    return "\n".join(lines) + "\n"
