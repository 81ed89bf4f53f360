"""The views a run is watched through from outside its flow (cluster.launch): goodput's facts
taken as the events come, the live metrics, the alerts; and the run's end, recorded with its
goodput and drawn. Opened before the run's first event, closed however it ends."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from . import goodput, metrics, timeline_png
from . import timeline as tl
from .alerts import Notifier
from ..console import Console
from ..runs import RunDir


class RunViews:
    """views = RunViews(...); views.open(); ... views.ended(...); views.close() (always)."""

    def __init__(self, run: RunDir, timeline: tl.Recorder, console: Console, *,
                 launched: float | None = None, serve_at: metrics.Endpoint | None = None,
                 notify: Sequence[str] = (), secrets: Sequence[str] = ()) -> None:
        self.run, self.timeline, self.console, self.serve_at = run, timeline, console, serve_at
        self.facts = goodput.Facts()           # goodput's, as the events come
        timeline.listen(self.facts.add)
        if launched is not None:
            timeline.launched(launched)
        self.notifier: Notifier | None = None
        if notify:                             # told every event from the first
            self.notifier = Notifier(notify, run.run_id, secrets, console.info)
            timeline.listen(self.notifier.listen)
        self.served = metrics.Served()

    def open(self) -> None:
        """The metrics served, if asked (InputError: the port is taken), before any node is
        contacted."""
        self.served = metrics.serve_run(self.serve_at, self.timeline, self.run.run_id,
                                        self.console.info, goodput_of=self._so_far)

    def ended(self, attached: bool, **outcome: Any) -> None:
        """The outcome's event with the run's goodput (said, and drawn, for an attached run)."""
        self.timeline.event(tl.OUTCOME, **outcome, **self._goodput(attached))
        if attached:             # drawn beside the user's next command, never before it
            timeline_png.write_later(self.run, self.console)

    def close(self) -> None:
        self.served.stop()
        if self.notifier is not None:
            self.notifier.close()      # a few seconds at most for the finish (alerts.CLOSE_WAIT)

    def _so_far(self) -> float | None:
        """The goodput up to now, for a scrape (O(attempts), not a read of the events)."""
        found = self.facts.result(end=self.timeline.clock())
        return found["fraction"] if found else None

    def _goodput(self, said: bool) -> dict[str, Any]:
        """The run's goodput up to now: into run.json, said, and its headline for the
        outcome's event ({} when there is none: a detached run)."""
        try:
            found = self.facts.result(end=self.timeline.clock())
            if found is None:
                return {}
            self.run.update(goodput={k: v for k, v in found.items() if k != "segments"})
        except Exception as exc:  # a damaged record: the run's outcome matters more
            self.console.info(f"goodput not computed: {exc}")
            return {}
        if said:
            self.console.info(goodput.line(found))
        return {"goodput": {"fraction": found["fraction"], "wall": found["wall"],
                            "productive": found["productive"]}}
