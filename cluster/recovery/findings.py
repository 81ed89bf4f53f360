"""A verdict on one check of one node: what the gate (gate.py, hardware.py), doctor and the
ledger all speak in."""
from __future__ import annotations

from dataclasses import dataclass

PASS, WARN, FAIL = "pass", "warn", "fail"
GIB = 1 << 30


@dataclass(frozen=True)
class Finding:
    node: str              # a node's name, or "all" for a finding about the whole job
    check: str
    status: str            # pass | warn | fail
    detail: str
    fix: str = ""
