"""A container runtime on a node (docker, podman), asked as a child of its own: the probe's
facts of the runtime and the image, and the commands that stop a run's container by its name
(stopping.py). Each runs in a session of its own, so that one that does not answer in time is
ended with whatever it started.

Standard library only, Python 3.8+; loaded with the probe, and beside supervisor.py in the
node's run directory.
"""
import os
import signal


def runtime_start(argv, own_session=True):
    """A runtime command, started (its Popen) or what kept it from starting (a string). In a
    session of its own, so that what it starts can be ended with it; own_session False keeps
    it in this process's session, as the supervisor's helpers are (no process of the run can
    join that session, so none of them is ever taken for the run's: family.py)."""
    import subprocess        # here, not above: a run without a container never needs it
    try:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=own_session)
    except OSError as exc:
        return exc.strerror or str(exc)


def runtime_kill(proc, wait=None):
    """End a runtime command: its process group when it leads one of its own (not yet waited
    for, so the id cannot have been reused), else the command alone. Its pipes are not read
    again: a process it left could hold them open. Whether it ended within `wait` seconds
    (None: waited for however long): one blocked in a driver ends only when the driver lets
    it, and is left behind then."""
    import subprocess
    try:
        if os.getpgid(proc.pid) == proc.pid:
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
    except OSError:
        pass
    try:
        proc.wait(wait)
    except subprocess.TimeoutExpired:
        return False
    finally:
        proc.stdout.close()
        proc.stderr.close()
    return True


def runtime_result(proc, timeout):
    """(exit code, standard output, what it said on error) of a runtime command started by
    runtime_start; code None when it could not run or did not end within timeout (it is
    killed then). Its warnings on stderr never mix into a value."""
    if isinstance(proc, str):
        return None, "", proc
    import subprocess
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        runtime_kill(proc)
        return None, "", "no answer within %g s" % timeout
    out = stdout.decode("utf-8", "replace").strip()
    err = stderr.decode("utf-8", "replace").strip()
    said = [line for line in (err or out).splitlines() if "level=warning" not in line]
    return proc.returncode, out, "\n".join(said) or "exit code %d" % proc.returncode


def runtime_call(argv, timeout, own_session=True):
    return runtime_result(runtime_start(argv, own_session), timeout)


def container_facts(runtime, image, look_remote):
    """The runtime's version, and the image's id here; when it is not here and look_remote,
    whether its registry has it (the manifest only: nothing is pulled)."""
    out = {"runtime": runtime, "image": image, "version": None, "image_id": None}
    import shutil            # here, not above: its import costs every node of a launch 4 ms
    if not shutil.which(runtime):
        out["error"] = "%s is not installed here (not on PATH: %s)" % (
            runtime, os.environ.get("PATH", ""))
        return out
    # Both at once: each is a process of tens of milliseconds (the image's, a round trip to the
    # runtime's daemon), on every node of a launch, before the node can answer.
    version = runtime_start([runtime, "--version"])
    inspect = runtime_start([runtime, "image", "inspect", "--format", "{{.Id}}", image])
    code, text, said = runtime_result(version, 30)
    if code != 0:
        runtime_result(inspect, 0)       # not needed: ended, or killed now
        out["error"] = "%s: %s" % (runtime, said)
        return out
    out["version"] = text.splitlines()[0] if text else runtime
    code, text, said = runtime_result(inspect, 60)
    if code == 0:
        out["image_id"] = text.splitlines()[-1] if text else "?"
        return out
    lowered = said.lower()
    if code is None or not ("no such image" in lowered or "image not known" in lowered):
        out["error"] = "%s: %s" % (runtime, said[-400:])
        return out
    if look_remote:
        code, text, said = runtime_call([runtime, "manifest", "inspect", image], 60)
        out["pullable"] = code == 0
        if code != 0:
            out["pull_error"] = said.splitlines()[-1][-300:]
    return out
