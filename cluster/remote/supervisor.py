"""The per-node supervisor: written next to each node's launch.sh by the run's start (a bundle,
backends/shipping.py) and run by that node's python.

Standard library only, Python 3.8+, because it runs on whatever interpreter the node has.

    supervisor.py run DIR --run-id ID --node NAME [--detach] [--grace S] [--keepalive S]
    supervisor.py stop DIR [--grace S]            stop the run on this node; JSON report
    supervisor.py status DIR                      JSON: running / exited / stopped / lost
    (their JSON framed as every node program's answer: options.answer)
    supervisor.py logs DIR [--follow]             the node's output, following until it ends

`run` starts launch.sh in a session (process group) of its own, with the run id and node name
in its environment. Every process of the run inherits that environment, even the workers that
torchrun puts in sessions of their own, so stopping finds them all by identity, never by name.

Standard input is the launcher's control channel. Its first line is a JSON object: {"env":
{NAME: VALUE}} holds the secret environment, which therefore never touches a disk or a command
line. Then, without --detach, the launcher writes a heartbeat (any bytes) every few seconds, and
a line of one word asks: `stop` the run, `dump` every worker's stack, `finish` (every worker of
every node has exited 0: torchrun's own exit need not be waited out). The supervisor stops the run when that input closes (the launcher is gone) and, with --keepalive S,
when nothing has arrived for S seconds (the launcher is cut off: its connection may never close
if the network is down, and the work must not go on holding the node's GPUs). A detached run
has no launcher by design: it ignores its input after the first line and runs until it ends or
`stop` is asked for.

Stopping is by identity, verified before every signal (stopping.py): a process is signalled
only if its environment carries this run's id and node name, or it belongs to the run's process
group while that group is known to be ours (this supervisor is alive, or is the one stopping
it), or it descends from this supervisor. `stop`, `status` and `logs` are recorded.py's. Beside
it in the run's folder: recorded.py, stopping.py, rundir.py
(the folder's small files), containers.py (a container runtime's commands), workers.py
(torchrun's workers), family.py (a process's descendants), spawning.py (how the job starts).
"""
import json
import os
import select
import signal
import sys
import threading
import time

# Everything this process writes is private, from before it writes anything (logs and status
# files may hold what the run prints; Python's bytecode cache of the modules beside it). The
# job, and a command of cluster exec, get the umask it came with: the node login's, so their
# files are as the user's are.
USER_UMASK = os.umask(0o077)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import family  # noqa: E402  (beside this file on the node)
import options  # noqa: E402
import spawning  # noqa: E402
import workers  # noqa: E402
from rundir import path, read_json, read_number, write_atomic  # noqa: E402
from stopping import StopOnce, identity, terminate  # noqa: E402
from recorded import logs, status, stop  # noqa: E402,F401  (status: status.py and clean.py ask it here)

GRACE = 30.0
CONFIG_TIMEOUT = 30.0


def main(argv):
    args = parse(argv)
    os.makedirs(args.dir, exist_ok=True)
    if args.cmd == "run":
        leave(run(args, USER_UMASK))
    if args.cmd == "stop":
        report = stop(args.dir, args.grace)
        options.answer(report)
        return 0 if not report["left"] else 1
    if args.cmd == "status":
        options.answer(status(args.dir))
        return 0
    if args.cmd == "logs":
        return logs(args.dir, args.follow)
    return 2


def leave(code):
    """End this process with code once the run's end is recorded and told: os._exit, after a
    flush of what is still buffered. The interpreter's own shutdown (every module finalized;
    the daemon threads, those that watched the run, abandoned all the same) costs every
    node ~2.5 ms of CPU."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


# Each command's options: name -> default or type; its flags; its required options.
COMMANDS = {
    "run": ({"run-id": str, "node": str, "grace": GRACE, "keepalive": 0.0},
            ("detach", "own-restarts"),
            ("run-id", "node")),      # keepalive: stop when the launcher sent nothing so long (0: never)
    "stop": ({"grace": GRACE}, (), ()),
    "status": ({}, (), ()),
    "logs": ({}, ("follow",), ()),
}


def parse(argv):
    cmd = argv[0] if argv else None
    if cmd not in COMMANDS:
        raise SystemExit("supervisor.py: the first word is one of %s" % ", ".join(COMMANDS))
    opts, flags, required = COMMANDS[cmd]
    args = options.parse("supervisor.py " + cmd, argv[1:], opts, flags, ("dir",), required)
    args.cmd = cmd
    return args


# --- run -------------------------------------------------------------------------------------

def read_config(fd, timeout):
    """The launcher's first line on standard input (a JSON object); {} if none comes."""
    data = b""
    deadline = time.time() + timeout
    while not data.endswith(b"\n"):
        left = deadline - time.time()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return {}
        try:
            chunk = os.read(fd, 1)       # byte by byte: what follows the line is heartbeats
        except OSError:
            return {}
        if not chunk:
            break
        data += chunk
    try:
        config = json.loads(data.decode() or "{}")
    except ValueError:
        return {}
    return config if isinstance(config, dict) else {}


def run(args, user_umask=0o022):
    d = os.path.abspath(args.dir)
    config = read_config(0, CONFIG_TIMEOUT)
    secret_env = {str(k): str(v) for k, v in (config.get("env") or {}).items()}
    write_atomic(d, "tag", json.dumps({"run_id": args.run_id, "node": args.node}))
    if args.detach:
        started = daemonize(d)
        if started is not None:
            return started
    if os.path.exists(path(d, "stop-requested")):
        # A stop raced this start (another node failed to start): never begin.
        write_atomic(d, "exit", json.dumps({"code": None, "signal": None, "ended": time.time(),
                                            "leftovers": [], "stopped": True,
                                            "reason": "stop requested before the start"}))
        return 143
    # PYTHONFAULTHANDLER is on by default (the hang watchdog's stacks come through it); a user's
    # secret of that name wins, as an `env` entry of that name does (launch.sh exports it).
    env = {**os.environ, "PYTHONFAULTHANDLER": "1", **secret_env}
    env.update(CLUSTER_RUN_ID=args.run_id, CLUSTER_NODE=args.node,
               CLUSTER_HEARTBEAT_FILE=path(d, "heartbeat"))
    log = os.fdopen(os.open(path(d, "output.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600),
                    "ab", buffering=0)
    family.become_subreaper()        # whatever the run starts stays in this process's family
    child, output = spawning.start_job(["bash", path(d, "launch.sh")], env, user_umask)
    write_atomic(d, "pgid", str(child))
    child_start = family.start_time(child)     # its name with its pid (a pid is reused)
    write_atomic(d, "supervisor.start", str(family.start_time(os.getpid())))
    write_atomic(d, "supervisor.pid", str(os.getpid()))
    write_atomic(d, "started", repr(time.time()))

    watching = []  # type: list  # the watch on the workers' deaths, once started

    def stop_all(d, grace, we_supervise):
        # A stop after a worker's death finds torchrun without its worker: still a torchrun
        # after its workers (its short grace), since the watch saw them.
        seen = bool(watching and watching[0].seen)
        return terminate(d, grace, we_supervise, workers_seen=seen)
    stopper = StopOnce(d, args.grace, stop_all)
    stop_async = stopper.begin
    stopping, why, stoppers, done, graces = (stopper.stopping, stopper.why, stopper.threads,
                                             stopper.done, stopper.graces)

    def stop_requested():
        # The launcher's `stop` line: no process of its own on this node, one packet.
        write_atomic(d, "stop-requested", json.dumps({"at": time.time()}))
        stop_async("stopped by the launcher")

    def on_signal(signum, _frame):
        asked = read_json(d, "stop-requested")                 # `cluster down`'s word
        if asked is not None:
            stop_async("stop requested", (asked or {}).get("grace", args.grace))
        else:
            stop_async("supervisor got %s" % signal_name(signum))

    finishing = threading.Event()

    def finish():
        # The launcher's word once every worker of every node has exited 0: all that is left of
        # torchrun is its exit dance (a barrier among the agents, the store's teardown), which
        # the launcher need not wait out. Only where this node's workers all exited 0 and were
        # torchrun's, the job's own process: anything else stops the usual way.
        if not (watching and watching[0].told_done) or stopping.is_set() or ended.is_set():
            return
        if family.start_time(child) != child_start:
            return                     # collected already: its pid may be another's now
        finishing.set()
        try:
            os.kill(child, signal.SIGKILL)
        except OSError:
            pass

    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, on_signal)
    out = Out(None if args.detach else sys.stdout.buffer)
    tap = workers.Tap()
    ended, dumping = threading.Event(), threading.Event()
    pumping = threading.Lock()         # held while a chunk the pump read is on its way out
    deaths = None
    if not args.detach:
        out.write(("@@cluster pgid=%d\n" % child).encode())
        commands = {"dump": lambda: dump(d, tap, out, dumping), "stop": stop_requested,
                    "finish": finish}
        threading.Thread(target=watch_launcher, args=(0, args.keepalive, stop_async, commands),
                         daemon=True).start()
        deaths = None if args.own_restarts else watch_deaths(
            out, output, pumping, lambda: stopping.is_set() or ended.is_set() or dumping.is_set(),
            child)
        watching[:] = [deaths] if deaths else []
        workers.Progress(lambda: identity(d, True, os.getpid()), path(d, "heartbeat"),
                         out.record, ended, deaths.watch if deaths else None).start()
    pump = threading.Thread(target=copy_output, args=(output, log, out, tap, stop_async, pumping),
                            daemon=True)
    pump.start()
    threading.Thread(target=reap_orphans, args=(child, ended), daemon=True).start()
    code = spawning.wait_job(child)
    ended.set()
    if finishing.is_set():
        code = 0                       # every worker exited 0: the job is done
    if deaths is not None:
        deaths.close()
    grace = graces[0] if graces else args.grace
    for t in stoppers:                 # a stop in progress finishes its grace and its KILL first
        t.join(timeout=grace + 5)
    # torchrun's workers live in sessions of their own: if it died hard they are orphans now.
    leftovers = terminate(d, grace, True)
    pump.join(timeout=2.0)
    requested = os.path.exists(path(d, "stop-requested"))
    stopped = stopping.is_set() or requested
    # What was left after the last TERM/KILL, verified: the launcher's answer to its `stop`
    # (and `cluster down`'s, in the exit record), with how the stop went: every process
    # ended within the grace after SIGTERM ("term"), or the grace ran out ("kill").
    final = {key: sorted({pid for r in done + [leftovers] for pid in r[key]})
             for key in ("signalled", "killed")}  # type: dict[str, object]
    final["left"] = leftovers["left"]
    if not args.detach:
        reached = workers.progress_of(path(d, "heartbeat"))
        if reached:                    # the step this attempt reached, read after its end
            out.record({"progress": reached})
    had = max(r.get("workers", 0) for r in done + [leftovers])
    if had:
        # Workers to stop, or left by a torchrun that died: its rendezvous had completed.
        out.record({"workers": had})
    final["how"] = (("kill" if any(r.get("expired") for r in done + [leftovers]) else "term")
                    if stopped else None)
    result = {"code": code if code >= 0 else None, "signal": -code if code < 0 else None,
              "ended": time.time(), "leftovers": leftovers["signalled"], "stopped": stopped,
              "reason": (why[0] if why else ("stop requested" if requested else None)),
              "how": final["how"], "grace": grace, "stop": final,
              # every worker exited 0 and the launcher's `finish` ended torchrun's exit dance
              "finished": finishing.is_set()}
    try:
        write_atomic(d, "exit", json.dumps(result))
    except OSError as exc:        # a full disk: the launcher still gets the end, and the code
        out.record({"said": "the node's exit record could not be written: %s"
                            % (exc.strerror or exc)})
    out.record({"final": final})
    return code if code >= 0 else 128 - code


def watch_deaths(out, output, pumping, quiet, job):
    """The watch on torchrun's workers (workers.Deaths), started; None where the node has no
    pidfds. A worker's death that is a failure goes to the launcher at once, as a record:
    {"died": "rank R (pid P) died: signal 9", "rank": R, "pid": P}, after what the job wrote
    before it (output: the job's pipe; pumping: the pump's lock), where a dying worker's
    traceback is: the launcher names the error with the death. Every worker of the node
    exited 0 (and was the job's, `job`'s, own): {"done": [ranks]}, after their output too."""
    if not workers.Deaths.available():
        return None

    def report(rank, pid, cause):
        drained(output, 0.05)
        with pumping:
            out.record({"died": "rank %d (pid %d) died: %s" % (rank, pid, cause),
                        "rank": rank, "pid": pid})
    def done(ranks):
        drained(output, 0.05)
        with pumping:
            out.record({"done": ranks})
    deaths = workers.Deaths(report, quiet, done=done, job=job)
    deaths.start()
    return deaths


def drained(fd, seconds):
    """Wait up to `seconds` until the pipe fd holds no unread byte (the pump took them all)."""
    import fcntl                    # here, not above: a worker's death only
    import termios
    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            raw = fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0")
            left = int.from_bytes(raw, sys.byteorder, signed=True)
        except OSError:
            return
        if not left:
            return
        time.sleep(0.001)


def reap_orphans(child, ended, every=1.0):
    """Collect the exits of the run's processes that came to this supervisor as orphans, so
    none lingers as a zombie while the run goes on."""
    me = os.getpid()
    while not ended.wait(every):
        family.reap(me, keep=(child,))


def signal_name(num):
    try:
        return signal.Signals(num).name
    except ValueError:
        return "signal %d" % num


def daemonize(d):
    """Fork into a new session. In the parent, once the run has started: 0, the job's process
    group printed; or 1, why it did not start printed, as soon as the run's process has
    ended without starting it (a pipe it holds open closes) or after 30 s. None in the run's
    own process, whose errors go to supervisor.err in its folder."""
    r, w = os.pipe()
    pid = os.fork()
    if pid > 0:
        os.close(w)
        deadline = time.time() + 30
        while time.time() < deadline and not os.path.exists(path(d, "pgid")):
            if select.select([r], [], [], 0.02)[0]:      # its end: it is gone
                break
        os.waitpid(pid, 0)
        os.close(r)
        pgid = read_number(d, "pgid")
        if pgid is None:
            print("the run did not start on this node: %s" % why_not_started(d))
            return 1
        print(pgid)
        return 0
    os.close(r)
    os.setsid()
    if os.fork() > 0:
        os._exit(0)
    fd = os.open(os.devnull, os.O_RDWR)
    for target in (0, 1):
        os.dup2(fd, target)
    err = os.open(path(d, "supervisor.err"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(err, 2)
    return None


def why_not_started(d):
    """A failed detached start's reason: its exit record's, else its last error line."""
    ended = read_json(d, "exit") or {}
    if ended.get("reason"):
        return ended["reason"]
    try:
        with open(path(d, "supervisor.err"), errors="replace") as f:
            lines = [ln.strip() for ln in f.read().splitlines() if ln.strip()]
    except OSError:
        lines = []
    return lines[-1] if lines else "no job within 30 s"


def watch_launcher(fd, keepalive, on_lost, commands):
    """Stop the run when the launcher's input closes, or stays silent for `keepalive` s. Any
    bytes are a heartbeat; a line naming a command (`dump`) runs it."""
    pending = b""
    while True:
        try:
            ready = select.select([fd], [], [], keepalive if keepalive > 0 else None)[0]
            if not ready:
                on_lost("lost the launcher: no heartbeat for %g s" % keepalive)
                return
            data = os.read(fd, 4096)
        except (OSError, ValueError):
            break
        if not data:
            break
        pending += data
        *lines, pending = pending.split(b"\n")
        for line in lines:
            action = commands.get(line.strip().decode("ascii", "replace"))
            if action is not None:
                threading.Thread(target=action, daemon=True).start()
    on_lost("the launcher's connection closed")


class Out:
    """The supervisor's standard output (the launcher's stream, or None when detached): the
    node's output bytes, and control records framed by RS/US so that the launcher can take
    them out even where one falls between two halves of a line."""

    def __init__(self, stream):
        self.stream = stream
        self.lock = threading.Lock()

    def write(self, data):
        """Output: every RS in it doubled (nodes.Demux undoes it), so that nothing the job
        prints, a line like {"final": ...} framed by RS and US included, can open a record."""
        return self.send(data.replace(b"\x1e", b"\x1e\x1e"))

    def send(self, data):
        if self.stream is None:
            return True
        with self.lock:
            try:
                self.stream.write(data)
                self.stream.flush()
                return True
            except (OSError, ValueError):
                self.stream = None
                return False

    def record(self, obj):
        self.send(options.record(obj))


def copy_output(fd, log, out, tap, on_lost, pumping):
    """The job's output to the node's log and to the launcher, until the job's pipe ends. The
    only reader of that pipe: whatever fails on the way out, it keeps reading, or the job
    would block on a full pipe and hang."""
    attached = out.stream is not None
    while True:
        try:
            data = os.read(fd, 65536)
        except OSError:
            break
        if not data:
            break
        with pumping:
            log = to_log(log, data, out)
            tap.feed(data)
            sent = not attached or out.write(data)
        if not sent:
            attached = False
            on_lost("the launcher's connection closed")


def to_log(log, data, out):
    """Append data to the node's log; the log, or None once a write of it failed (a full
    disk, EIO): said once to the launcher, and the log is left as it was (whole up to
    there) while the output still streams."""
    if log is None:
        return None
    try:
        log.write(data)
        return log
    except OSError as exc:
        out.record({"said": "the node's log could not be written: %s, output still streamed"
                            % (exc.strerror or exc)})
        return None


def dump(d, tap, out, dumping):
    """Every worker's stack, for the launcher's hang watchdog: files under hang/, and one
    control record each. A worker's death from here on (faulthandler's SIGABRT) is no
    failure: the launcher stops the run after the dump."""
    dumping.set()
    ident = identity(d, True)
    found = workers.dump_stacks(ident, tap) if ident else []
    os.makedirs(path(d, "hang"), exist_ok=True)
    for rank, pid, how, text in found:
        with open(path(d, "hang/rank%d.txt" % rank), "w") as f:
            f.write(text)
        out.record({"stack": {"rank": rank, "pid": pid, "how": how, "text": text}})
    out.record({"dumped": len(found)})


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
