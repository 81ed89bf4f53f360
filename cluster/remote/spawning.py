"""How a run's job starts on a node (for supervisor.py; execute.py takes with_umask): launch.sh
as subprocess.Popen would start it, without importing subprocess.

Standard library only, Python 3.8+, loaded beside the supervisor (backends/shipping.py).
"""
import os
import signal
import sys


# The run's launch.sh is started as subprocess.Popen would (stdin /dev/null, stdout and stderr
# one pipe, a session of its own, every other descriptor closed, SIGPIPE and SIGXFSZ at their
# defaults), by os.posix_spawnp: the subprocess module's import (with locale) and its Popen
# cost every node ~4 ms of CPU. Popen stays where the C library cannot start a session.
# The fallback's Popen objects: one dropped while its child runs is reaped by the next Popen.
KEPT = []  # type: list


def start_job(argv, env, umask):
    """(pid, read end of its output) of argv, started with umask `umask`."""
    r, w = os.pipe()
    try:
        return spawn(argv, env, umask, w), r
    except BaseException:
        os.close(r)
        raise
    finally:
        os.close(w)


def spawn(argv, env, umask, out):
    actions = [(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDWR, 0),
               (os.POSIX_SPAWN_DUP2, out, 1), (os.POSIX_SPAWN_DUP2, out, 2)]
    actions += [(os.POSIX_SPAWN_CLOSE, fd) for fd in inherited_fds()]
    defaults = [getattr(signal, n) for n in ("SIGPIPE", "SIGXFZ", "SIGXFSZ") if hasattr(signal, n)]
    old = os.umask(umask)          # the child's: no other thread runs yet that writes a file
    try:
        return os.posix_spawnp(argv[0], argv, env, file_actions=actions, setsid=True,
                               setsigdef=defaults)
    except (AttributeError, NotImplementedError):   # no posix_spawn, or no setsid in it
        pass
    finally:
        os.umask(old)
    import subprocess
    KEPT.append(subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env,
                                 start_new_session=True, **with_umask(umask)))
    return KEPT[-1].pid


def inherited_fds():
    """The descriptors above 2 that a child would inherit (Popen's close_fds closes them)."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return []
    found = []
    for fd in (int(n) for n in names if int(n) > 2):
        try:
            if os.get_inheritable(fd):
                found.append(fd)
        except OSError:
            continue                   # the listing's own, closed by now
    return found


def wait_job(pid):
    """Its exit as Popen's returncode: the status, or -N when signal N ended it."""
    try:
        _, status = os.waitpid(pid, 0)
    except ChildProcessError:      # taken by another waiter: as Popen says then
        return 0
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def with_umask(mask):
    """Popen's arguments that start the child with umask `mask`."""
    if sys.version_info >= (3, 9):
        return {"umask": mask}
    return {"preexec_fn": lambda: os.umask(mask)}
