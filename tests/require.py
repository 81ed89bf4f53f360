"""A green run must mean the real tiers ran. With CLUSTER_REQUIRE_INTEGRATION=1 (set by
.ci/run) a skipped test of the integration or slurm tier is a failure that says why it skipped;
only a test marked `cuda` (it needs a GPU, which a CPU machine has not) or `docker` (a docker
client, which tests/run does not install) may still skip. Loaded by tests/conftest.py."""
from __future__ import annotations

import os

import pytest

REQUIRE = "CLUSTER_REQUIRE_INTEGRATION"
REQUIRED = ("integration", "slurm")       # markers whose tests must run
MAY_SKIP = ("cuda", "docker")             # markers whose tests may skip anyway


def must_run(item: pytest.Item) -> bool:
    names = {m.name for m in item.iter_markers()}
    return bool(names & set(REQUIRED)) and not names & set(MAY_SKIP)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and os.environ.get(REQUIRE) == "1" and must_run(item):
        why = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} skipped ({why}), but {REQUIRE}=1 requires the "
                           f"{'/'.join(REQUIRED)} tiers to run: run as root on a machine where "
                           f"tests/run could install what they need")
