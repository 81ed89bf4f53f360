"""`cluster exec` on one node: run a command in a session of its own, stream its output, and
stop it by identity when the launcher asks or goes away.

Standard library only, Python 3.8+. It travels on standard input with the supervisor (whose
process identity and stopping it uses), in a bundle (backends/shipping.py): nothing is copied
to the node.

    execute.py --id ID --node NAME [--cwd DIR] [--grace S] [--keepalive S] -- ARGV...

ARGV is executed directly, never through a shell: each argument arrives as one argument
(`cluster exec -- bash -c '...'` is how to run shell code). Its standard input is /dev/null;
its standard output and error, merged, are this program's output. It runs in DIR when that
directory exists (else in the home directory, with a note), with CLUSTER_EXEC_ID=ID and
CLUSTER_NODE=NAME in its environment: every process it starts inherits them, even one that
puts itself in a session of its own, so stopping finds them all, never by name.

Standard input is the launcher's control channel: a line `stop`, its end (the launcher was
interrupted, killed, or its connection is gone) or, with --keepalive S, S seconds without a
byte stops the command: SIGTERM to every process of it, up to S seconds of grace, SIGKILL,
verified. When the command ends by itself, whatever it left running ends with it. Either way
a control record (RS, JSON, US, as the supervisor frames them) reports what was signalled and
what is left: {"stopped": {...}} or {"leftovers": {...}}. The exit status is the command's
(128+N for signal N; 127 when it is not found, 126 when it cannot be executed).
"""
import os
import signal
import subprocess
import sys
import threading
import time

import family  # noqa: E402  (loaded before this module by the bootloader)
import options  # noqa: E402
import spawning  # noqa: E402
import stopping  # noqa: E402
import supervisor  # noqa: E402

GRACE = 5.0


def main(argv):
    opts, command = parse(argv)
    out = supervisor.Out(sys.stdout.buffer)
    if not command:
        out.write(b"cluster exec: no command given\n")
        return 2
    cwd, note = where(opts.cwd)
    if note:
        out.record({"note": note})
    env = dict(os.environ, CLUSTER_EXEC_ID=opts.id, CLUSTER_NODE=opts.node)
    family.become_subreaper()     # what the command starts stays ours, whatever its environment
    try:
        child = subprocess.Popen(command, cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 start_new_session=True,
                                 **spawning.with_umask(supervisor.USER_UMASK))
    except FileNotFoundError:
        out.write(("cluster exec: %s: command not found\n" % command[0]).encode())
        return 127
    except OSError as exc:
        out.write(("cluster exec: %s: %s\n" % (command[0], exc.strerror or exc)).encode())
        return 126
    return watch(child, ExecIdentity(opts.id, opts.node, child.pid), out, opts)


def parse(argv):
    """(options, command): the options before `--`, the command after it."""
    if "--" in argv:
        cut = argv.index("--")
        head, command = argv[:cut], argv[cut + 1:]
    else:
        head, command = argv, []
    opts = options.parse("execute.py", head, {"id": str, "node": str, "cwd": str, "grace": GRACE,
                                              "keepalive": 0.0}, required=("id", "node"))
    return opts, command


def where(cwd):
    """The directory to run in, and a note when the one asked for is not there."""
    home = os.path.expanduser("~")
    if not cwd:
        return home, None
    path = os.path.expanduser(cwd)
    if os.path.isdir(path):
        return path, None
    return home, "workdir %s does not exist here; ran in %s" % (cwd, home)


class ExecIdentity(stopping.Identity):
    """This exec on this node: processes whose environment carries its id and node name, its
    process group while this program (its owner) runs, and every descendant of this program
    outside its own session (family.py)."""

    def __init__(self, exec_id, node, pgid):
        stopping.Identity.__init__(self, exec_id, node, pgid, True, os.getpid())
        self.want = [("CLUSTER_EXEC_ID=%s" % exec_id).encode(), ("CLUSTER_NODE=%s" % node).encode()]


def terminate(ident, grace):
    """TERM every process of the exec (and any it starts meanwhile), wait up to `grace`, KILL
    the rest, verify."""
    signalled = []
    deadline = time.time() + grace
    left = ident.members()
    while left and time.time() < deadline:
        signalled += [pid for pid in left if pid not in signalled and ident.signal(pid, signal.SIGTERM)]
        time.sleep(0.05)
        left = ident.members()
    killed = [pid for pid in left if ident.signal(pid, signal.SIGKILL)]
    deadline = time.time() + 2.0
    while left and time.time() < deadline:
        time.sleep(0.05)
        left = ident.members()
    return {"signalled": signalled, "killed": killed, "left": left}


def watch(child, ident, out, opts):
    ending, stopped = threading.Event(), threading.Event()
    report = {}  # type: dict[str, object]

    def stop(reason):
        if ending.is_set():
            return
        ending.set()
        report.update(terminate(ident, opts.grace), reason=reason)
        stopped.set()

    commands = {"stop": lambda: stop("stop asked by the launcher")}
    threading.Thread(target=supervisor.watch_launcher,
                     args=(0, opts.keepalive, stop, commands), daemon=True).start()
    pump = threading.Thread(target=copy, args=(child.stdout, out), daemon=True)
    pump.start()
    code = child.wait()
    if ending.is_set():
        stopped.wait()
        key = "stopped"
    else:
        # What the command started in the background ends with it (as under `cluster up`).
        ending.set()
        report.update(terminate(ident, opts.grace))
        key = "leftovers"
    pump.join(timeout=2.0)
    if report.get("signalled") or report.get("left") or key == "stopped":
        out.record({key: report})
    return code if code >= 0 else 128 - code


def copy(pipe, out):
    fd = pipe.fileno()
    while True:
        try:
            data = os.read(fd, 65536)
        except OSError:
            return
        if not data:
            return
        out.write(data)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
