#!/usr/bin/env python3
"""A stand-in for docker or podman, put on PATH under that name by unit tests. Every call
appends {"argv", "env"} to $FAKE_RUNTIME_DIR/calls.jsonl. It plays the few commands cluster
uses, with this machine's processes as the "container":

    run ... IMAGE CMD...            records NAME -> its own pid, then execs CMD in place (so the
                                    pid is the container's) in --workdir, with the environment
                                    an image would give: PATH and $FAKE_RUNTIME_IMAGE_ENV
                                    (one NAME=VALUE a line)
    stop -t N NAME                  TERM to that pid, KILL after N seconds
    rm --force NAME                 KILL, forget the name
    container inspect ... NAME      exit 0 while the pid lives, else "no such container" (--rm)
    image inspect ... IMAGE         exit 0 when IMAGE is in $FAKE_RUNTIME_IMAGES (comma-separated)
    --version                       a version line

The image is recognised among the run arguments by its name ($FAKE_RUNTIME_IMAGES).
"""
import json
import os
import signal
import sys
import time

STATE = os.environ["FAKE_RUNTIME_DIR"]
IMAGES = [i for i in os.environ.get("FAKE_RUNTIME_IMAGES", "").split(",") if i]


def log() -> None:
    with open(os.path.join(STATE, "calls.jsonl"), "a") as f:
        f.write(json.dumps({"argv": sys.argv[1:], "env": dict(os.environ)}) + "\n")


def pid_of(name: str) -> int | None:
    try:
        with open(os.path.join(STATE, "box-" + name)) as f:
            pid = int(f.read())
    except (OSError, ValueError):
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None
    return pid if state not in ("Z", "X") else None


def forget(name: str) -> None:
    try:
        os.unlink(os.path.join(STATE, "box-" + name))
    except OSError:
        pass


def run(args: list[str]) -> int:
    name = args[args.index("--name") + 1]
    at = next(i for i, a in enumerate(args) if a in IMAGES)
    with open(os.path.join(STATE, "box-" + name), "w") as f:
        f.write(str(os.getpid()))
    if "--workdir" in args[:at]:
        os.chdir(args[args.index("--workdir") + 1])
    env = {"PATH": os.environ["PATH"]}
    extra = os.environ.get("FAKE_RUNTIME_IMAGE_ENV", "")
    env.update(kv.split("=", 1) for kv in extra.split("\n") if "=" in kv)
    os.execvpe(args[at + 1], args[at + 1:], env)
    return 127


def stop(seconds: int, name: str) -> int:
    pid = pid_of(name)
    if pid is None:
        print(f"Error: no container with name or ID {name!r} found: no such container")
        return 125
    os.kill(pid, signal.SIGTERM)
    deadline = time.time() + seconds
    while pid_of(name) and time.time() < deadline:
        time.sleep(0.05)
    if pid_of(name):
        os.kill(pid, signal.SIGKILL)
    return 0


def main() -> int:
    log()
    args = sys.argv[1:]
    if args == ["--version"]:
        print("fake-runtime version 1.0")
        return 0
    if args[0] == "run":
        return run(args[1:])
    if args[0] == "stop":
        return stop(int(args[args.index("-t") + 1]), args[-1])
    if args[0] == "rm":
        pid = pid_of(args[-1])
        if pid:
            os.kill(pid, signal.SIGKILL)
        forget(args[-1])
        return 0
    if args[:2] == ["container", "inspect"]:
        if pid_of(args[-1]):
            print("0123abcd")
            return 0
        forget(args[-1])
        print(f"Error: inspecting object: no such container {args[-1]}")
        return 125
    if args[:2] == ["image", "inspect"]:
        if args[-1] in IMAGES:
            print("sha256:fake")
            return 0
        print(f"Error: {args[-1]}: image not known")
        return 125
    print(f"fake runtime: unsupported {args}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
