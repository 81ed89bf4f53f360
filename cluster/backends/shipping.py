"""The one way cluster's programs reach a node: a short bootloader on the command line
(`python -c BOOT`) reads bundles from standard input, so nothing is copied to a node first
and no argument, let alone a secret, shows on a command line.

A bundle is a JSON header, its length in bytes before it (`123 {...}`: the node reads the
header whole, not byte by byte), then the bytes it names, read to the byte:

    LEN {"dir": D, "cache": C, "files": [[NAME, SIZE, MODE, KEY], ...], "run": [MODULE, ARG, ...]}

Each part with a MODE is written privately into D (a temporary name, then a rename; folders in
NAME that are missing are made, 0700); each with a KEY is a module of cluster/remote, loaded in
that order (a later one imports an earlier one by name), its compiled code taken from the
node's code cache C under KEY when there (else compiled, and kept there). Then MODULE's
main(ARGS) runs: the one just loaded, else D/MODULE.py from the node's disk (a bundle after
the first calls the previous program's handover() first, where it has one: the probe's
listener of the master port ends there, before the start). An integer
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

The node's programs are standard library only, so they start with `python -S`: no `site`, whose
site-packages and .pth files cost a node 4-35 ms per process (docs/SCALE.md, "Where a node's
start-up goes"). The probe's facts say where torch is as the job's python will find it: they
look where site would look (remote/torchfind.py), and run site only when torch is not there.
-S changes only how cluster's own interpreter starts: the environment it passes on
to the job (PYTHONPATH and all) is the node's, and the job's python is started by the node's
script, without it. Not -I: PYTHONHOME (which some installations need to find their standard
library) would be ignored, and a stop must not fail where the check worked.
"""
from __future__ import annotations

import functools
import hashlib
import json
import shlex
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

REMOTE = Path(__file__).resolve().parent.parent / "remote"
SUPERVISOR = REMOTE / "supervisor.py"
# Where a node keeps the compiled code of the modules it was sent, by their key (code_key):
# private to the user (the bootloader trusts a 0700 folder of its own only), and a miss or any
# failure to read or write it only means compiling, as without it.
CODE_CACHE = "~/.cache/cluster/code"

# Its first line takes the working directory off sys.path before anything else is imported:
# `python -c` puts it first (''), so a types.py, json.py or signal.py in the user's project
# (local) or home (SSH) would shadow the standard library in every node program. (-P and
# PYTHONSAFEPATH do this from Python 3.11 only; -I would drop PYTHONHOME, see above.) sys and
# posix are built in, found on no path. The job is not started from here: its python still puts
# its script's folder first, as usual.
BOOT = ("import sys,posix\ntry:w=posix.getcwd()\nexcept OSError:w=''\n"
        "sys.path[:]=[p for p in sys.path if p not in('','.',w)]\n"
        "import os,sys,json,types,marshal\n"
        "def t(n):\n b=b''\n while len(b)<n:\n  c=os.read(0,n-len(b))\n"
        "  if not c:raise SystemExit('cluster: the launcher closed its input inside a bundle')\n"
        "  b+=c\n return b\n"
        "def g(s,f,y,C):\n"
        " p=C and y and os.path.join(os.path.expanduser(C),'%s.%s.%x'%(y,sys.implementation.cache_tag,sys.hexversion))\n"
        " try:\n  q=os.stat(os.path.dirname(p))\n"
        "  if q.st_uid==os.getuid() and not q.st_mode&0o77:\n"
        "   with open(p,'rb') as r:c=marshal.loads(r.read())\n"
        "   if type(c) is types.CodeType:return c\n"
        " except Exception:pass\n"
        " c=compile(s,f,'exec')\n"
        " if p:\n  try:\n   os.makedirs(os.path.dirname(p),0o700,exist_ok=True);w='%s.%d'%(p,os.getpid())\n"
        "   with os.fdopen(os.open(w,os.O_WRONLY|os.O_CREAT|os.O_EXCL,0o600),'wb') as o:o.write(marshal.dumps(c))\n"
        "   os.replace(w,p)\n  except OSError:pass\n"
        " return c\n"
        "def m(n,s,f,y=None,C=None):\n x=types.ModuleType(n);x.__file__=f;sys.modules[n]=x\n"
        " exec(g(s,os.path.basename(f) if y else f,y,C),x.__dict__);return x\n"
        "P=None\nwhile 1:\n h=b''\n while not h.endswith(b' '):\n  c=os.read(0,1)\n"
        "  if not c:sys.exit(0 if not h else 'cluster: the launcher closed its input inside a bundle')\n"
        "  h+=c\n h=json.loads(t(int(h)));getattr(P,'handover',int)();d=os.path.expanduser(h.get('dir') or '.');k={}\n"
        " for n,z,o,y in h['files']:\n  s=t(z);p=os.path.join(d,n)\n"
        "  if o is not None:\n"
        "   q=os.path.join(os.path.dirname(p),'.'+os.path.basename(p)+'.tmp')\n"
        "   os.makedirs(os.path.dirname(p),0o700,exist_ok=True)\n"
        "   with os.fdopen(os.open(q,os.O_WRONLY|os.O_CREAT|os.O_TRUNC,o),'wb') as w:w.write(s)\n"
        "   os.chmod(q,o);os.replace(q,p)\n"
        "  if y:e=os.path.basename(n)[:-3];k[e]=m(e,s,p if o is not None else n,y,h.get('cache'))\n"
        " n,a=h['run'][0],h['run'][1:];f=os.path.join(d,n+'.py')\n"
        " P=k.get(n) or m(n,open(f,'rb').read(),f);r=P.main(a)\n"
        " if r is not None:sys.exit(r)\n")

# What a run's start writes into the node's run directory beside its launch.sh: the supervisor
# and what it imports stay there, as the run's stop, status and logs run it.
SUPERVISOR_FILES = ("options", "family", "workers", "rundir", "containers", "stopping", "spawning",
                    "recorded", "supervisor")
# Each node-side program of cluster/remote with the modules it imports, in load order.
PROGRAMS = {"probe": ("options", "containers", "torchfind", "health", "probe"),
            "status": ("options", "status"),
            "execute": (*SUPERVISOR_FILES, "execute"),
            "clean": (*SUPERVISOR_FILES, "clean")}


@dataclass(frozen=True)
class Bundle:
    run: tuple[str, ...]             # the module whose main runs, then its arguments
    data: bytes                      # the header and the bytes, as the bootloader reads them


def boot_command(exe: str, first: Bundle) -> str:
    """The one command line for any program on a node, showing the first bundle's program.
    exe: the shell words that run the node's python (plan.python_command); the flags go after
    them, so they reach the interpreter through setup lines' `exec python "$@"` too."""
    # -B: no __pycache__ beside a module imported from the node's disk (the run folder's
    # supervisor, which status, logs and stop import): reading a run writes nothing there.
    return " ".join([exe, "-S", "-B", "-c", shlex.quote(BOOT), *(shlex.quote(a) for a in first.run)])


# A bundle's part: (name, bytes, mode, code key). A mode writes it into the bundle's dir; a code
# key loads it as a module (a .py name) through the node's code cache.
Part = tuple[str, bytes, int | None, str | None]


def module(name: str, mode: int | None = None) -> Part:
    """A module of cluster/remote, loaded on the node; with a mode, also written there."""
    return (f"{name}.py", source(name), mode, code_key(name))


def file(name: str, data: bytes, mode: int) -> Part:
    """A file written into the bundle's dir, privately (mode), not loaded."""
    return (name, data, mode, None)


def bundle(run: Sequence[str], parts: Iterable[Part] = (), dir: str | None = None) -> Bundle:
    """run: the module whose main runs, then its arguments; parts in the order the node takes
    them (a module after those it imports)."""
    parts = list(parts)
    head = json.dumps({"dir": dir, "cache": CODE_CACHE, "files": [[n, len(d), m, k] for n, d, m, k in parts],
                       "run": list(run)}).encode()
    return Bundle(tuple(run), b"%d " % len(head) + head + b"".join(d for _, d, _, _ in parts))


def program(name: str, *args: str, dir: str | None = None,
            files: Iterable[tuple[str, bytes, int]] = ()) -> Bundle:
    """A node-side program of PROGRAMS, ready to run with its arguments (files: written into
    dir before it runs)."""
    if name not in PROGRAMS:
        raise ValueError(f"no node-side program {name!r}")
    return bundle([name, *args], [*(module(m) for m in PROGRAMS[name]), *(file(*f) for f in files)],
                  dir)


def on_disk(run_dir: str, *args: str) -> Bundle:
    """The supervisor a run's start left in run_dir, run with args (stop, logs)."""
    return bundle(["supervisor", *args], dir=run_dir)


def start(run_dir: str, args: Sequence[str], script: bytes, container: bytes | None = None) -> Bundle:
    """A staged node's start: the run's files into run_dir (the container's record first,
    which any stop, even one racing the start, finds), then the supervisor from there with
    args: its modules are written there for the run's later commands and loaded as they land."""
    parts = [file("container.json", container, 0o600)] if container is not None else []
    parts += [module(n, 0o600) for n in SUPERVISOR_FILES]
    parts.append(file("launch.sh", script, 0o700))
    return bundle(["supervisor", "run", run_dir, *args], parts, run_dir)


@functools.lru_cache(maxsize=None)
def code_key(module: str) -> str:
    """What names a module's compiled code in the node's cache: its source and the file name
    its code carries."""
    return hashlib.sha256(f"{module}.py\0".encode() + source(module)).hexdigest()[:32]


@functools.lru_cache(maxsize=None)
def source(module: str) -> bytes:
    return (REMOTE / f"{module}.py").read_bytes()
