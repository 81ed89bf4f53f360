"""A node-side process's family: every process it started, however far they went (standard
library only, Python 3.8+). Imported by supervisor.py, which sits beside it.

A process can leave its run's identity behind: `setsid env -i sleep 1000 &` from a training
script is in a session of its own with an empty environment. It cannot leave its ancestry.
The supervisor makes itself a child subreaper (PR_SET_CHILD_SUBREAPER), so a process of the
run whose parent dies is re-parented to the supervisor, not to init: every live process of the
run is then a descendant of the supervisor. Such a process is ours by construction (its pid
cannot be reused while its parent has not reaped it), so stopping it breaks no identity rule.

Here too the plain reading of /proc this needs (a process's state, parent, group, session,
owner) and the one way a node-side program signals a process: with a handle to it held while
it is checked to be ours (send).

The supervisor's own helpers (the container runtime's client, py-spy, `ip`) are descendants
too, but they share its session, which no process of the run can join (the run starts in a
session of its own, and a process may only move between groups of its own session): the
family is the descendants in other sessions.
"""
import os
import select
import signal
import time

PR_SET_CHILD_SUBREAPER = 36


SUBREAPER = []  # type: list[int]  # [pid] once that process is a child subreaper


def become_subreaper():
    """Orphans of this process's descendants come back to it; False where the kernel (Linux
    3.4+) or the C library cannot do it."""
    try:
        ok = c_function("prctl")(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except Exception:       # _ctypes is private: any failure of it means "cannot", not a crash
        return False
    if ok:
        SUBREAPER[:] = [os.getpid()]
    return ok


def c_function(name):
    """A function of the C library that takes and returns ints, through _ctypes (the C half of
    ctypes, on which ctypes itself is built the same way): importing ctypes, whose module
    builds its many types at import, costs every node ~1.4 ms of CPU for this one call."""
    import _ctypes

    class Int(_ctypes._SimpleCData):            # ctypes.c_int
        _type_ = "i"

    class Function(_ctypes.CFuncPtr):           # ctypes.CDLL's functions
        _flags_ = _ctypes.FUNCFLAG_CDECL
        _restype_ = Int

    class Program:                              # ctypes.CDLL(None): this process's symbols
        _handle = _ctypes.dlopen(None, os.RTLD_NOW | os.RTLD_LOCAL)  # type: ignore[arg-type]

    return Function((name, Program))  # type: ignore[arg-type]  # any object with a _handle


def is_subreaper(pid):
    """pid is this process, made a child subreaper: all it started is among its descendants."""
    return SUBREAPER == [pid] == [os.getpid()]


def stat(pid):
    """(state letter, parent, process group, session) of a pid, or None when it is gone."""
    fields = stat_fields(pid)
    if fields is None:
        return None
    return fields[0], int(fields[1]), int(fields[2]), int(fields[3])


def stat_fields(pid):
    """/proc/PID/stat's fields after the command's name (the first is field 3, the state),
    or None when the pid is gone."""
    try:
        with open("/proc/%d/stat" % pid, "rb") as f:
            data = f.read().decode("ascii", "replace")
    except OSError:
        return None
    return data[data.rfind(")") + 2:].split()


def alive(pid):
    st = stat(pid)
    return st is not None and st[0] not in ("Z", "X")


def owner(pid):
    try:
        return os.stat("/proc/%d" % pid).st_uid
    except OSError:
        return None


def pids():
    for name in os.listdir("/proc"):
        if name.isdigit():
            yield int(name)


def send(pid, sig, still_ours, wait=0.0):
    """Send sig to pid only if still_ours() holds, checked while a handle to the process
    itself (a pidfd) is held where the kernel offers one: a pid reused meanwhile is never
    hit. With wait, then wait up to that many seconds for it to end (on the same handle,
    which says so the moment it does). True when it was sent."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        fd = None
    try:
        if not still_ours():
            return False
        if fd is not None and hasattr(signal, "pidfd_send_signal"):
            signal.pidfd_send_signal(fd, sig)
        else:
            os.kill(pid, sig)
        if wait > 0:
            until_gone(pid, fd, wait)
        return True
    except OSError:
        return False
    finally:
        if fd is not None:
            os.close(fd)


def until_gone(pid, fd, seconds):
    """Wait up to seconds for pid to end: its pidfd turns readable then; without one, look."""
    if fd is not None:
        select.select([fd], [], [], seconds)
        return
    deadline = time.time() + seconds
    while alive(pid) and time.time() < deadline:
        time.sleep(0.05)


def start_time(pid):
    """When pid started, in clock ticks since boot: with the pid, a name no other process
    will ever have (a reused pid starts later). None when it is gone."""
    try:
        with open("/proc/%d/stat" % pid, "rb") as f:
            data = f.read().decode("ascii", "replace")
    except OSError:
        return None
    return int(data[data.rfind(")") + 2:].split()[19])


def exit_status(pid):
    """How pid ended, as waitpid(2) puts it, read while it is a zombie (its parent has not
    collected it yet): /proc/PID/stat's exit_code (Linux 3.5+). None while it runs, once it
    was collected, or where the kernel does not say."""
    fields = stat_fields(pid)
    if fields is None or len(fields) < 50 or fields[0] not in ("Z", "X"):
        return None
    return int(fields[49])                  # field 52 of stat(5); fields[0] is field 3


def cmdline(pid):
    """A process's arguments, or [] when it is gone."""
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return []


def table():
    """{pid: (state, parent, process group, session)} of every process that can be seen."""
    out = {}
    for pid in pids():
        st = stat(pid)
        if st is not None:
            out[pid] = st
    return out


def children(pid):
    """pid's children, from the kernel's own lists (/proc/PID/task/TID/children, Linux 3.5+);
    None where the kernel keeps none (then only the whole table says)."""
    try:
        tids = os.listdir("/proc/%d/task" % pid)
    except OSError:
        return []
    found = []
    for tid in tids:
        try:
            with open("/proc/%d/task/%s/children" % (pid, tid), "rb") as f:
                found += [int(x) for x in f.read().split()]
        except FileNotFoundError:
            if os.path.isdir("/proc/%d/task/%s" % (pid, tid)):
                return None              # a kernel without CONFIG_PROC_CHILDREN
        except OSError:
            continue                     # that thread ended meanwhile
    return found


def descendants(root):
    """{pid: stat} of root and its descendants, walked down the kernel's child lists: the
    cost of the family, not of every process on the machine (on a node shared with other
    work, or test nodes that share one process table, that is thousands a look). The kernel
    may skip a child that ends while it is listed: fit for a poll that looks again, not for
    the last word (members() with the whole table is that). None where the lists are not
    kept."""
    out, todo = {}, [root]
    while todo:
        pid = todo.pop()
        st = stat(pid)
        if st is None:
            continue
        out[pid] = st
        kids = children(pid)
        if kids is None:
            return None
        todo.extend(k for k in kids if k not in out)
    return out


def members(root, procs=None):
    """The live descendants of root outside root's own session (its helpers)."""
    procs = table() if procs is None else procs
    own = procs.get(root)
    if own is None:
        return []
    children = {}  # type: dict[int, list[int]]
    for pid, st in procs.items():
        children.setdefault(st[1], []).append(pid)
    found, todo = [], list(children.get(root, ()))
    while todo:
        pid = todo.pop()
        state, _parent, _group, sid = procs[pid]
        if sid != own[3] and state not in ("Z", "X"):
            found.append(pid)
        todo.extend(children.get(pid, ()))
    return sorted(found)


def belongs(pid, root):
    """pid is a live descendant of root in another session than root's (checked now, one
    ancestor at a time)."""
    own, st = stat(root), stat(pid)
    if own is None or st is None or st[0] in ("Z", "X") or st[3] == own[3]:
        return False
    seen = 0
    while st is not None and seen < 4096:
        if st[1] == root:
            return True
        if st[1] <= 1:
            return False
        st, seen = stat(st[1]), seen + 1
    return False


def reap(root, keep=()):
    """Collect the exit of every child of root that has ended and came to it as an orphan
    (a child in another session, not one in `keep`, which their own waiters collect). Only
    root itself can reap its children: call it from root."""
    own = stat(root)
    if own is None:
        return []
    reaped = []
    kids = children(root)
    procs = table() if kids is None else {k: st for k in kids if (st := stat(k)) is not None}
    for pid, (state, parent, _group, sid) in procs.items():
        if parent == root and state == "Z" and sid != own[3] and pid not in keep:
            try:
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    reaped.append(pid)
            except ChildProcessError:
                continue
    return reaped
