"""The live metrics, for real: three SSH test nodes run the reference trainer under
`cluster up --metrics-port 0`; the URL it says is scraped over HTTP while they train, read
with prometheus_client's own parser, and closed once the run has ended."""
from __future__ import annotations

import re
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

# Slower steps (the trainer's test hook) so that the job trains for a minute or more: long
# enough to be scraped a few times on a loaded two-core machine.
TRAIN = ["--", "cluster-train/train.py", "--epochs", "8", "--ckpt-every", "0",
         "--log-every", "50", "--no-plot", "--no-resume", "--out", "out"]
URL = re.compile(r"cluster: metrics: (http://127\.0\.0\.1:\d+/metrics)$")


def scrape(url: str) -> tuple[str, dict[tuple[str, frozenset], float]]:
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    samples = {(s.name, frozenset(s.labels.items())): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    return text, samples


def per_node(samples: dict, name: str, **labels: str) -> dict[str, float]:
    """node label -> value of `name` (with these other labels)."""
    out = {}
    for (sample, labelset), value in samples.items():
        d = dict(labelset)
        if sample == name and all(d.get(k) == v for k, v in labels.items()):
            out[d["node"]] = value
    return out


def test_a_running_job_is_scraped_and_the_port_closes_after(ssh_nodes4, cli):
    inv = Path(ssh_nodes4.write_inventory(cli.home / "inv.yaml", nodes=[1, 2, 3],
                                          setup=["export CLUSTER_TRAIN_TEST_STEP_SLEEP=0.1"]))
    proc = cli.start("up", "-i", str(inv), "--metrics-port", "0", *TRAIN)
    proc.wait_for(lambda p: any(URL.match(line) for line in p.err), 120, "the metrics' URL")
    url = next(m.group(1) for line in proc.err if (m := URL.match(line)))
    labels = {f"{n.name} {rank}" for rank, n in enumerate(ssh_nodes4.nodes[:3])}

    deadline, samples, text = time.monotonic() + 300, {}, ""
    while time.monotonic() < deadline and proc.popen.poll() is None:
        text, samples = scrape(url)
        rates = per_node(samples, "cluster_node_step_rate")
        if set(rates) == labels and all(r > 0 for r in rates.values()):
            break
        time.sleep(1.0)
    print(text)
    run = proc.run_id()
    rates = per_node(samples, "cluster_node_step_rate")
    assert set(rates) == labels and all(r > 0 for r in rates.values()), (rates, proc.dump())
    assert run and all(dict(labelset)["run"] == run for _, labelset in samples)
    ages = per_node(samples, "cluster_node_heartbeat_age_seconds")
    assert set(ages) == labels and max(ages.values()) < 15, ages
    assert per_node(samples, "cluster_node_state", state="running") == {n: 1.0 for n in labels}
    assert samples[("cluster_run_attempt", frozenset({("run", run)}))] == 0
    assert samples[("cluster_run_nodes_running", frozenset({("run", run)}))] == 3
    # the goodput so far, from the run's events: steps have been done, so some of it trained
    assert 0 < samples[("cluster_run_goodput_ratio", frozenset({("run", run)}))] < 1
    assert all(v >= 0 for v in per_node(samples, "cluster_node_work_seconds_per_step").values())

    assert proc.wait(600) == 0, proc.dump()
    with pytest.raises(urllib.error.URLError):          # the port is closed with the run
        scrape(url)
