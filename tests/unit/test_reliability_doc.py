"""docs/RELIABILITY.md is the suite's own output: it lists every fault test, and stays so."""
from __future__ import annotations

import ast
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [ROOT / "tests" / "integration" / "test_faults.py", ROOT / "tests" / "unit" / "test_bad_input.py"]


def recording_tests() -> set[str]:
    """Every test function that records a row (calls the reliability fixture)."""
    found = set()
    for src in SOURCES:
        for node in ast.walk(ast.parse(src.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_") and \
                    any(a.arg == "reliability" for a in node.args.args):
                found.add(node.name)
    return found


def test_every_fault_test_has_a_row_and_the_page_is_rendered_from_the_data() -> None:
    from tests import reliability
    data = json.loads((ROOT / "docs" / "reliability.json").read_text())
    rows = {test.split("::")[-1].split("[")[0] for test in data["rows"]}
    missing = recording_tests() - rows
    assert not missing, (f"no row in docs/reliability.json for {sorted(missing)}: run "
                         f"CLUSTER_WRITE_RELIABILITY=1 tests/run tests/integration/test_faults.py "
                         f"tests/unit/test_bad_input.py")
    assert (ROOT / "docs" / "RELIABILITY.md").read_text() == reliability.render(data), \
        "docs/RELIABILITY.md was edited by hand or is stale: regenerate it (see its header)"
