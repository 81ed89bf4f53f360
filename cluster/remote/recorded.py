"""A run on this node asked after the fact, by the supervisor's `stop`, `status` and `logs`
(supervisor.py's commands): from the run folder's records and, for a stop, the run's own
supervisor while it lives. Beside supervisor.py in the run's folder, as its start left it.

Standard library only, Python 3.8+.
"""
import json
import os
import select
import signal
import stat
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import family  # noqa: E402  (beside this file on the node)
from rundir import path, read_json, read_number, write_atomic  # noqa: E402
from stopping import supervisor_alive, terminate  # noqa: E402


def stop(d, grace):
    ended = read_json(d, "exit")      # the run had ended before this stop: say so with its end
    # Tell the running supervisor (another process) that this end was asked for, and with
    # which grace (a stop's own may differ from the run's).
    write_atomic(d, "stop-requested", json.dumps({"at": time.time(), "grace": grace}))
    asked = ask_supervisor(d, grace)
    # Then by identity: a supervisor that is gone (or did not answer) stops nothing.
    report = terminate(d, grace)
    if asked:
        report = {"signalled": sorted(set(asked.get("signalled", [])) | set(report["signalled"])),
                  "killed": sorted(set(asked.get("killed", [])) | set(report["killed"])),
                  # what it left and is still there (pids; a container by its name), then ours
                  "left": [x for x in asked.get("left", [])
                           if not isinstance(x, int) or family.alive(x)]
                  + [x for x in report["left"] if x not in asked.get("left", [])],
                  "how": "kill" if report.get("expired") else asked.get("how")}
    if status(d)["state"] == "lost" and not report["left"]:
        # Its supervisor died without recording the end: this stop is the end, so that the run
        # reads as stopped from now on (cluster status, cluster clean), not lost forever.
        write_atomic(d, "exit", json.dumps({"code": None, "signal": None, "ended": time.time(),
                                            "leftovers": report["signalled"], "stopped": True,
                                            "reason": "stopped after its supervisor was lost"}))
    if ended is not None and not report["signalled"]:
        report["ended"] = {k: ended.get(k) for k in ("code", "signal", "stopped", "how",
                                                     "reason", "grace")}
    return report


def ask_supervisor(d, grace):
    """Have the run's own supervisor stop it (SIGTERM to it, verified to be it): it alone
    knows every process of its run, those that left the run's identity behind included.
    Its report from the exit record once it has ended; None without a live supervisor."""
    pid = read_number(d, "supervisor.pid")
    if not pid or not family.send(pid, signal.SIGTERM, lambda: supervisor_alive(d), grace + 30):
        return None
    return (read_json(d, "exit") or {}).get("stop")


def status(d):
    info = {"pgid": read_number(d, "pgid"), "started": None, "state": "unknown"}
    started = read_number(d, "started", float)
    info["started"] = started
    ended = read_json(d, "exit")
    if ended is not None:
        info.update(state="stopped" if ended.get("stopped") else "exited",
                    code=ended.get("code"), signal=ended.get("signal"),
                    ended=ended.get("ended"), reason=ended.get("reason"),
                    how=ended.get("how"), grace=ended.get("grace"))
        return info
    sup = read_number(d, "supervisor.pid")
    legacy = not os.path.exists(path(d, "supervisor.start"))     # an older supervisor's run
    if sup and (supervisor_alive(d) or (legacy and family.alive(sup))):
        info["state"] = "running"
        info["uptime"] = time.time() - started if started else None
    elif sup:
        info["state"] = "lost"
    return info


def logs(d, follow):
    """The node's output; following, until the run ends here, or the reader is gone: its
    input closes (an SSH channel's, a pipe's) when `cluster logs -f` is stopped by any means,
    even on a node that prints nothing."""
    out = sys.stdout.buffer
    try:
        f = open(path(d, "output.log"), "rb")
    except OSError:
        if not follow:
            return 1
        while not os.path.exists(path(d, "output.log")):
            if not reader_there(0, 0.2):
                return 0
        f = open(path(d, "output.log"), "rb")
    with f:
        while True:
            data = f.read(65536)
            if data:
                out.write(data)
                out.flush()
                continue
            if not follow or os.path.exists(path(d, "exit")) or status(d)["state"] == "lost":
                rest = f.read()
                out.write(rest)
                out.flush()
                return 0
            if not reader_there(0, 0.2):
                return 0


def reader_there(fd, seconds):
    """Wait up to `seconds`; False once input fd, the reader's end of a pipe or socket, has
    closed. Any other input (a terminal, /dev/null) says nothing: just the wait."""
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        mode = 0
    if not (stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)):
        time.sleep(seconds)
        return True
    if not select.select([fd], [], [], seconds)[0]:
        return True
    try:
        return bool(os.read(fd, 4096))
    except OSError:
        return False
