"""A node-side process's family: every process it started, however far they went (standard
library only, Python 3.8+). Imported by supervisor.py, which sits beside it.

A process can leave its run's identity behind: `setsid env -i sleep 1000 &` from a training
script is in a session of its own with an empty environment. It cannot leave its ancestry.
The supervisor makes itself a child subreaper (PR_SET_CHILD_SUBREAPER), so a process of the
run whose parent dies is re-parented to the supervisor, not to init: every live process of the
run is then a descendant of the supervisor. Such a process is ours by construction (its pid
cannot be reused while its parent has not reaped it), so stopping it breaks no identity rule.

The supervisor's own helpers (the container runtime's client, py-spy, `ip`) are descendants
too, but they share its session, which no process of the run can join (the run starts in a
session of its own, and a process may only move between groups of its own session): the
family is the descendants in other sessions.
"""
import ctypes
import os

PR_SET_CHILD_SUBREAPER = 36


def become_subreaper():
    """Orphans of this process's descendants come back to it; False where the kernel (Linux
    3.4+) or the C library cannot do it."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def stat(pid):
    """(state letter, parent, session) of a pid, or None when it is gone."""
    try:
        with open("/proc/%d/stat" % pid, "rb") as f:
            data = f.read().decode("ascii", "replace")
    except OSError:
        return None
    fields = data[data.rfind(")") + 2:].split()
    return fields[0], int(fields[1]), int(fields[3])


def start_time(pid):
    """When pid started, in clock ticks since boot: with the pid, a name no other process
    will ever have (a reused pid starts later). None when it is gone."""
    try:
        with open("/proc/%d/stat" % pid, "rb") as f:
            data = f.read().decode("ascii", "replace")
    except OSError:
        return None
    return int(data[data.rfind(")") + 2:].split()[19])


def cmdline(pid):
    """A process's arguments, or [] when it is gone."""
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return []


def table():
    """{pid: (state, parent, session)} of every process this user can see."""
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = stat(int(name))
            if st is not None:
                out[int(name)] = st
    return out


def members(root, procs=None):
    """The live descendants of root outside root's own session (its helpers)."""
    procs = table() if procs is None else procs
    own = procs.get(root)
    if own is None:
        return []
    children = {}
    for pid, (_state, parent, _sid) in procs.items():
        children.setdefault(parent, []).append(pid)
    found, todo = [], list(children.get(root, ()))
    while todo:
        pid = todo.pop()
        state, _parent, sid = procs[pid]
        if sid != own[2] and state not in ("Z", "X"):
            found.append(pid)
        todo.extend(children.get(pid, ()))
    return sorted(found)


def belongs(pid, root):
    """pid is a live descendant of root in another session than root's (checked now, one
    ancestor at a time)."""
    own, st = stat(root), stat(pid)
    if own is None or st is None or st[0] in ("Z", "X") or st[2] == own[2]:
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
    for pid, (state, parent, sid) in table().items():
        if parent == root and state == "Z" and sid != own[2] and pid not in keep:
            try:
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    reaped.append(pid)
            except ChildProcessError:
                continue
    return reaped
