"""The supervisor's view of torchrun's workers on one node (standard library only, 3.8+).

Imported by supervisor.py, which sits beside it in the node's run directory, with family.py
(the /proc reading they share).

- Workers: torchrun's worker processes among the run's (they carry GROUP_RANK and RANK).
  torchrun starts them only once its rendezvous is complete, so a node that has them proves
  that the rendezvous of every node was; the supervisor says so when it stops them or finds
  them left at the end (the launcher's restart decision rests on that, never on a sample).
- Progress: reports once when every worker has joined the job (it holds a connection to the
  rendezvous store: init_process_group got that far), with the node's group rank, for the
  hang watchdog; then a beat whenever the reference trainer's heartbeat file moves.
- Deaths: the moment a worker dies (killed by a signal, or exited non-zero), which rank and
  how, for the launcher to stop every node at once instead of waiting for torchrun's own
  look at its workers: watched through pidfds, events (the job's own children are looked for
  every 0.1 s until they are all held), and says when every worker of the node exited 0.
- Stacks: for the launcher's hang watchdog, every worker's Python stack, each alone: py-spy
  where the node has it and may use it, else Python's own faulthandler (the node script sets
  PYTHONFAULTHANDLER) through SIGABRT, one worker at a time while torchrun is paused, so
  that its dump can be told from the others' and torchrun does not tear the rest down first.
"""
import json
import os
import re
import select
import signal
import threading
import time

import family  # beside this file on the node (its folder is on sys.path)

BEAT_EVERY = 1.0
LOOK_EVERY = 0.1        # seconds between the Deaths watch's looks for the job's own workers
PROC = "/proc"          # where the processes are read; a test gives a folder of its own


def environ(pid, proc=PROC):
    try:
        with open("%s/%d/environ" % (proc, pid), "rb") as f:
            return dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    except OSError:
        return {}


def workers_among(pids, proc=PROC):
    """[(pid, rank)] of torchrun's workers among pids (they carry GROUP_RANK and RANK)."""
    found = []
    for pid in pids:
        env = environ(pid, proc)
        if b"GROUP_RANK" in env and b"RANK" in env:
            try:
                found.append((pid, int(env[b"RANK"])))
            except ValueError:
                continue
    return sorted(found, key=lambda pr: pr[1])


def workers(ident):
    """[(pid, rank)] of this run's torchrun workers on this node."""
    return workers_among(ident.members(thorough=False))


def group_rank(pid, proc=PROC):
    try:
        return int(environ(pid, proc).get(b"GROUP_RANK", b"-1"))
    except ValueError:
        return -1


def sockets(pid, proc=PROC):
    """The inodes of a process's sockets."""
    found = set()
    try:
        for fd in os.listdir("%s/%d/fd" % (proc, pid)):
            try:
                link = os.readlink("%s/%d/fd/%s" % (proc, pid, fd))
            except OSError:
                continue
            if link.startswith("socket:["):
                found.add(link[8:-1])
    except OSError:
        pass
    return found


def connected_to(pid, port, proc=PROC):
    """Whether pid has (or had, with the connection still open) a TCP connection to port:
    a worker that reached the rendezvous store has joined the job."""
    mine = sockets(pid, proc)
    if not mine:
        return False
    want = ":%04X" % port
    for table in ("tcp", "tcp6"):
        try:
            with open("%s/%d/net/%s" % (proc, pid, table)) as f:
                next(f, None)
                for line in f:
                    fields = line.split()
                    if len(fields) > 9 and fields[2].endswith(want) and fields[9] in mine:
                        return True
        except OSError:
            continue
    return False


def joined(found, proc=PROC):
    """Every worker has connected to the rendezvous store (MASTER_PORT in its environment)."""
    for pid, _ in found:
        try:
            port = int(environ(pid, proc).get(b"MASTER_PORT", b"0"))
        except ValueError:
            return False
        if not port or not connected_to(pid, port, proc):
            return False
    return True


class Progress(threading.Thread):
    """Tells the launcher (through emit) when every worker has joined the job (reached the
    rendezvous store) and when the heartbeat moves: progress, for the hang watchdog. A sample,
    so it decides nothing else. found: told the workers of each look that finds some, until
    they have joined (the Deaths watch takes them from there)."""

    def __init__(self, ident_of, heartbeat_file, emit, done, found=None):
        super().__init__(daemon=True)
        self.ident_of, self.heartbeat_file, self.emit, self.done = ident_of, heartbeat_file, emit, done
        self.found = found

    def run(self):
        """Looks for the joined workers (a scan of /proc) every 0.25 s at first, less often
        (up to every 2 s) while they are not there yet, then never again; the heartbeat file
        (one stat) every 0.25 s."""
        done_joining, last_mtime, last_beat = False, None, 0.0
        pace = Pace()
        seen: dict = {}                 # step-times file -> its mtime when last sent
        at: dict = {}                   # the furthest "step" and "checkpoint" the ranks named
        scan_every, next_scan = 0.25, 0.0
        while not self.done.wait(0.25):
            if not done_joining and time.time() >= next_scan:
                ident = self.ident_of()
                found = workers(ident) if ident else []
                if found and self.found is not None:
                    self.found(found)
                if found and joined(found):
                    done_joining = True
                    self.emit({"joined": True, "group_rank": group_rank(found[0][0]),
                               "ranks": [r for _, r in found]})
                scan_every = min(2.0, scan_every * 1.5)
                next_scan = time.time() + scan_every
            try:
                mtime = os.stat(self.heartbeat_file).st_mtime
            except OSError:
                continue
            now = time.time()
            pace.look(mtime)
            if mtime != last_mtime and now - last_beat >= BEAT_EVERY:
                last_mtime, last_beat = mtime, now
                steps = step_times(self.heartbeat_file, seen, at)
                section = section_of(self.heartbeat_file)
                every = pace.report(mtime)
                self.emit({"beat": mtime, **({"steps": steps} if steps else {}),
                           **({"at": dict(at)} if at else {}),
                           **({"section": section} if section else {}),
                           **({"pace": round(every, 3)} if every else {})})


class Pace:
    """The job's own pace, which the beats reported (at most one every BEAT_EVERY) hide when it
    beats faster: the heartbeat file's changes seen between two reports (one stat every
    0.25 s) and its times. A job beating faster than the stats shows their pace, 0.25 s."""

    def __init__(self):
        self.seen = None          # the file's time at the last stat
        self.since = None         # its time at the last report
        self.changes = 0          # changes seen since that report

    def look(self, mtime):
        if mtime != self.seen:
            if self.seen is not None:
                self.changes += 1
            self.seen = mtime

    def report(self, mtime):
        """Seconds between the job's beats since the last report; None at the first."""
        every = None
        if self.since is not None and self.changes:
            every = (mtime - self.since) / self.changes
        self.since, self.changes = mtime, 0
        return every


class Deaths(threading.Thread):
    """Tells report(rank, pid, cause) the moment one of torchrun's workers on this node dies:
    killed by a signal ("signal 9") or exited non-zero ("exit code 1"). Once: the first death
    is the node's failure, on which the launcher stops every node, without waiting for
    torchrun to look at its workers and end.

    done(ranks): told once, when every worker of this node has exited 0 (as many as their
    LOCAL_WORLD_SIZE says) and their parent is the job's own process (`job`: launch.sh became
    torchrun, so nothing of the script follows it). What is left then is torchrun's exit
    dance, which the launcher, seeing every node, may end (supervisor.py's `finish`). The job's
    own children are looked at every 0.1 s (LOOK_EVERY, the pace of torchrun's own look at
    them) until all of its workers are held, so a job of a second is seen as well as one of a
    day; Progress's slower scan of the whole run tells the others (a launch script's
    grandchildren). A worker collected before it was looked at says nothing: no done.

    Each worker is held by a pidfd (Linux 5.3+, Python 3.9+), which the kernel makes readable
    the moment it ends: one poll() over them all, events and no timer once they are held. How
    it ended is read from /proc while it is a zombie, before torchrun collects it (torchrun
    looks every 0.1 s); one collected first says nothing. Where pidfds are not (available() is
    False) nothing is watched, and torchrun's own report stands, as before. quiet(): a death is
    no failure while it holds (the run is being stopped, or its stacks dumped)."""

    def __init__(self, report, quiet, done=None, job=None):
        super().__init__(daemon=True)
        self.report, self.quiet = report, quiet
        self.done, self.job = done, job
        self.told_done = False
        self.ended_ok = set()         # ranks whose worker exited 0
        self.sizes = {}               # pid -> (LOCAL_WORLD_SIZE, parent pid), read when taken
        self.lock = threading.Lock()
        self.pending = []             # [(pid, rank)] told by watch(), for the thread to take
        self.seen = set()             # every pid ever watched
        self.closed = False
        self.wake_r, self.wake_w = os.pipe()

    @staticmethod
    def available():
        return hasattr(os, "pidfd_open") and hasattr(select, "poll")

    def watch(self, found):
        """Watch these workers [(pid, rank)] too; those watched already are passed over."""
        with self.lock:
            new = [(pid, rank) for pid, rank in found if pid not in self.seen]
            if self.closed or not new:
                return
            self.seen.update(pid for pid, _ in new)
            self.pending += new
        self._wake()

    def close(self):
        with self.lock:
            if self.closed:
                return
            self.closed = True
        self._wake()

    def _wake(self):
        try:
            os.write(self.wake_w, b"!")
        except OSError:               # its thread has ended (it reported): nothing to wake
            pass

    def run(self):
        poller = select.poll()
        held = {}  # type: dict[int, tuple[int, int]]  # pidfd -> (pid, rank)
        poller.register(self.wake_r, select.POLLIN)
        try:
            while True:
                looking = self._looking()
                events = poller.poll(LOOK_EVERY * 1000 if looking else None)
                if looking and not events:
                    self.watch(workers_among(self._unseen(family.children(self.job) or ())))
                for fd, _ in events:
                    if fd == self.wake_r:
                        os.read(self.wake_r, 4096)
                        if not self._take(poller, held):
                            return
                        continue
                    pid, rank = held.pop(fd)
                    poller.unregister(fd)
                    status = family.exit_status(pid)
                    cause = failure(status)
                    os.close(fd)
                    if cause and not self.quiet():
                        self.report(rank, pid, cause)
                        return
                    if status == 0:
                        self._exited_ok(pid, rank)
        finally:
            for fd in held:
                os.close(fd)
            os.close(self.wake_r)

    def _take(self, poller, held):
        """Hold the workers told since the last look; False once closed."""
        with self.lock:
            if self.closed:
                return False
            new, self.pending = self.pending, []
        for pid, rank in new:
            try:
                fd = os.pidfd_open(pid)
            except OSError:                 # ended already (torchrun says then), or no pidfds
                continue
            held[fd] = (pid, rank)
            self.sizes[pid] = (local_world_size(pid), (family.stat(pid) or (0, 0))[1])
            poller.register(fd, select.POLLIN)
        return True

    def _unseen(self, pids):
        """pids not watched yet: an environment is read once a worker, not at every look."""
        with self.lock:
            return [pid for pid in pids if pid not in self.seen]

    def _own_sizes(self):
        """The LOCAL_WORLD_SIZE of each held worker that is the job's own child (0: a zombie's
        environment, empty, did not say)."""
        return [n for n, parent in self.sizes.values() if parent == self.job]

    def _looking(self):
        """Whether the job's own workers are still to be found: until as many are held as
        their LOCAL_WORLD_SIZE says (the size of one that ended before is unknown: look on)."""
        if self.job is None or self.done is None or self.told_done:
            return False
        own = self._own_sizes()
        return not any(own) or len(own) < max(own)

    def _exited_ok(self, pid, rank):
        """A worker exited 0: once every worker of this node has, tell done(). Only the job's
        own children count: a process a worker started (a DataLoader's) carries the ranks'
        variables too."""
        if self.sizes.get(pid, (0, 0))[1] != self.job:
            return
        self.ended_ok.add(rank)
        sizes = self._own_sizes()
        size = max(sizes)
        if (self.done is None or self.told_done or not size or len(self.ended_ok) < size
                or len(sizes) != size or self.quiet()):
            return
        self.told_done = True
        self.done(sorted(self.ended_ok))


def local_world_size(pid, proc=PROC):
    """How many workers torchrun started on this node, as a worker's environment says (0:
    it does not say)."""
    try:
        return int(environ(pid, proc).get(b"LOCAL_WORLD_SIZE", b"0"))
    except ValueError:
        return 0


def failure(status):
    """A worker's wait status in words when it is a failure ("signal 9", "exit code 1");
    None for an exit 0 or an unknown status."""
    if status is None:
        return None
    if os.WIFSIGNALED(status):
        return "signal %d" % os.WTERMSIG(status)
    if os.WIFEXITED(status) and os.WEXITSTATUS(status) != 0:
        return "exit code %d" % os.WEXITSTATUS(status)
    return None


SECTION = re.compile(r"section ([A-Za-z0-9_.-]{1,40})\s*")


def section_of(heartbeat_file):
    """The long pause the job says it is in: the heartbeat file holds `section NAME` (a
    checkpoint written, an evaluation; docs/failures.md), else None (a plain beat, whatever
    else the file holds)."""
    try:
        with open(heartbeat_file, "rb") as f:
            head = f.read(64).decode("ascii", "replace")
    except OSError:
        return None
    found = SECTION.fullmatch(head)
    return found.group(1) if found else None


def step_times(heartbeat_file, seen, at=None):
    """The ranks' own step times written since the last beat: {rank: [compute, data]}, from
    the files `<heartbeat>.steps.<RANK>` (one JSON line each; the protocol is in
    docs/failures.md). A file not rewritten since it was sent is left out (a finished or
    stuck rank reports nothing new); an unreadable one too. at: given, takes the furthest
    "step" and "checkpoint" those lines name, and the "saving" seconds (note_progress)."""
    folder, base = os.path.split(heartbeat_file)
    try:
        names = [n for n in os.listdir(folder or ".") if n.startswith(base + ".steps.")
                 and not n.endswith(".tmp")]
    except OSError:
        return {}
    found = {}
    for name in names:
        path = os.path.join(folder, name)
        try:
            mtime = os.stat(path).st_mtime
            if seen.get(path) == mtime:
                continue
            seen[path] = mtime
            with open(path) as f:
                line = json.loads(f.readline())
            if at is not None:
                note_progress(at, line)
            found[str(int(line["rank"]))] = [float(line["compute"]), float(line["data"])]
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
    return found


def note_progress(at, line):
    """Into `at`, the furthest training step done ("step") and the step of the newest
    checkpoint ("checkpoint") a rank's line names: the program's own counts, which only grow
    within an attempt, so a report that a look missed is in the next one."""
    for key in ("step", "checkpoint"):
        value = line.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            at[key] = max(at.get(key, value), value)
    saving = line.get("saving")      # seconds spent saving checkpoints so far (rank 0's)
    if isinstance(saving, (int, float)) and not isinstance(saving, bool) and 0 <= saving < 1e9:
        at["saving"] = max(at.get("saving", saving), saving)


def progress_of(heartbeat_file):
    """Every rank's last line read once more, after the workers ended: the step each attempt
    reached and its newest checkpoint, as {"step": S, "checkpoint": C} (either may be absent:
    a program that does not write them)."""
    at = {}  # type: dict
    step_times(heartbeat_file, {}, at)
    return at


class Tap:
    """A copy of the node's output while one worker dumps its stack."""

    def __init__(self):
        self.lock = threading.Lock()
        self.buf = None

    def feed(self, data):
        with self.lock:
            if self.buf is not None:
                self.buf.extend(data)

    def start(self):
        with self.lock:
            self.buf = bytearray()

    def stop(self):
        with self.lock:
            data, self.buf = bytes(self.buf or b""), None
        return data


def dump_stacks(ident, tap, wait=5.0):
    """[(rank, pid, how, text)] for every worker of the run on this node."""
    found = workers(ident)
    import shutil            # here, not above: its import costs every node of a launch 4 ms
    spy = shutil.which("py-spy")
    out, paused = [], []
    for pid, rank in found:
        text = py_spy(spy, pid) if spy else None
        if text is not None:
            out.append((rank, pid, "py-spy", text))
    rest = [(pid, rank) for pid, rank in found if rank not in {r for r, _, _, _ in out}]
    launcher = parent(found[0][0]) if found else None
    if rest and (launcher or ident.pgid):
        # torchrun would stop the others when the first worker dies: pause it. It is the
        # workers' parent (the group's leader, unless it runs in a container: then the
        # leader is the script, and torchrun a process of the run inside the container).
        if ident.signal(launcher or ident.pgid, signal.SIGSTOP):
            paused.append(launcher or ident.pgid)
    try:
        for pid, rank in rest:
            tap.start()
            ident.signal(pid, signal.SIGABRT)
            deadline = time.time() + wait
            while time.time() < deadline and family.alive(pid):
                time.sleep(0.05)
            time.sleep(0.2)                     # what it wrote last is still in the pipe
            out.append((rank, pid, "faulthandler", tap.stop().decode("utf-8", "replace")))
    finally:
        for pid in paused:
            ident.signal(pid, signal.SIGCONT)
    return out


def parent(pid):
    """The parent of pid, or None."""
    st = family.stat(pid)
    return (st[1] or None) if st else None


def py_spy(spy, pid):
    import subprocess        # here, not above: a hang's dump only
    try:
        res = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True,
                             timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout if res.returncode == 0 and res.stdout.strip() else None
