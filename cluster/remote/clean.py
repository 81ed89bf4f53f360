"""`cluster clean` on one node: remove old run folders, <workdir>/.cluster/<run-id>, never one
that is running.

Standard library only, Python 3.8+. It travels on standard input with the supervisor, whose
own status and process identity decide what is running, in a bundle (backends/shipping.py).

    clean.py --workdir W --older-than SECONDS [--fresh SECONDS] [--dry-run]

Answers one JSON object (options.answer: framed): {"root": the .cluster folder, "runs": [{"id", "action": "removed" |
"would remove" | "kept", "why", "age", "bytes"}]}. Only folders named as cluster names runs
(YYYYmmdd-HHMMSS-xxxx) are looked at; anything else under .cluster (doctor's tools) is not ours
to remove. A run folder is kept, whatever its age, while any of its node folders (one per host
and attempt) has a supervisor alive, or a process of this user whose environment carries that
run's identity. It is kept too when it was active more recently than --older-than, and when it
holds a node folder that never started and is younger than --fresh (a launch may be checking
it right now). Symbolic links are never followed: a link is removed as a link.
"""
import os
import re
import shutil
import sys
import time

import options  # noqa: E402  (loaded before this module by the bootloader)
import rundir  # noqa: E402
import stopping  # noqa: E402
import supervisor  # noqa: E402

RUN_ID = re.compile(r"^(doctor-)?\d{8}-\d{6}-[0-9a-f]{4}\Z")   # doctor-: `cluster doctor --deep`
FRESH = 600.0


def main(argv):
    opts = parse(argv)
    root = os.path.join(os.path.expanduser(opts.workdir), ".cluster")
    runs = []
    if os.path.isdir(root):
        now = time.time()
        for name in sorted(os.listdir(root)):
            if RUN_ID.match(name):
                runs.append(decide(os.path.join(root, name), name, now, opts))
    options.answer({"root": root, "runs": runs})
    return 0


def parse(argv):
    return options.parse("clean.py", argv, {"workdir": str, "older-than": float, "fresh": FRESH},
                         ("dry-run",), required=("workdir", "older-than"))


def decide(path, name, now, opts):
    """What becomes of one run folder, and why; removes it unless told not to."""
    entry = {"id": name, "action": "kept", "why": "", "age": None, "bytes": None}
    if os.path.islink(path) or not os.path.isdir(path):
        entry["why"] = "not a plain directory"
        return entry
    nodes = node_dirs(path)
    age = now - last_active(path, nodes)
    entry["age"] = round(age, 1)
    if age < opts.older_than:           # kept anyway: no need to look for its processes
        entry["why"] = "active %s ago" % ago(age)
        return entry
    busy = [why for why in (running(d) for d in nodes) if why]
    if busy:
        entry["why"] = "; ".join(busy)
        return entry
    if age < opts.fresh and any(never_started(d) for d in nodes):
        entry["why"] = "a node folder that never started, %s old: a launch may be checking it" % ago(age)
        return entry
    entry["bytes"] = size(path)
    if opts.dry_run:
        entry["action"] = "would remove"
        return entry
    try:
        shutil.rmtree(path)
        entry["action"] = "removed"
    except OSError as exc:
        entry["why"] = "cannot remove: %s" % (exc.strerror or exc)
    return entry


def node_dirs(path):
    """The folders a supervisor (or a launch's check) made: <host>, <host>.<attempt>."""
    out = []
    for name in sorted(os.listdir(path)):
        d = os.path.join(path, name)
        if os.path.isdir(d) and not os.path.islink(d) and name != "train":
            out.append(d)
    return out


def running(d):
    """Why the run in node folder d is running, or None. The supervisor's own status, its
    liveness, and any process carrying the run's identity (a supervisor that died hard leaves
    its workers running)."""
    state = supervisor.status(d)
    if state.get("state") == "running" or stopping.supervisor_alive(d):
        return "running in %s (supervisor %s)" % (os.path.basename(d),
                                                  rundir.read_number(d, "supervisor.pid"))
    ident = stopping.identity(d, False)
    members = ident.members() if ident is not None else []
    if members:
        return "processes of the run still alive in %s: %s" % (
            os.path.basename(d), " ".join(str(p) for p in members[:8]))
    return None


def never_started(d):
    return not os.path.exists(os.path.join(d, "supervisor.pid")) and \
        not os.path.exists(os.path.join(d, "exit"))


def last_active(path, nodes):
    """When the run last did something: the newest modification time of the run folder and of
    the files in each of its folders (output.log, heartbeat, exit, the trainer's metrics). Not
    the folders' own times, nor __pycache__: before node programs ran with -B, reading a run's
    status cached the supervisor's modules there, which is no activity."""
    newest = mtime(path)
    for d in [path] + nodes + [os.path.join(path, "train")]:
        try:
            names = [n for n in os.listdir(d) if n != "__pycache__"]
        except OSError:
            continue
        files = [os.path.join(d, n) for n in names if not os.path.isdir(os.path.join(d, n))]
        newest = max([newest] + [mtime(f) for f in files] + ([] if files else [mtime(d)]))
    return newest


def mtime(p):
    try:
        return os.lstat(p).st_mtime
    except OSError:
        return 0.0


def size(path):
    total = 0
    for top, dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(top, name)).st_size
            except OSError:
                pass
    return total


def ago(seconds):
    for unit, span in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= span:
            return "%.0f%s" % (seconds / span, unit)
    return "%.0fs" % max(seconds, 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
