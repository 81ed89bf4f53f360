"""A node's word on a run, for `cluster status` and `cluster top`, in one round trip.

Standard library only, Python 3.8+. It travels in a bundle (backends/shipping.py); the status
itself comes from the supervisor the run's start left in the run's folder (the one that runs
the run), imported from there.

    status.py --dir DIR [--gpus] [--metrics PATH [--lines N]]

One JSON line: {"status": the supervisor's status, or {"state": "gone"} when DIR is no longer
there (cluster clean removed it: nothing of the run can be running from it); "gpus": with
--gpus, nvidia-smi's CSV lines (index, utilization %, memory used, total MiB), null without
nvidia-smi; "metrics": with --metrics, the last N lines of that file, null when it is not
there}.
"""
import json
import os
import subprocess
import sys

GPU_QUERY = "index,utilization.gpu,memory.used,memory.total"


def main(argv):
    opts = parse(argv)
    out = {"status": status(opts["dir"])}
    if opts["gpus"]:
        out["gpus"] = gpus()
    if opts["metrics"]:
        out["metrics"] = tail(os.path.expanduser(opts["metrics"]), int(opts["lines"]))
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()
    return 0


def parse(argv):
    opts = {"dir": None, "gpus": False, "metrics": None, "lines": "20"}
    it = iter(argv)
    for arg in it:
        if arg == "--gpus":
            opts["gpus"] = True
        elif arg in ("--dir", "--metrics", "--lines"):
            opts[arg[2:]] = next(it)
        else:
            raise SystemExit("status.py: unknown argument %r" % arg)
    if not opts["dir"]:
        raise SystemExit("status.py: --dir is required")
    return opts


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


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
