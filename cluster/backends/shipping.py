"""The one way cluster's programs reach a node: a short bootloader on the command line
(`python -c BOOT`) reads bundles from standard input, so nothing is copied to a node first
and no argument, let alone a secret, shows on a command line.

A bundle is one JSON line, then the bytes it names, read to the byte:

    {"dir": D, "files": [[NAME, SIZE, MODE], ...], "run": [MODULE, ARG, ...]}

Each file with MODE null is a module of cluster/remote, loaded in memory in that order (a later
one imports an earlier one by name); each with a MODE is written privately into D (a temporary
name, then a rename; folders in NAME that are missing are made, 0700). Then
MODULE's main(ARGS) runs: the one just loaded, else D/MODULE.py from the node's disk. An integer
from main ends the process with that status; None reads the next bundle from the same input,
and the end of input there ends the process (status 0). That is how a launch costs one process
and one round trip per node: the check's probe answers and waits (SupervisedNode.stage); its
next bundle writes the run's files and becomes the supervisor, or the end of input lets it go.
A file a job runs that cluster brings (doctor's collective) rides with the check's bundle.
What follows a bundle on the input is the program's own (the supervisor's secret line and
heartbeats, exec's `stop`).

The command line also shows the first bundle's program and arguments, for `ps` on the node
only (the bootloader reads them from the bundle): what runs there can be told at a glance, and
no secret is ever among them (secrets travel on the input, after the bundle).

The node's programs are standard library only, so most start with `python -S`: no `site`, whose
site-packages and .pth files cost a node 4-18 ms per process (docs/SCALE.md, "Where a node's
start-up goes"). The probe's facts keep it: they say where torch is as the job's python will
find it (site-packages, and the paths .pth files add), and that same process becomes the
supervisor. -S changes only how cluster's own interpreter starts: the environment it passes on
to the job (PYTHONPATH and all) is the node's, and the job's python is started by the node's
script, without it. Not -I: PYTHONHOME (which some installations need to find their standard
library) would be ignored, and a stop must not fail where the check worked.
"""
from __future__ import annotations

import json
import shlex
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

REMOTE = Path(__file__).resolve().parent.parent / "remote"
SUPERVISOR = REMOTE / "supervisor.py"

BOOT = ("import os,sys,json,types\n"
        "def t(n):\n b=b''\n while len(b)<n:\n  c=os.read(0,n-len(b))\n"
        "  if not c:raise SystemExit('cluster: the launcher closed its input inside a bundle')\n"
        "  b+=c\n return b\n"
        "def m(n,s,f):\n x=types.ModuleType(n);x.__file__=f;sys.modules[n]=x\n"
        " exec(compile(s,f,'exec'),x.__dict__);return x\n"
        "while 1:\n h=b''\n while not h.endswith(b'\\n'):\n  c=os.read(0,1)\n"
        "  if not c:sys.exit(0 if not h else 'cluster: the launcher closed its input inside a bundle')\n"
        "  h+=c\n h=json.loads(h);d=os.path.expanduser(h.get('dir') or '.');k={}\n"
        " for n,z,o in h['files']:\n  s=t(z)\n"
        "  if o is None:k[n]=m(n,s,n+'.py');continue\n"
        "  p=os.path.join(d,n);q=os.path.join(os.path.dirname(p),'.'+os.path.basename(p)+'.tmp')\n"
        "  os.makedirs(os.path.dirname(p),0o700,exist_ok=True)\n"
        "  with os.fdopen(os.open(q,os.O_WRONLY|os.O_CREAT|os.O_TRUNC,o),'wb') as w:w.write(s)\n"
        "  os.chmod(q,o);os.replace(q,p)\n"
        " n,a=h['run'][0],h['run'][1:];f=os.path.join(d,n+'.py')\n"
        " r=(k.get(n) or m(n,open(f,'rb').read(),f)).main(a)\n"
        " if r is not None:sys.exit(r)\n")

# What a run's start writes into the node's run directory beside its launch.sh: the supervisor
# and what it imports stay there, as the run's stop, status and logs run it.
SUPERVISOR_FILES = ("family", "workers", "rundir", "containers", "stopping", "supervisor")
# Each node-side program of cluster/remote with the modules it imports, in load order.
PROGRAMS = {"probe": ("containers", "probe"),
            "status": ("status",),
            "execute": (*SUPERVISOR_FILES, "execute"),
            "clean": (*SUPERVISOR_FILES, "clean")}


# The programs (module, command) that need the node's site-packages: the probe's facts find
# torch there, as the job will.
WITH_SITE = {("probe", "facts")}


@dataclass(frozen=True)
class Bundle:
    run: tuple[str, ...]             # the module whose main runs, then its arguments
    data: bytes                      # the header and the bytes, as the bootloader reads them

    @property
    def site(self) -> bool:
        """Whether its program needs the interpreter's site-packages (else python -S)."""
        return tuple(self.run[:2]) in WITH_SITE


def boot_command(exe: str, first: Bundle) -> str:
    """The one command line for any program on a node, showing the first bundle's program.
    exe: the shell words that run the node's python (plan.python_command); the flags go after
    them, so they reach the interpreter through setup lines' `exec python "$@"` too."""
    flags = [] if first.site else ["-S"]
    return " ".join([exe, *flags, "-c", shlex.quote(BOOT), *(shlex.quote(a) for a in first.run)])


def bundle(run: Sequence[str], modules: Iterable[str] = (), dir: str | None = None,
           files: Iterable[tuple[str, bytes, int]] = ()) -> Bundle:
    """run: the module whose main runs, then its arguments; modules: cluster/remote modules
    loaded in memory first; files: (name, bytes, mode) written into dir."""
    parts: list[tuple[str, bytes, int | None]] = [(name, source(name), None) for name in modules]
    parts += [(name, data, mode) for name, data, mode in files]
    head = {"dir": dir, "files": [[n, len(d), m] for n, d, m in parts], "run": list(run)}
    data = (json.dumps(head) + "\n").encode() + b"".join(d for _, d, _ in parts)
    return Bundle(tuple(run), data)


def program(name: str, *args: str, dir: str | None = None,
            files: Iterable[tuple[str, bytes, int]] = ()) -> Bundle:
    """A node-side program of PROGRAMS, ready to run with its arguments (files: written into
    dir before it runs)."""
    if name not in PROGRAMS:
        raise ValueError(f"no node-side program {name!r}")
    return bundle([name, *args], PROGRAMS[name], dir, files)


def on_disk(run_dir: str, *args: str) -> Bundle:
    """The supervisor a run's start left in run_dir, run with args (stop, logs)."""
    return bundle(["supervisor", *args], dir=run_dir)


def start(run_dir: str, args: Sequence[str], script: bytes, container: bytes | None = None) -> Bundle:
    """A staged node's start: the run's files into run_dir (the container's record first,
    which any stop, even one racing the start, finds), then the supervisor from there with
    args."""
    files = [("container.json", container, 0o600)] if container is not None else []
    files += [(f"{n}.py", source(n), 0o600) for n in SUPERVISOR_FILES]
    files.append(("launch.sh", script, 0o700))
    return bundle(["supervisor", "run", run_dir, *args], dir=run_dir, files=files)


def source(module: str) -> bytes:
    return (REMOTE / f"{module}.py").read_bytes()
