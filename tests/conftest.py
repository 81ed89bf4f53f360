"""Fixtures for every tier.

    reliability   record(fault=..., does=..., outcome=..., exit=..., figures={...}): one row of
                  docs/RELIABILITY.md, written when the suite runs with
                  CLUSTER_WRITE_RELIABILITY=1 (tests/reliability.py renders it)

With CLUSTER_REQUIRE_INTEGRATION=1 a skipped integration or slurm test fails (tests/require.py).
"""
from __future__ import annotations

import os

import pytest

from tests.require import pytest_runtest_makereport  # noqa: F401  (a hook)

RELIABILITY: list[dict] = []


@pytest.fixture(autouse=True)
def own_cache(tmp_path_factory, monkeypatch):
    """A cache and a state folder of the suite's own: the user's ~/.cache (an NCCL tuning kept
    by `cluster doctor --tune-nccl`) must not change what a test renders, nor a test write
    into the user's node ledger (~/.local/state/cluster/ledger)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path_factory.mktemp("state")))


@pytest.fixture
def ctrl_c_raises():
    """SIGINT raises KeyboardInterrupt during the test, whatever this process inherited (a
    suite started with `... &` from a script has SIGINT ignored, and then Python's
    _thread.interrupt_main() does nothing)."""
    import signal
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


@pytest.fixture
def reliability(request):
    def record(**fields) -> None:
        RELIABILITY.append({"test": request.node.nodeid, **fields})
    return record


def pytest_sessionfinish(session, exitstatus):
    if RELIABILITY and os.environ.get("CLUSTER_WRITE_RELIABILITY") == "1":
        from tests import reliability
        reliability.write(RELIABILITY)
