"""Alerts (cluster.observe.alerts): the timeline's events in, through a real recorder, to a
real HTTP server on 127.0.0.1 (tests/webhook.py): each kind's body, Slack's shape, retries and
giving up, the bound on the end of a run, redaction, a full queue; the URL checks of the
inventory's notify: and --notify, and the command line recorded without the URL."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from cluster import api
from cluster.cli import run_cli
from cluster.cli.main import main
from cluster.errors import InputError, InventoryError
from cluster.inventory import load as load_inventory
from cluster.observe import alerts
from cluster.observe import timeline as tl
from cluster.runs import RunDir
from cluster.texts import redacted_url, url_problem
from tests.webhook import Webhook

CANARY = "canary-9f3b7c1e"


def notifier(hook: Webhook, said: list[str], **kw: Any) -> alerts.Notifier:
    kw.setdefault("backoff", 0.01)
    return alerts.Notifier([hook.url], "20250101-120000-abcd", secrets=[CANARY],
                           say=said.append, launcher="laptop", **kw)


def recorder(n: alerts.Notifier) -> tl.Recorder:
    events: list[tl.Event] = []
    rec = tl.Recorder(events.append, clock=lambda: 5.0, wall=lambda: 1735732800.0)
    rec.listen(n.listen)
    return rec


def a_run(rec: tl.Recorder) -> None:
    """Every kind of alert, as cluster.launch and the watcher record them."""
    rec.event(tl.CHECK)
    rec.event(tl.STARTED, nodes=["a 0", "b 1"])
    rec.beat("a 0", step=3)
    rec.event(tl.SLOW, "b 1", ranks=[1], ratio=1.8, part="compute", compute_s=0.9, data_s=0.1,
              ref_compute_s=0.5, ref_data_s=0.1, after_s=60.0, reference="median")
    rec.event(tl.FAILED, "b 1", what=f"RuntimeError: token {CANARY} refused")
    rec.event(tl.ENDED, how="node [b 1] failed: RuntimeError (exit code 1)")
    rec.event(tl.RESTART, why="node [b 1] failed; restarting", cause=f"RuntimeError: {CANARY}",
              **{"class": "node"})
    rec.event(tl.ASIDE, host="b", why="the first failure", spare="c")
    rec.attempt = 1
    rec.event(tl.HANG, quiet=30.2)
    rec.event(tl.ENDED, how="hang: no progress for 30 s", odd_node="c 1",
              odd_frame="train.py:42 in step")
    rec.event(tl.RESTART, why="grow back at the checkpoint", planned=True)
    rec.event(tl.OUTCOME, ok=False, error="run 20250101 hung: no progress\ndetails: more",
              goodput={"fraction": 0.75, "wall": 120.0})


def test_each_kind_is_one_body_with_its_fields() -> None:
    said: list[str] = []
    with Webhook() as hook:
        n = notifier(hook, said)
        a_run(recorder(n))
        n.close()
        bodies = hook.wait_for(7)
    common = {"run": "20250101-120000-abcd", "time": "2025-01-01T12:00:00Z", "launcher": "laptop"}
    assert bodies == [
        {"event": "slow", **common, "attempt": 0, "node": "b 1", "ratio": 1.8, "part": "compute",
         "compute_s": 0.9, "data_s": 0.1, "ref_compute_s": 0.5, "ref_data_s": 0.1},
        {"event": "failure", **common, "attempt": 0, "node": "b 1",
         "cause": "RuntimeError: token *** refused"},
        {"event": "restart", **common, "attempt": 0, "why": "node [b 1] failed; restarting",
         "planned": False, "cause": "RuntimeError: ***", "class": "node"},
        {"event": "aside", **common, "attempt": 0, "host": "b", "why": "the first failure",
         "spare": "c"},
        {"event": "hang", **common, "attempt": 1, "how": "hang: no progress for 30 s",
         "quiet": 30.2, "node": "c 1", "frame": "train.py:42 in step"},
        {"event": "restart", **common, "attempt": 1, "why": "grow back at the checkpoint",
         "planned": True},
        {"event": "finish", **common, "attempt": 1, "ok": False,
         "error": "run 20250101 hung: no progress", "goodput": {"fraction": 0.75, "wall": 120.0}},
    ]
    assert said == []
    assert all(r["type"] == "application/json" for r in hook.requests)


def test_a_detached_runs_launcher_sends_no_finish() -> None:
    said: list[str] = []
    with Webhook() as hook:
        n = notifier(hook, said)
        rec = recorder(n)
        rec.event(tl.STARTED, nodes=["a 0"])
        rec.event(tl.DETACHED)
        rec.event(tl.OUTCOME, ok=True, code=0)
        n.close()
    assert hook.requests == [] and said == []


def test_a_slack_webhook_gets_one_readable_line() -> None:
    said: list[str] = []
    with Webhook() as hook:
        n = notifier(hook, said, slack=lambda url: True)     # the local server stands in for Slack
        a_run(recorder(n))
        n.close()
        bodies = hook.wait_for(7)
    assert all(set(b) == {"text"} and "\n" not in b["text"] for b in bodies), bodies
    texts = [b["text"] for b in bodies]
    assert texts[1] == (":x: run 20250101-120000-abcd: node [b 1] failed first (attempt 1): "
                        "RuntimeError: token *** refused")
    assert texts[4] == (":hourglass: run 20250101-120000-abcd hung (attempt 2): no progress for "
                        "30 s; the odd one out: [c 1] in train.py:42 in step")
    assert texts[6].startswith(":x: run 20250101-120000-abcd ended without success, goodput 75%")
    assert not any(CANARY in t for t in texts)


def test_slack_is_known_by_its_host() -> None:
    assert alerts.is_slack("https://hooks.slack.com/services/T/B/X")
    assert not alerts.is_slack("https://example.com/hooks.slack.com/x")
    assert not alerts.is_slack("http://127.0.0.1:8080/services/T/B/X")


def finish(rec: tl.Recorder) -> None:
    rec.event(tl.OUTCOME, ok=True, code=0)


def test_two_500s_then_200_is_delivered_once() -> None:
    said: list[str] = []
    with Webhook(statuses=[500, 500]) as hook:
        n = notifier(hook, said)
        finish(recorder(n))
        n.close()
    assert len(hook.requests) == 3 and len(hook.bodies) == 1
    assert hook.bodies[0]["event"] == "finish" and hook.bodies[0]["ok"] is True
    assert said == []


def test_always_500_gives_up_after_three_tries_said_once() -> None:
    said: list[str] = []
    with Webhook(statuses=[500] * 10) as hook:
        n = notifier(hook, said)
        rec = recorder(n)
        rec.event(tl.FAILED, "a 0", what="boom")
        finish(rec)
        n.close()
    assert len(hook.requests) == 6 and hook.bodies == []        # 3 tries each
    assert said == ["alerts: an alert was not delivered to http://127.0.0.1:"
                    f"{hook.server.server_address[1]}/... after 3 tries (HTTP 500); further "
                    "failures to it are not said"]


def test_a_refusal_is_not_tried_again() -> None:
    said: list[str] = []
    with Webhook(statuses=[404]) as hook:
        n = notifier(hook, said)
        finish(recorder(n))
        n.close()
    assert len(hook.requests) == 1 and "after 1 try (HTTP 404)" in said[0]


def test_a_server_that_never_answers_delays_the_end_by_the_bound_only() -> None:
    said: list[str] = []
    with Webhook(hang=True) as hook:
        n = notifier(hook, said)
        rec = recorder(n)
        t0 = time.monotonic()
        finish(rec)                         # the listener returns at once
        listened = time.monotonic() - t0
        n.close(wait=1.0)
        took = time.monotonic() - t0
    assert listened < 0.1, listened
    assert 0.9 <= took < 2.0, took
    assert said == [f"alerts: 1 not delivered to http://127.0.0.1:{hook.server.server_address[1]}"
                    f"/... in the 1 s the end of a run waits for them"]


def test_secrets_and_the_url_never_leave_in_a_body_or_a_line() -> None:
    said: list[str] = []
    with Webhook(statuses=[500] * 3) as hook:
        n = notifier(hook, said)
        rec = recorder(n)
        rec.event(tl.FAILED, "a 0", what=f"KeyError: {CANARY} and {hook.url} " + "x" * 600)
        n.close()
        sent = [r["body"] for r in hook.requests]
    assert sent and all(CANARY not in str(b) and hook.path not in str(b) for b in sent), sent
    assert len(sent[0]["cause"]) == alerts.TEXT and sent[0]["cause"].startswith(
        "KeyError: *** and *** xxx")
    assert said and not any(hook.path in line or "s3cret" in line for line in said), said


def test_a_full_queue_drops_and_says_how_many_once() -> None:
    said: list[str] = []
    with Webhook(hang=True) as hook:
        n = notifier(hook, said, size=2)
        rec = recorder(n)
        for i in range(6):
            rec.event(tl.FAILED, f"n{i}", what="boom")
        n.close(wait=0.5)
    dropped = [line for line in said if "dropped" in line]
    # the first is taken by the thread (it waits on the server), two wait: three dropped, or
    # four when the thread had not yet taken the first
    assert len(dropped) == 1 and dropped[0].startswith(("alerts: 3 dropped", "alerts: 4 dropped"))
    assert "more than 2 waiting at once" in dropped[0] and hook.path not in dropped[0]


def test_a_listener_that_is_called_under_the_recorders_lock_never_waits() -> None:
    """The recorder's lock is held across the listener: a notifier with a dead server still
    lets 1,000 events through at once."""
    said: list[str] = []
    with Webhook(hang=True) as hook:
        n = notifier(hook, said, size=4)
        rec = recorder(n)
        t0 = time.monotonic()
        for i in range(1000):
            rec.event(tl.SLOW, f"n{i}", ratio=2.0, part="compute")
        assert time.monotonic() - t0 < 1.0
        n.close(wait=0.2)


# -- the URLs' checks --

@pytest.mark.parametrize("url, why", [
    ("ftp://files.example.com/T0KEN", "is not an http:// or https:// URL"),
    ("hooks.slack.com/services/T/B/T0KEN", "is not an http:// or https:// URL"),
    ("https:///services/T/B/T0KEN", "names no host"),
    ("https://example.com:port/T0KEN", "has a port that is not a number"),
    ("https://example.com/T0\nKEN", "control character '\\n'"),
])
def test_a_bad_url_is_said_redacted(url: str, why: str) -> None:
    problem = url_problem(url)
    assert problem is not None and why in problem
    assert "T0" not in problem and "KEN" not in problem


def test_a_url_is_shown_as_its_scheme_and_host_only() -> None:
    assert redacted_url("https://hooks.slack.com/services/T0/B0/XYZ") == "https://hooks.slack.com/..."
    assert redacted_url("http://user:pw@127.0.0.1:8080/x?token=1") == "http://127.0.0.1:8080/..."
    assert url_problem("https://hooks.slack.com/services/T0/B0/XYZ") is None


def test_the_inventorys_notify_is_checked_with_its_line_and_never_shown(tmp_path: Path) -> None:
    inv = tmp_path / "inv.yaml"
    inv.write_text("defaults:\n  notify:\n    - https://example.com/ok\n"
                   "    - ftp://example.com/T0KEN\nhosts: [a]\n")
    with pytest.raises(InventoryError) as err:
        load_inventory(str(inv))
    assert f"{inv}:4: notify: 'ftp://example.com/...' is not an http:// or https:// URL" in str(
        err.value)
    assert "T0KEN" not in str(err.value)
    inv.write_text("hosts:\n  - name: a\n    notify: [https://example.com/x]\n")
    with pytest.raises(InventoryError, match="'notify' is the same for every node of a job"):
        load_inventory(str(inv))
    inv.write_text("defaults:\n  notify: [https://example.com/T0KEN, https://b.example/y]\n"
                   "hosts: [a, b]\n")
    loaded = load_inventory(str(inv))
    assert {h.notify for h in loaded.hosts} == {("https://example.com/T0KEN", "https://b.example/y")}


def test_the_command_lines_notify_is_checked_and_never_shown(tmp_path: Path) -> None:
    res = CliRunner().invoke(main, ["up", "--notify", "gopher://example.com/T0KEN", "--dry-run"])
    assert res.exit_code == 2
    assert "Invalid value for '--notify': 'gopher://example.com/...' is not an http" in res.output
    assert "T0KEN" not in res.output
    with pytest.raises(InputError, match=r"--notify \(notify=\): 'file://\.\.\.' is not an http"):
        api.prepare(api.Request(notify=("file:///etc/T0KEN",), dry_run=True))


def test_a_dry_run_records_and_shows_no_url(tmp_path: Path, monkeypatch, capsys) -> None:
    """run.json's command line, inventory.yaml, inventory.source and what is printed: the
    URLs of --notify and notify: redacted, both said as where the alerts would go."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CLUSTER_RUNS_DIR", raising=False)
    (tmp_path / "inv.yaml").write_text(
        "defaults:\n  notify: ['https://hooks.slack.com/services/T0/B0/INV0T0KEN']\n"
        "hosts: [a, b]\n")
    code = run_cli(["up", "-i", "inv.yaml", "--notify", "http://127.0.0.1:9/hook/CLI0T0KEN",
                    "--notify=https://example.com/x?token=EQ0T0KEN", "--dry-run", "--", "train.py",
                    "--notify", "not-ours"])
    assert code == 0
    said = capsys.readouterr()
    assert ("dry run: alerts would go to https://hooks.slack.com/..., http://127.0.0.1:9/..., "
            "https://example.com/...") in said.err
    run = RunDir.find(None, tmp_path / "runs", dry_runs=True)
    command = run.meta()["command"]
    assert command[:8] == ["cluster", "up", "-i", "inv.yaml", "--notify", "http://127.0.0.1:9/...",
                           "--notify=https://example.com/...", "--dry-run"]
    assert command[-2:] == ["--notify", "not-ours"]
    written = [p.read_text() for p in run.path.rglob("*") if p.is_file()]
    for text in [said.out, said.err, *written]:
        assert "T0KEN" not in text
    assert "notify: ['https://hooks.slack.com/...']" in (run.path / "inventory.source").read_text()
