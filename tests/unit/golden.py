"""Golden files: a rendered script compared with the one recorded under tests/unit/golden/.

A missing golden file fails (it is never written silently); CLUSTER_REGEN_GOLDEN=1 rewrites
them all, for a change that is meant."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

REGEN = os.environ.get("CLUSTER_REGEN_GOLDEN") == "1"


def check_golden(golden: Path, text: str, test_file: str) -> None:
    how = f"CLUSTER_REGEN_GOLDEN=1 tests/run {test_file}"
    if REGEN:
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(text)
        return
    if not golden.exists():
        pytest.fail(f"golden file {golden} is missing; if this input is new, create it with: {how}")
    assert text == golden.read_text(), (
        f"rendered script differs from {golden}; if the change is intended, regenerate with: {how}")
