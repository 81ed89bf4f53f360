"""A node's word on a run, for `cluster status` and `cluster top`, in one round trip.

Standard library only, Python 3.8+. It travels in a bundle (backends/shipping.py); the status
itself comes from the supervisor the run's start left in the run's folder (the one that runs
the run), imported from there.

    status.py --dir DIR [--gpus] [--metrics PATH [--lines N]] [--steps HEARTBEAT]

One JSON object (options.answer: framed): {"status": the supervisor's status, or {"state": "gone"} when DIR is no longer
there (cluster clean removed it: nothing of the run can be running from it); "gpus": with
--gpus, nvidia-smi's CSV lines (index, utilization %, memory used, total MiB), null without
nvidia-smi; "metrics": with --metrics, the last N lines of that file, null when it is not
there; "steps": with --steps, what each rank of the node last said of its steps in
`HEARTBEAT.steps.<RANK>` (the protocol is in docs/failures.md): a list of {"rank", "rate" (steps
per second: the line's "rate" where it has one, else steps / seconds, null with neither),
"seconds", "compute", "data", "age" (seconds since the file was written)}, sorted by rank, an
unreadable or partial file left out}.
"""
import json
import os
import subprocess
import sys
import time

import options  # noqa: E402  (loaded before this module by the bootloader)

GPU_QUERY = "index,utilization.gpu,memory.used,memory.total"


def main(argv):
    opts = parse(argv)
    out = {"status": status(opts.dir)}
    if opts.gpus:
        out["gpus"] = gpus()
    if opts.metrics:
        out["metrics"] = tail(os.path.expanduser(opts.metrics), opts.lines)
    if opts.steps:
        out["steps"] = steps(os.path.expanduser(opts.steps))
    options.answer(out)
    return 0


def parse(argv):
    return options.parse("status.py", argv, {"dir": str, "metrics": str, "lines": 20, "steps": str},
                         ("gpus",), required=("dir",))


def status(d):
    d = os.path.expanduser(d)
    if not os.path.isdir(d):
        return {"state": "gone"}
    sys.path.insert(0, d)
    import supervisor  # noqa: E402  (the run's own, in its folder)
    return supervisor.status(d)


def gpus():
    try:
        res = subprocess.run(["nvidia-smi", "--query-gpu=" + GPU_QUERY,
                              "--format=csv,noheader,nounits"], stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, timeout=15)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = [line.strip() for line in res.stdout.decode(errors="replace").splitlines()]
    return [line for line in lines if line] or None


def tail(path, lines):
    """The file's last lines (a line being written may be cut: the reader skips it)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 65536))
            data = f.read()
    except OSError:
        return None
    return data.decode(errors="replace").splitlines()[-lines:]


def steps(heartbeat, now=None):
    """Each rank's last step report beside the heartbeat file, with the file's age."""
    folder, base = os.path.split(heartbeat)
    try:
        names = sorted(n for n in os.listdir(folder or ".")
                       if n.startswith(base + ".steps.") and not n.endswith(".tmp"))
    except OSError:
        return []
    now = time.time() if now is None else now
    found = []
    for name in names:
        report = step_report(os.path.join(folder, name), now)
        if report is not None:
            found.append(report)
    return sorted(found, key=lambda r: r["rank"])


def step_report(path, now):
    """One file's line as {rank, rate, seconds, compute, data, age}; None when it cannot be
    read or is not a whole line of the protocol (a writer that does not rename may be cut)."""
    try:
        age = now - os.stat(path).st_mtime
        with open(path) as f:
            line = json.loads(f.readline())
        rank, compute, data = int(line["rank"]), float(line["compute"]), float(line["data"])
        n = line.get("steps")
        seconds = line.get("seconds")
        seconds = float(seconds) if seconds is not None else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    rate = line.get("rate")         # over a longer window, the same steps on every node
    if not (isinstance(rate, (int, float)) and not isinstance(rate, bool) and 0 < rate < 1e12):
        rate = None
        if isinstance(n, (int, float)) and seconds is not None and seconds > 0 and n > 0:
            rate = n / seconds
    return {"rank": rank, "rate": rate, "seconds": seconds, "compute": compute, "data": data,
            "age": max(0.0, age)}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
