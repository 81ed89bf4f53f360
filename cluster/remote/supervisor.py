"""The per-node supervisor: copied next to each node's launch.sh and run by that node's python.

Standard library only, Python 3.8+, because it runs on whatever interpreter the node has.

    supervisor.py probe DIR [--port P --addr A]   facts for the preflight check, as JSON
    supervisor.py run DIR --run-id ID --node NAME [--detach] [--grace S]
    supervisor.py stop DIR [--grace S]            stop the run on this node; JSON report
    supervisor.py status DIR                      JSON: running / exited / lost
    supervisor.py logs DIR [--follow]             the node's output, following until it ends

`run` starts launch.sh in a session (process group) of its own, with the run id and node name
in its environment. Every process of the run inherits that environment, even the workers that
torchrun puts in sessions of their own, so stopping finds them all by identity, never by name.
Without --detach the supervisor also stops the run when its standard input closes: the
connection to `cluster up` is gone, and the work must not outlive it.
"""
import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

GRACE = 3.0
LAUNCHER_GRACE = 0.25


def main(argv=None):
    args = parse(argv)
    os.makedirs(args.dir, exist_ok=True)
    if args.cmd == "probe":
        return probe(args)
    if args.cmd == "run":
        return run(args)
    if args.cmd == "stop":
        report = stop(args.dir, args.grace)
        print(json.dumps(report))
        return 0 if not report["left"] else 1
    if args.cmd == "status":
        print(json.dumps(status(args.dir)))
        return 0
    if args.cmd == "logs":
        return logs(args.dir, args.follow)
    return 2


def parse(argv):
    p = argparse.ArgumentParser(prog="supervisor.py")
    sub = p.add_subparsers(dest="cmd", required=True)
    pr = sub.add_parser("probe")
    pr.add_argument("dir")
    pr.add_argument("--port", type=int)
    pr.add_argument("--addr")
    r = sub.add_parser("run")
    r.add_argument("dir")
    r.add_argument("--run-id", required=True)
    r.add_argument("--node", required=True)
    r.add_argument("--detach", action="store_true")
    r.add_argument("--grace", type=float, default=GRACE)
    s = sub.add_parser("stop")
    s.add_argument("dir")
    s.add_argument("--grace", type=float, default=GRACE)
    st = sub.add_parser("status")
    st.add_argument("dir")
    lg = sub.add_parser("logs")
    lg.add_argument("dir")
    lg.add_argument("--follow", action="store_true")
    return p.parse_args(argv)


# --- files in the node's run directory -------------------------------------------------------

def path(d, name):
    return os.path.join(d, name)


def write_atomic(d, name, text):
    tmp = path(d, "." + name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path(d, name))


def read_json(d, name):
    try:
        with open(path(d, name)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


# --- processes, by identity ------------------------------------------------------------------

def proc_state(pid):
    """(state letter, process group) of a pid, or None when it is gone."""
    try:
        with open("/proc/%d/stat" % pid, "rb") as f:
            data = f.read().decode("ascii", "replace")
    except OSError:
        return None
    fields = data[data.rfind(")") + 2:].split()
    return fields[0], int(fields[2])


def alive(pid):
    st = proc_state(pid)
    return st is not None and st[0] not in ("Z", "X")


def all_pids():
    for name in os.listdir("/proc"):
        if name.isdigit():
            yield int(name)


def tagged(run_id, node):
    """Live pids whose environment carries this run id and node name."""
    want = [("CLUSTER_RUN_ID=%s" % run_id).encode(), ("CLUSTER_NODE=%s" % node).encode()]
    me = os.getpid()
    found = []
    for pid in all_pids():
        if pid == me:
            continue
        try:
            with open("/proc/%d/environ" % pid, "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if all(w in env for w in want) and alive(pid):
            found.append(pid)
    return found


def group_members(pgid):
    out = []
    for pid in all_pids():
        st = proc_state(pid)
        if st and st[1] == pgid and st[0] not in ("Z", "X"):
            out.append(pid)
    return out


def kill_all(pids, sig):
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def terminate(d, grace):
    """TERM every process of the run on this node, wait up to `grace`, KILL, verify."""
    tag = read_json(d, "tag") or {}
    ended = os.path.exists(path(d, "exit"))
    pgid = None if ended else read_number(d, "pgid")  # an ended run's group id may be reused

    def targets():
        pids = set(tagged(tag.get("run_id"), tag.get("node"))) if tag else set()
        if pgid:
            pids.update(group_members(pgid))
        pids.discard(os.getpid())
        return sorted(pids)

    first = targets()
    group = set()
    if pgid:
        group = set(group_members(pgid))
        try:
            os.killpg(pgid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
    # One TERM each: a second one interrupts torchrun's own shutdown of its workers.
    kill_all([p for p in first if p not in group], signal.SIGTERM)
    deadline = time.time() + grace
    left = targets()
    while left and time.time() < deadline:
        time.sleep(0.05)
        left = targets()
        if pgid and left == [pgid]:
            # Only the launcher (torchrun) is left, its workers are gone: it has nothing more to
            # save, and its interpreter takes over a second to exit. A short grace, then KILL.
            deadline = min(deadline, time.time() + LAUNCHER_GRACE)
    killed = list(left)
    kill_all(left, signal.SIGKILL)
    deadline = time.time() + 2.0
    while left and time.time() < deadline:
        time.sleep(0.05)
        left = targets()
    return {"signalled": first, "killed": killed, "left": left}


def read_number(d, name, kind=int):
    """The number in one of the run directory's small files, or None."""
    try:
        with open(path(d, name)) as f:
            return kind(f.read().strip())
    except (OSError, ValueError):
        return None


# --- probe -----------------------------------------------------------------------------------

def probe(args):
    import importlib.util
    facts = {"home": os.path.expanduser("~"), "python": sys.version.split()[0],
             "executable": sys.executable, "hostname": socket.gethostname()}
    spec = importlib.util.find_spec("torch")
    facts["torch"] = None
    if spec and spec.origin:
        run_py = os.path.join(os.path.dirname(spec.origin), "distributed", "run.py")
        facts["torch"] = run_py if os.path.exists(run_py) else None
    if args.port:
        facts["port_free"] = port_free(args.addr or "0.0.0.0", args.port)
    print(json.dumps(facts))
    return 0


def port_free(addr, port):
    s = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind((addr, port))
        return True
    except OSError:
        return False
    finally:
        s.close()


# --- run -------------------------------------------------------------------------------------

def run(args):
    d = os.path.abspath(args.dir)
    write_atomic(d, "tag", json.dumps({"run_id": args.run_id, "node": args.node}))
    if args.detach and daemonize(d):
        return 0
    env = dict(os.environ, CLUSTER_RUN_ID=args.run_id, CLUSTER_NODE=args.node)
    log = open(path(d, "output.log"), "ab", buffering=0)
    child = subprocess.Popen(["bash", path(d, "launch.sh")], stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                             start_new_session=True)
    write_atomic(d, "pgid", str(child.pid))
    write_atomic(d, "supervisor.pid", str(os.getpid()))
    write_atomic(d, "started", repr(time.time()))

    stopping = threading.Event()

    def stop_async(*_):
        if not stopping.is_set():
            stopping.set()
            threading.Thread(target=terminate, args=(d, args.grace), daemon=True).start()

    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, stop_async)
    if not args.detach:
        header = ("@@cluster pgid=%d\n" % child.pid).encode()
        sys.stdout.buffer.write(header)
        sys.stdout.buffer.flush()
        threading.Thread(target=watch_stdin, args=(stop_async,), daemon=True).start()
    pump = threading.Thread(target=copy_output, args=(child.stdout, log, not args.detach, stop_async),
                            daemon=True)
    pump.start()
    code = child.wait()
    # torchrun's workers live in sessions of their own: if it died hard they are orphans now.
    leftovers = terminate(d, args.grace)
    pump.join(timeout=2.0)
    result = {"code": code if code >= 0 else None, "signal": -code if code < 0 else None,
              "ended": time.time(), "leftovers": leftovers["signalled"],
              "stopped": stopping.is_set() or os.path.exists(path(d, "stop-requested"))}
    write_atomic(d, "exit", json.dumps(result))
    return code if code >= 0 else 128 - code


def daemonize(d):
    """Fork into a new session; True in the parent once the run has started."""
    pid = os.fork()
    if pid > 0:
        deadline = time.time() + 30
        while time.time() < deadline and not os.path.exists(path(d, "pgid")):
            time.sleep(0.02)
        os.waitpid(pid, 0)
        print(read_number(d, "pgid"))
        return True
    os.setsid()
    if os.fork() > 0:
        os._exit(0)
    fd = os.open(os.devnull, os.O_RDWR)
    for target in (0, 1, 2):
        os.dup2(fd, target)
    return False


def watch_stdin(on_eof):
    try:
        while os.read(0, 4096):
            pass
    except OSError:
        pass
    on_eof()


def copy_output(pipe, log, to_stdout, on_lost):
    out = sys.stdout.buffer if to_stdout else None
    fd = pipe.fileno()
    while True:
        try:
            data = os.read(fd, 65536)
        except OSError:
            break
        if not data:
            break
        log.write(data)
        if out is not None:
            try:
                out.write(data)
                out.flush()
            except OSError:
                out = None
                on_lost()


# --- stop, status, logs ------------------------------------------------------------------------

def stop(d, grace):
    # Tell the running supervisor (another process) that this end was asked for.
    write_atomic(d, "stop-requested", repr(time.time()))
    return terminate(d, grace)


def status(d):
    info = {"pgid": read_number(d, "pgid"), "started": None, "state": "unknown"}
    started = read_number(d, "started", float)
    info["started"] = started
    ended = read_json(d, "exit")
    if ended is not None:
        info.update(state="stopped" if ended.get("stopped") else "exited",
                    code=ended.get("code"), signal=ended.get("signal"),
                    ended=ended.get("ended"))
        return info
    sup = read_number(d, "supervisor.pid")
    if sup and alive(sup):
        info["state"] = "running"
        info["uptime"] = time.time() - started if started else None
    elif sup:
        info["state"] = "lost"
    return info


def logs(d, follow):
    out = sys.stdout.buffer
    try:
        f = open(path(d, "output.log"), "rb")
    except OSError:
        if not follow:
            return 1
        while not os.path.exists(path(d, "output.log")):
            time.sleep(0.2)
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
            time.sleep(0.2)


if __name__ == "__main__":
    sys.exit(main())
