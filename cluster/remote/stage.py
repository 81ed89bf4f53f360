"""The one process a node runs for a launch: first the check, then, on the launcher's word, the
supervisor (standard library only, Python 3.8+). Its source, and the probe's, arrive on
standard input, so nothing is copied to a node before it is checked.

    stage.py FACTS-ARGS...          (see probe.py facts)

On standard input, each read to the byte with os.read (what follows belongs to the next step):
    <length>\\n<probe.py>            the probe; its facts go out as one JSON line
    then either end of input         the check failed somewhere, or this was all: exit 0
    or a JSON line {"dir", "args", "files": [[name, size, mode], ...]} and the files' bytes:
                                     written privately into dir (temporary name, rename), then
                                     supervisor.py runs in this same process with args; the
                                     rest of the input (the secret line, heartbeats) is its own.

One process and one round trip per node for the check and the start together: the launch
costs the nodes no more than the work itself.
"""
import json
import os
import sys


def take(n):
    data = b""
    while len(data) < n:
        chunk = os.read(0, n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def line():
    data = b""
    while not data.endswith(b"\n"):
        chunk = take(1)
        if chunk is None:
            return None
        data += chunk
    return data


def load(source, name, path=None):
    module = {"__name__": name, "__file__": path or name + ".py"}
    exec(compile(source, path or name + ".py", "exec"), module)
    return module


def write(d, files):
    for name, size, mode in files:
        data, tmp = take(size), os.path.join(d, "." + name + ".tmp")
        if data is None:
            raise SystemExit("cluster: the launcher's connection closed during the start")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        os.chmod(tmp, mode)
        os.replace(tmp, os.path.join(d, name))


def main(argv):
    size = line()
    probe = load(take(int(size)), "probe")
    facts = probe["facts"](probe["parse"](["facts"] + argv))
    sys.stdout.write(json.dumps(facts) + "\n")
    sys.stdout.flush()
    head = line()
    if head is None:
        return 0                      # nothing to start here
    go = json.loads(head)
    write(go["dir"], go["files"])
    path = os.path.join(go["dir"], "supervisor.py")
    sys.argv = [path, "run", go["dir"]] + go["args"]
    sys.path.insert(0, go["dir"])     # its helper, workers.py, sits beside it
    with open(path, "rb") as f:
        supervisor = load(f.read(), "supervisor", path)
    return supervisor["main"](sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
