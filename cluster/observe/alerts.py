"""Alerts: a run's happenings POSTed as they happen, one JSON body per happening, to each URL of
`cluster up --notify URL` and the inventory's `notify:` (docs/alerts.md has the schema).

The one source is the timeline (cluster.observe.timeline): the Notifier is one of its
recorder's listeners. A listener is called under the recorder's lock, while the watcher's
threads wait on it, so it only turns the event into an alert (a dict, pure) and puts it on a
bounded queue without waiting; a full queue drops the alert and counts it. One daemon thread
delivers: each URL in turn, a few tries a URL, a short timeout each, a backoff between them.
Nothing waits on that thread but the end of `cluster up` (close), and that for a few seconds
at most: a webhook that never answers delays no stop and, by more than CLOSE_WAIT, no exit.

What is sent is kept small and clean: the event's own fields, never the environment; every
string cut to TEXT characters, after the run's secret values (secret_env, known to the
launcher) and the URLs themselves are replaced by REDACTED, since a failure's cause is a
worker's own error line and may quote anything. A URL is only ever shown as scheme://host/...
(texts.redacted_url): a Slack webhook's path is its token.
"""
from __future__ import annotations

import json
import queue
import socket
import sys
import threading
import time
import urllib.error
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime, timezone
from typing import Any
from urllib.parse import urlsplit

from ..texts import redacted_url
from . import timeline as tl

Alert = dict[str, Any]
Post = Callable[[str, bytes, float], None]     # (url, body, timeout); raises when not delivered

# The alerts, by their `event` name.
FAILURE, HANG, SLOW, RESTART, ASIDE, FINISH = "failure", "hang", "slow", "restart", "aside", "finish"

TIMEOUT = 5.0         # seconds one try may take
TRIES = 3             # tries a URL, for an answer that may heal (no answer, 429, 5xx)
BACKOFF = 1.0         # seconds before the second try, doubled before each next one
CLOSE_WAIT = 5.0      # what the end of a run waits, at most, for the alerts still queued
QUEUE = 100           # alerts waiting at most; one more is dropped (and counted)
TEXT = 500            # characters a string keeps (a cause, an error's first line)
REDACTED = "***"
SLACK_HOSTS = frozenset({"hooks.slack.com"})
SLOW_FIELDS = ("ratio", "part", "compute_s", "data_s", "ref_compute_s", "ref_data_s")


def is_slack(url: str) -> bool:
    """A Slack incoming webhook, which takes Slack's message shape ({"text": ...})."""
    return (urlsplit(url).hostname or "").lower() in SLACK_HOSTS


class Alerts:
    """Timeline events in, alerts out (pure but for what it remembers of the run: the last
    hang's quiet seconds, whether the launcher left). Only the recorder's listener calls it,
    under the recorder's lock: one caller at a time."""

    def __init__(self, run_id: str, launcher: str) -> None:
        self.run_id, self.launcher = run_id, launcher
        self.quiet: float | None = None       # the watchdog's last HANG: seconds without progress
        self.detached = False

    def __call__(self, ev: tl.Event) -> Alert | None:
        kind = ev.get("kind")
        if kind == tl.HANG:
            self.quiet = ev.get("quiet")
        elif kind == tl.DETACHED:
            self.detached = True
        fields = self._fields(kind, ev)
        if fields is None:
            return None
        return {"event": fields.pop("event"), "run": self.run_id, "attempt": ev.get("attempt", 0),
                "time": iso(ev.get("t")), "launcher": self.launcher, **fields}

    def _fields(self, kind: Any, ev: tl.Event) -> dict[str, Any] | None:
        if kind == tl.FAILED:
            return {"event": FAILURE, "node": ev.get("node"), "cause": ev.get("what")}
        if kind == tl.ENDED and str(ev.get("how", "")).startswith("hang"):
            # sent once the stacks are read (the attempt's end), with the odd one out if known
            return {"event": HANG, "how": ev.get("how"), "quiet": self.quiet,
                    **_some(node=ev.get("odd_node"), frame=ev.get("odd_frame"))}
        if kind == tl.SLOW:
            return {"event": SLOW, "node": ev.get("node"), **{k: ev.get(k) for k in SLOW_FIELDS}}
        if kind == tl.RESTART:
            return {"event": RESTART, "why": ev.get("why"), "planned": bool(ev.get("planned")),
                    **_some(cause=ev.get("cause"), **{"class": ev.get("class")})}
        if kind == tl.ASIDE:
            return {"event": ASIDE, "host": ev.get("host"), "why": ev.get("why"),
                    **_some(spare=ev.get("spare"))}
        if kind == tl.OUTCOME and not self.detached:   # a detached run's end is its nodes'
            error = str(ev["error"]).splitlines()[0] if ev.get("error") else None
            return {"event": FINISH, "ok": bool(ev.get("ok")),
                    **_some(code=ev.get("code"), error=error, goodput=ev.get("goodput"))}
        return None


def _some(**fields: Any) -> dict[str, Any]:
    """The fields that have a value."""
    return {k: v for k, v in fields.items() if v is not None}


def iso(t: Any) -> str:
    """A wall clock time as ISO 8601 UTC, to the second: 2025-01-31T12:00:00Z."""
    when = float(t) if isinstance(t, (int, float)) else time.time()
    return datetime.fromtimestamp(when, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def cleaned(value: Any, hide: Iterable[str]) -> Any:
    """Every string in value with each of `hide` replaced by REDACTED, then cut to TEXT
    characters (after: a secret cut in two would show its first half)."""
    if isinstance(value, str):
        for secret in hide:
            value = value.replace(secret, REDACTED)
        return value if len(value) <= TEXT else value[:TEXT - 3] + "..."
    if isinstance(value, dict):
        return {str(cleaned(k, hide)): cleaned(v, hide) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [cleaned(v, hide) for v in value]
    return value


def summary(alert: Alert) -> str:
    """One line a person reads (Slack's text)."""
    run, kind = f"run {alert['run']}", alert["event"]
    at = f" (attempt {alert['attempt'] + 1})" if isinstance(alert.get("attempt"), int) else ""
    if kind == FAILURE:
        return f":x: {run}: node [{alert['node']}] failed first{at}: {alert.get('cause')}"
    if kind == HANG:
        quiet = f" for {alert['quiet']:.0f} s" if isinstance(alert.get("quiet"), (int, float)) else ""
        odd = (f"; the odd one out: [{alert['node']}] in {alert.get('frame')}"
               if alert.get("node") else "")
        return f":hourglass: {run} hung{at}: no progress{quiet}{odd}"
    if kind == SLOW:
        return (f":turtle: {run}: node [{alert['node']}] is slow{at}: {alert.get('ratio')}x "
                f"the job's median node ({alert.get('part')})")
    if kind == RESTART:
        return f":repeat: {run} restarts{at}: {alert.get('why')}"
    if kind == ASIDE:
        spare = f"; spare {alert['spare']} takes its place" if alert.get("spare") else ""
        return f":no_entry: {run}: host {alert['host']} set aside: {alert.get('why')}{spare}"
    return _finish(run, alert)


def _finish(run: str, alert: Alert) -> str:
    goodput = alert.get("goodput")
    good = (f", goodput {goodput['fraction']:.0%}" if isinstance(goodput, dict)
            and isinstance(goodput.get("fraction"), (int, float)) else "")
    if alert.get("ok"):
        return f":white_check_mark: {run} finished{good}"
    why = alert.get("error") or f"exit code {alert.get('code')}"
    return f":x: {run} ended without success{good}: {why}"


def post_json(url: str, data: bytes, timeout: float) -> None:
    """POST data as JSON; urllib raises HTTPError for an answer of 400 or above."""
    import urllib.request          # here: a launch that alerts nobody never loads it (12 ms)
    request = urllib.request.Request(url, data=data, method="POST", headers={
        "Content-Type": "application/json", "User-Agent": "cluster-alerts"})
    with urllib.request.urlopen(request, timeout=timeout) as answer:
        answer.read(4096)


def _say_err(text: str) -> None:
    sys.stderr.write(f"cluster: {text}\n")


def known_secrets(hosts: Iterable[Any], environ: Mapping[str, str]) -> list[str]:
    """The values of the hosts' secret_env names that `environ` has: what every string an
    alert sends is cleaned of (a missing one fails a launch elsewhere)."""
    return [environ[name] for h in hosts for name in h.secret_env if name in environ]


class Notifier:
    """listen() is the timeline recorder's listener; one daemon thread delivers; close() at
    the end of the run. Fakes through the constructor: post (the HTTP POST), slack (which
    URLs take Slack's shape), say (the console line)."""

    def __init__(self, urls: Iterable[str], run_id: str, secrets: Iterable[str] = (),
                 say: Callable[[str], None] = _say_err, *, post: Post = post_json,
                 slack: Callable[[str], bool] = is_slack, launcher: str | None = None,
                 tries: int = TRIES, timeout: float = TIMEOUT, backoff: float = BACKOFF,
                 size: int = QUEUE) -> None:
        self.urls = tuple(dict.fromkeys(urls))
        self.alerts = Alerts(run_id, launcher or socket.gethostname())
        # longest first: a secret that holds another is replaced whole
        self.hide = sorted({s for s in secrets if s} | set(self.urls), key=len, reverse=True)
        self.say, self.post, self.slack = say, post, slack
        self.tries, self.timeout, self.backoff = tries, timeout, backoff
        self.queue: queue.Queue[Alert | None] = queue.Queue(size)
        self.lock = threading.Lock()
        self.accepted = self.finished = self.dropped = 0
        self.given_up: set[str] = set()       # URLs whose failure was said (once each)
        self.deadline: float | None = None    # set by close(): no try starts after it
        self.thread = threading.Thread(target=self._deliver, name="cluster-alerts", daemon=True)
        self.thread.start()

    def listen(self, ev: tl.Event) -> None:
        """The recorder's listener: under its lock, so only a note, never a wait or I/O."""
        alert = self.alerts(ev)
        if alert is None:
            return
        with self.lock:
            try:
                self.queue.put_nowait(alert)
                self.accepted += 1
            except queue.Full:
                self.dropped += 1

    def close(self, wait: float = CLOSE_WAIT) -> None:
        """Wait at most `wait` s for what is queued (the finish), then say what was not
        delivered, and what was dropped, in a line each."""
        self.deadline = time.monotonic() + wait
        try:
            self.queue.put_nowait(None)
        except queue.Full:
            pass                                 # the thread stops trying at the deadline
        self.thread.join(max(0.0, self.deadline - time.monotonic()))
        with self.lock:
            left, dropped = self.accepted - self.finished, self.dropped
        shown = ", ".join(redacted_url(u) for u in self.urls)
        if left:
            self.say(f"alerts: {left} not delivered to {shown} in the {wait:g} s the end of a "
                     f"run waits for them")
        if dropped:
            self.say(f"alerts: {dropped} dropped, more than {self.queue.maxsize} waiting at "
                     f"once (to {shown})")

    # -- the delivery thread --

    def _deliver(self) -> None:
        while True:
            alert = self.queue.get()
            if alert is None:
                return
            clean = cleaned(alert, self.hide)
            tried = [self._send(url, self._body(url, clean)) for url in self.urls]
            if None not in tried:                # none left untried by close's bound
                with self.lock:
                    self.finished += 1

    def _body(self, url: str, alert: Alert) -> bytes:
        shaped = {"text": cleaned(summary(alert), self.hide)} if self.slack(url) else alert
        return json.dumps(shaped, default=str).encode()

    def _send(self, url: str, data: bytes) -> bool | None:
        """Delivered; a few tries, and the first failure to give up on a URL is said (once a
        URL); None when close's bound came first (close says how many)."""
        why = ""
        for attempt in range(self.tries):
            timeout = self._left(self.timeout)
            if timeout <= 0:
                return None
            try:
                self.post(url, data, timeout)
                return True
            except urllib.error.HTTPError as exc:
                why = f"HTTP {exc.code}"
                if exc.code < 500 and exc.code != 429:
                    break                        # a refusal does not heal: no more tries
            except (OSError, ValueError) as exc:     # URLError, a timeout, a reset
                why = str(getattr(exc, "reason", None) or exc) or type(exc).__name__
            if attempt + 1 < self.tries:
                time.sleep(max(0.0, self._left(self.backoff * 2 ** attempt)))
        self._gave_up(url, why, attempt + 1)
        return False

    def _left(self, seconds: float) -> float:
        """seconds, or less when close's deadline comes first."""
        if self.deadline is None:
            return seconds
        return min(seconds, self.deadline - time.monotonic())

    def _gave_up(self, url: str, why: str, tries: int) -> None:
        if url in self.given_up:
            return
        self.given_up.add(url)
        why = cleaned(why, self.hide)
        self.say(f"alerts: an alert was not delivered to {redacted_url(url)} after {tries} "
                 f"tr{'y' if tries == 1 else 'ies'} ({why}); further failures to it are not said")
