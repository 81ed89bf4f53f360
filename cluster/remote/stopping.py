"""How a run is stopped on its node: by identity, never by name. A process is the run's if its
environment carries the run's id and node name, or it is of the run's process group while that
group is known to be ours (its supervisor is alive, or is the one stopping it), or it descends
from the run's live supervisor (a child subreaper). Each gets one TERM, the grace, then KILL,
and the last look verifies that none is left (sweep). A run whose torchrun is in a container is
stopped by the container's name first (terminate_container). The live supervisor begins its
run's stop once, whoever asks first (StopOnce).

Standard library only, Python 3.8+; beside supervisor.py in the node's run directory, whose
`run` and `stop` use it, as do `cluster clean` and `cluster exec` (clean.py, execute.py).
"""
import math
import os
import signal
import threading
import time

import containers  # noqa: E402  (beside this file on the node, or loaded before it)
import family  # noqa: E402
import workers  # noqa: E402
from rundir import path, read_json, read_number  # noqa: E402

LAUNCHER_GRACE = 0.05

alive, owner = family.alive, family.owner      # /proc, read plainly


class Identity:
    """This run on this node: its tagged environment, and its process group while trusted."""

    def __init__(self, run_id, node, pgid=None, group_trusted=False, root=None):
        self.want = [("CLUSTER_RUN_ID=%s" % run_id).encode(), ("CLUSTER_NODE=%s" % node).encode()]
        self.pgid = pgid
        self.group_trusted = bool(pgid) and group_trusted
        self.root = root            # the supervisor, when it is this process: its family is ours

    def tagged(self, pid):
        try:
            with open("/proc/%d/environ" % pid, "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            return False
        return all(w in env for w in self.want)

    def owns(self, pid):
        if not alive(pid):
            return False
        if self.tagged(pid):
            return True
        st = family.stat(pid)
        if self.group_trusted and st is not None and st[2] == self.pgid:
            return True
        return bool(self.root) and family.belongs(pid, self.root)

    def members(self, thorough=True):
        """Every live process of the run on this node (never this supervisor). Only this
        user's processes can carry our identity or be signalled by us: the others are passed
        over on their owner, without reading their environment.

        Not thorough, in the run's live supervisor (a child subreaper: whatever the run
        started is its descendant): its family alone, walked down the kernel's child lists,
        at the cost of the run's own processes rather than of every process there (polls
        four times a second, on a node that may hold thousands). The last look of a stop that
        signalled anything is thorough."""
        me, uid = os.getpid(), os.getuid()
        if not thorough and self.root and family.is_subreaper(self.root):
            procs = family.descendants(self.root)
            if procs is not None:
                return [pid for pid in family.members(self.root, procs) if pid != me]
        procs = family.table()              # one read of each process's state, for all below
        kin = set(family.members(self.root, procs)) if self.root else set()
        found = []
        for pid, (state, _parent, group, _sid) in procs.items():
            if pid == me or state in ("Z", "X") or (uid != 0 and owner(pid) != uid):
                continue
            if pid in kin or (self.group_trusted and group == self.pgid) or self.tagged(pid):
                found.append(pid)
        return sorted(found)

    def reap(self):
        """The supervisor collects its orphans' exits (its own child is its Popen's)."""
        if self.root == os.getpid():
            family.reap(self.root, keep=(self.pgid,))

    def signal(self, pid, sig):
        """Send sig to pid only if it is still ours (family.send: checked with a handle to the
        process held, so a pid reused meanwhile is never hit)."""
        return family.send(pid, sig, lambda: self.owns(pid))


def identity(d, trust_group, root=None):
    """The run's identity from its directory; None before the run was ever started here.
    root: this process, when it is the run's supervisor (its family is the run's)."""
    tag = read_json(d, "tag")
    if not tag:
        return None
    ended = os.path.exists(path(d, "exit"))
    pgid = None if ended else read_number(d, "pgid")
    return Identity(tag.get("run_id"), tag.get("node"), pgid, trust_group and not ended, root)


def supervisor_alive(d):
    """The supervisor that started the run in d is still running (so its group id is ours):
    its pid names the process that started when it recorded (a reused pid started later)."""
    pid = read_number(d, "supervisor.pid")
    if not pid or not alive(pid):
        return False
    born = read_number(d, "supervisor.start")
    if born is None:              # an older supervisor's record: its command line names d
        return os.path.abspath(d).encode() in family.cmdline(pid)
    return family.start_time(pid) == born


def terminate(d, grace, we_supervise=False, workers_seen=False):
    """TERM every process of the run on this node, wait up to `grace`, KILL, verify.
    workers_seen: the live supervisor saw torchrun's workers (one may have died since)."""
    ident = identity(d, we_supervise or supervisor_alive(d), os.getpid() if we_supervise else None)
    if ident is None:
        return {"signalled": [], "killed": [], "left": []}
    container = container_record(d)
    if container is not None:
        return terminate_container(ident, container, grace)
    return sweep(ident, grace, workers_seen)


def sweep(ident, grace, workers_seen=False):
    """TERM each process of the run once, wait up to `grace`, KILL the rest, verify. The
    report counts torchrun's workers among them: proof that the rendezvous had completed."""
    first = ident.members(thorough=False)      # thorough unless the live supervisor asks
    had = len(workers.workers_among(first))
    # One TERM each: a second one interrupts torchrun's own shutdown of its workers.
    signalled = [pid for pid in first if ident.signal(pid, signal.SIGTERM)]
    deadline = time.time() + grace
    left, launcher_only = still(ident, first), False
    while left and time.time() < deadline:
        time.sleep(0.05)
        ident.reap()
        left = still(ident, first)
        # Only when workers were there at the first look: a group leader alone between its own
        # steps (a shell trapping TERM between two sleeps) is not a torchrun after its workers.
        launcher_only = (had > 0 or workers_seen) and bool(ident.pgid) and left == [ident.pgid]
        if launcher_only:
            # Only the launcher (torchrun) is left, its workers are gone: it has nothing more to
            # save, and its interpreter takes 0.2-0.7 s to exit (its traceback, its final
            # garbage collection), the longest part of a stop. A moment, then KILL.
            deadline = min(deadline, time.time() + LAUNCHER_GRACE)
    # The grace ran out on work that was still going (not on torchrun after its workers).
    expired = bool(left) and not launcher_only
    killed = [pid for pid in left if ident.signal(pid, signal.SIGKILL)]
    deadline = time.time() + 2.0
    while left and time.time() < deadline:
        time.sleep(0.05)
        ident.reap()
        left = still(ident, first)
    if signalled:
        left = ident.members()      # the last word: every process there looked at
    return {"signalled": signalled, "killed": killed, "left": left, "workers": had,
            "expired": expired}


def still(ident, first):
    """Which of the run's processes are left, looked at as cheaply as holds: the live
    supervisor's family (complete: it is a child subreaper), and any of the first look
    outside it (a stop by another process looks at every process first), each asked by
    itself. The stop's last look, once it signalled anything, is thorough: a process of the
    run outside the family would be named there as left, never missed."""
    kin = ident.members(thorough=False)
    mine = set(kin)
    return sorted(mine | {pid for pid in first if pid not in mine and ident.owns(pid)})


# --- the run's container, by its name -----------------------------------------------------------

RUNTIMES = ("docker", "podman")
CLIENT_GRACE = 5.0         # the script and the runtime's client, once their container is gone


def container_record(d):
    """The run's container on this node, {"runtime", "name"} (written beside launch.sh before
    the start), or None when the run does not use one."""
    rec = read_json(d, "container.json")
    if isinstance(rec, dict) and rec.get("runtime") in RUNTIMES and rec.get("name"):
        return rec
    return None


def runtime(container, *args, timeout=60.0):
    """(exit code, what it said) of the container's runtime; code None when it could not run
    or did not answer within timeout."""
    code, _out, said = containers.runtime_call([container["runtime"]] + list(args), timeout,
                                              own_session=False)
    return code, said


def container_exists(container):
    """True, False, or None when the runtime could not say (its daemon is down...)."""
    code, out = runtime(container, "container", "inspect", "--format", "{{.Id}}", container["name"])
    if code == 0:
        return True
    if code is not None and "no such" in out.lower():
        return False
    return None


def terminate_container(ident, container, grace):
    """Stop a run whose torchrun is in a container, by the container's name. Its runtime's
    `stop` sends TERM to the container's init, which passes it to torchrun (one TERM, as
    torchrun wants), and KILL after the grace: this reaches the container's processes even
    where this user cannot see them (a root daemon's). The script and the runtime's client end
    with the container. Whatever of the run is still on the node then (a container that never
    started, a runtime that did not answer) is stopped like any run's; last, the container
    must be gone."""
    t0 = time.time()
    before = ident.members()
    runtime(container, "stop", "-t", str(int(math.ceil(grace))), container["name"], timeout=grace + 30)
    deadline = time.time() + CLIENT_GRACE
    while ident.members() and time.time() < deadline:
        time.sleep(0.05)
    report = sweep(ident, max(1.0, grace - (time.time() - t0)))
    report["signalled"] = sorted(set(before) | set(report["signalled"]))
    report["workers"] = max(report["workers"], len(workers.workers_among(before)))
    if container_exists(container) is not False:
        runtime(container, "rm", "--force", container["name"], timeout=grace + 30)
    deadline = time.time() + CLIENT_GRACE
    present = container_exists(container)
    while present is not False and time.time() < deadline:
        time.sleep(0.2)
        present = container_exists(container)
    if present is not False:
        report["left"] = report["left"] + ["container %s%s" % (
            container["name"], "" if present else " (%s did not answer)" % container["runtime"])]
    return report


class StopOnce:
    """The run's stop on this node, begun once whoever asks first: the launcher's `stop`, its
    connection closing, its stream failing, the keepalive, a signal (several of them come
    together when the launcher disappears). A second begin would TERM torchrun a second
    time, which interrupts its own shutdown of its workers."""

    def __init__(self, d, grace, terminate=terminate):
        self.d, self.grace, self.terminate = d, grace, terminate
        self.once = threading.Lock()       # taken by the first begin, never given back
        self.stopping = threading.Event()  # a stop has begun
        self.why, self.graces = [], []     # its reason and its grace
        self.threads, self.done = [], []   # its thread, and what it did

    def begin(self, reason, grace=None):
        # Not blocking: a signal handler that runs inside a begin of the main thread (two
        # signals in a row) must not wait for it, only see that it is taken.
        if not self.once.acquire(False):
            return False
        grace = self.grace if grace is None else grace
        self.why.append(reason)
        self.graces.append(grace)
        self.stopping.set()
        t = threading.Thread(target=lambda: self.done.append(self.terminate(self.d, grace, True)),
                             daemon=True)
        t.start()                  # before the main thread can see it: it joins what it finds
        self.threads.append(t)
        return True
