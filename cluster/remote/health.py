"""A node's health before a start or restart: its GPUs as nvidia-smi and the kernel log see
them, what else holds their memory, free disk and memory. It reports; it judges nothing (the
launcher's gate does). Loaded with the probe (`probe.py facts --health`), in the same round trip.

Standard library only, Python 3.8+.

health_facts(workdir, extra_dirs) -> {
  "nvidia": None on a node without nvidia-smi on PATH (a CPU node: nothing else is asked), else
    {"gpus": [{index, uuid, name, bus_id, driver, memory_used_mib, memory_total_mib,
               ecc_uncorrected, retired_pending, remapped_pending, remapped_failure, lost}],
     "apps": [{gpu_uuid, gpu_index, pid, used_mib, name, user, command}] or None when not read,
     "error": what nvidia-smi said when a query failed (its last lines), else None,
     "refused": the --query-gpu fields this driver does not know (their values are None),
     "driver_gpus": the GPUs the driver has (/proc/driver/nvidia/gpus), None without it},
  "xid": None on a CPU node, else {"source": "dmesg" | "journalctl" | None, "error": why the
    kernel log could not be read, "events": the last 20 NVRM Xid lines [{code, bus, text}],
    "counts": {"79": 1, ...} (every Xid line since boot, by code; string keys, as JSON has them)},
  "disk": {each dir as given: free bytes for this user, of it or of its nearest existing
    parent, None when unreadable},
  "memory_available_bytes": MemAvailable, None when unreadable,
  "seconds": what this took}

A GPU's bus_id is nvidia-smi's ("00000000:AB:00.0"); an Xid's bus is the kernel log's
("0000:ab:00"): the same GPU when the last 10 characters of the first, lowercased and without
its ".0", are the second.
"""
import os
import time

import containers  # noqa: E402  (loaded before this module by the bootloader)

# The fields every driver knows, then the health fields, each documented in
# `nvidia-smi --help-query-gpu`: "ecc.errors.uncorrected.volatile.total" ("Total errors detected
# across entire chip", since the driver last loaded), "retired_pages.pending" ("Checks if any
# GPU device memory pages are pending retirement on the next reboot"; N/A from Ampere on, which
# remaps rows instead). "remapped_rows.pending" and "remapped_rows.failure" are not in the
# R535 listing (there they are --query-remapped-rows fields only) but are --query-gpu fields of
# newer drivers: an older one refuses the query, and it is asked again without them.
BASIC_FIELDS = ("index", "uuid", "name", "pci.bus_id", "driver_version", "memory.used",
                "memory.total")
GPU_FIELDS = BASIC_FIELDS + ("ecc.errors.uncorrected.volatile.total", "retired_pages.pending",
                             "remapped_rows.pending", "remapped_rows.failure")
# `nvidia-smi --help-query-compute-apps`: "gpu_uuid", "pid", "used_gpu_memory" or
# "used_memory" ("Amount memory used on the device by the context"), "process_name" or "name".
APP_FIELDS = ("gpu_uuid", "pid", "used_memory", "process_name")
FORMAT = "--format=csv,noheader,nounits"
QUERY_SECONDS = 20.0
LOG_SECONDS = 10.0
XID_EVENTS = 20
DRIVER_GPUS = "/proc/driver/nvidia/gpus"


def health_facts(workdir, extra_dirs=(), driver_dir=DRIVER_GPUS):
    t0 = time.monotonic()
    nvidia = xid = None
    if on_path("nvidia-smi"):
        asked = start_queries()
        xid = kernel_xids()          # while nvidia-smi answers
        nvidia = finish_queries(asked, driver_dir)
    return {"nvidia": nvidia, "xid": xid,
            "disk": {d: free_bytes(d) for d in [workdir, *extra_dirs]},
            "memory_available_bytes": memory_available(),
            "seconds": round(time.monotonic() - t0, 3)}


def nvidia_facts(driver_dir=DRIVER_GPUS):
    """nvidia-smi's facts alone (doctor's deep look), None without nvidia-smi."""
    return finish_queries(start_queries(), driver_dir) if on_path("nvidia-smi") else None


def nvidia_gpus(folder=DRIVER_GPUS):
    """How many GPUs the NVIDIA driver has (one folder each), None without the driver: one
    directory listing, not nvidia-smi's seconds."""
    try:
        return len(os.listdir(folder))
    except OSError:
        return None


def on_path(name):
    """Whether an executable `name` is on PATH (not shutil.which: its import costs a node
    milliseconds, for a CPU node that needs nothing else of it)."""
    return any(os.access(os.path.join(d or ".", name), os.X_OK)
               for d in os.environ.get("PATH", os.defpath).split(os.pathsep))


# --- nvidia-smi ----------------------------------------------------------------------------

def query(kind, fields):
    return containers.runtime_start(["nvidia-smi", "--query-%s=%s" % (kind, ",".join(fields)),
                                     FORMAT])


def start_queries():
    """Both queries at once (each is NVML's start-up, up to seconds on a box of 8 GPUs)."""
    deadline = time.monotonic() + QUERY_SECONDS
    return deadline, query("gpu", GPU_FIELDS), query("compute-apps", APP_FIELDS)


def finish_queries(asked, driver_dir):
    deadline, gpu_proc, apps_proc = asked
    fields, code, said, refused = gpu_answer(gpu_proc, deadline)
    gpus = [gpu_entry(row) for row in rows(said, fields)]
    errors = [failure(code, said, fields)] if code != 0 else []
    code, apps_said = finish(apps_proc, deadline)
    by_uuid = {g["uuid"]: g["index"] for g in gpus}
    listed = [app_entry(row, by_uuid) for row in rows(apps_said, APP_FIELDS)]
    if code != 0:                    # what it listed still holds memory; none listed: not known
        errors.append(failure(code, apps_said, APP_FIELDS))
    apps = listed if code == 0 or listed else None
    return {"gpus": gpus, "apps": apps, "error": "; ".join(e for e in errors if e) or None,
            "refused": refused, "driver_gpus": nvidia_gpus(driver_dir)}


def finish(proc, deadline, limit=None):
    """(exit code, everything it printed): None when it could not start or did not end by
    the deadline (`limit` seconds after its start): killed then, with what it started, and
    left behind when even that does not end it within 2 s (nvidia-smi blocked in the driver
    by a GPU that no longer answers: the node's answer must not wait for it)."""
    if isinstance(proc, str):
        return None, proc
    import subprocess
    try:
        out, err = proc.communicate(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        ended = containers.runtime_kill(proc, wait=2.0)
        return None, "no answer within %g s%s" % (limit or QUERY_SECONDS, "" if ended else
                                                   ", and killed, it did not end (blocked in "
                                                   "the driver?)")
    return proc.returncode, (out + err).decode("utf-8", "replace")


def gpu_answer(proc, deadline):
    """(the fields of the answer, exit code, the answer, the fields this driver refused).
    A driver refuses the whole query for one field it does not know: asked again without that
    field's family (all remapped_rows.*), once for each family it refuses (one, in practice);
    a refused basic field, or one not asked, leaves the basic fields only, and their refusal
    is the answer."""
    fields = GPU_FIELDS
    refused: "list[str]" = []     # (a string: not evaluated, Python 3.8 too)
    while True:
        code, said = finish(proc, deadline)
        field = refused_field(said) if code != 0 else None
        if field is None or fields == BASIC_FIELDS:
            return fields, code, said, refused
        fewer = without_family(fields, field)
        refused += [f for f in fields if f not in fewer]
        fields, proc = fewer, query("gpu", fewer)


# nvidia-smi's words for a field it does not know, on its standard output, e.g.
#   Field "cuda_version" is not a valid field to query.
def refused_field(said):
    for line in said.splitlines():
        if line.startswith('Field "') and line.rstrip().endswith("is not a valid field to query."):
            return line.split('"')[1]
    return None


def without_family(fields, field):
    family = field.split(".")[0]
    fewer = tuple(f for f in fields if f.split(".")[0] != family)
    return fewer if field not in BASIC_FIELDS and len(fewer) < len(fields) else BASIC_FIELDS


def failure(code, said, fields):
    """What a failed query said: its last three lines that are not rows. Real ones:
      NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure
      that the latest NVIDIA driver is installed and running.          (exit code 9)
      No devices were found                                            (6)
      Unable to determine the device handle for GPU0000:07:00.0: Unknown Error
    """
    lines = [line.strip() for line in said.splitlines()
             if line.strip() and len(line.split(",")) != len(fields)]
    return " | ".join(lines[-3:])[-300:] or "exit code %s" % code


def rows(said, fields):
    """The answer's rows (csv,noheader,nounits: values joined by ", "), each as field -> text;
    a line of another width (an error among the rows) is not one. The last field may hold
    commas (a process's name)."""
    found = []
    for line in said.splitlines():
        values = [v.strip() for v in line.split(",", len(fields) - 1)]
        if len(values) == len(fields) and line.strip():
            found.append(dict(zip(fields, values)))
    return found


# What nvidia-smi prints in a field it has no value for: "[N/A]" and "[Not Supported]" say
# the GPU has no such thing; any other bracketed word is an NVML error about this GPU:
#   4, GPU-..., [GPU is lost], ...                    (after Xid 79, "fallen off the bus")
#   0, [GPU requires reset], [GPU requires reset], 0 MiB
#   [Unknown Error]
NOT_THERE = ("[n/a]", "n/a", "[not supported]", "[insufficient permissions]", "")


def value(text):
    return None if text is None or text.lower() in NOT_THERE or is_fault(text) else text


def is_fault(text):
    t = text.lower()
    return ((t.startswith("[") and t.endswith("]") and t not in NOT_THERE)
            or t in ("unknown error", "gpu is lost", "gpu requires reset"))


def number(text):
    v = value(text)
    try:
        return int(float(v)) if v is not None else None
    except ValueError:
        return None


def yes_no(text):
    """"Yes"/"No" as --query-gpu prints a pending or failure flag (1/0 too); None when
    the GPU has no such thing (retired pages on Ampere and later) or it was not asked."""
    v = (value(text) or "").lower()
    return True if v in ("yes", "1", "true") else False if v in ("no", "0", "false") else None


def gpu_entry(row):
    return {"index": number(row.get("index")), "uuid": value(row.get("uuid")),
            "name": value(row.get("name")), "bus_id": value(row.get("pci.bus_id")),
            "driver": value(row.get("driver_version")),
            "memory_used_mib": number(row.get("memory.used")),
            "memory_total_mib": number(row.get("memory.total")),
            "ecc_uncorrected": number(row.get("ecc.errors.uncorrected.volatile.total")),
            "retired_pending": yes_no(row.get("retired_pages.pending")),
            "remapped_pending": yes_no(row.get("remapped_rows.pending")),
            "remapped_failure": yes_no(row.get("remapped_rows.failure")),
            "lost": any(is_fault(v) for v in row.values())}


def app_entry(row, by_uuid):
    pid = number(row.get("pid"))
    return {"gpu_uuid": value(row.get("gpu_uuid")), "gpu_index": by_uuid.get(row.get("gpu_uuid")),
            "pid": pid, "used_mib": number(row.get("used_memory")),
            "name": value(row.get("process_name")),
            "user": process_user(pid) if pid else None,
            "command": process_command(pid) if pid else None}


def process_user(pid, proc="/proc"):
    """Who runs pid (its real uid's name, the uid when it has none here), None when /proc
    does not show it (it ended, or runs in another pid namespace than ours)."""
    try:
        with open("%s/%d/status" % (proc, pid)) as f:
            uid = next(int(line.split()[1]) for line in f if line.startswith("Uid:"))
    except (OSError, ValueError, StopIteration, IndexError):
        return None
    import pwd
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def process_command(pid, proc="/proc"):
    try:
        with open("%s/%d/cmdline" % (proc, pid), "rb") as f:
            raw = f.read(4096)
    except OSError:
        return None
    return raw.rstrip(b"\0").replace(b"\0", b" ").decode("utf-8", "replace")[:200] or None


def deep_gpus(nvidia):
    """doctor's deep look at the GPUs, as preflight reads it: one entry per GPU with the
    number of processes on it; {"error"} when none could be listed; None without nvidia-smi."""
    if nvidia is None:
        return None
    if nvidia["error"] and not nvidia["gpus"]:
        return {"error": nvidia["error"]}
    apps = nvidia["apps"] or []
    return [{"index": g["index"], "name": g["name"], "driver": g["driver"], "uuid": g["uuid"],
             "memory_used_mib": g["memory_used_mib"], "memory_total_mib": g["memory_total_mib"],
             "processes": sum(1 for a in apps if a["gpu_uuid"] == g["uuid"])}
            for g in nvidia["gpus"]]


# --- the kernel log's Xid lines --------------------------------------------------------------

# Two ways to read it; the first is refused to other users than root where
# kernel.dmesg_restrict is set ("dmesg: read kernel buffer failed: Operation not permitted").
# journalctl without -q: a user who may not read the system journal gets a successful, empty
# answer and only its hint on stderr says so ("Hint: You are currently not seeing messages from
# other users and the system."). With -g, no match is exit code 1 and "-- No entries --".
KERNEL_LOGS = (("dmesg", ["dmesg"]),
               ("journalctl", ["journalctl", "-k", "-b", "--no-pager", "-g", "NVRM: Xid"]))
UNREADABLE = ("not seeing messages from other users", "insufficient permissions",
              "no journal files")


def kernel_xids(logs=KERNEL_LOGS):
    why = []
    for source, argv in logs:
        code, said = finish(containers.runtime_start(argv), time.monotonic() + LOG_SECONDS,
                            LOG_SECONDS)
        problem = log_problem(source, code, said)
        if problem is None:
            return dict(xid_summary(said), source=source, error=None)
        why.append("%s: %s" % (source, problem))
    return {"source": None, "error": "; ".join(why), "events": [], "counts": {}}


def log_problem(source, code, said):
    lowered = said.lower()
    if code is None:
        return said or "no answer"
    if source == "journalctl" and any(u in lowered for u in UNREADABLE):
        return [line for line in said.splitlines() if line.strip()][-1][-200:]
    no_match = source == "journalctl" and code == 1 and "-- no entries --" in lowered
    if code != 0 and not no_match:
        lines = [line for line in said.splitlines() if line.strip()] or ["exit code %d" % code]
        return lines[-1][-200:]
    return None


def xid_summary(text):
    events = []
    counts: "dict[str, int]" = {}
    for line in text.splitlines():
        found = xid_of(line)
        if found:
            code, bus = found
            counts[str(code)] = counts.get(str(code), 0) + 1
            events.append({"code": code, "bus": bus, "text": line.strip()[:300]})
    return {"events": events[-XID_EVENTS:], "counts": counts}


# The driver's line, as kernel logs show it (dmesg's time stamp or journalctl's prefix before):
#   NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus.
#   NVRM: Xid (PCI:0000:05:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.
#   NVRM: Xid (PCI:0002:00:00): 13, pid=2519562, name=python3, Graphics Exception: ChID 000c, ...
#   NVRM: Xid (0000:03:00): 14, Channel 00000001                       (older drivers)
def xid_of(line):
    """(code, bus) of an Xid line, None for any other line."""
    at = line.find("NVRM: Xid (")
    if at < 0:
        return None
    inside, _, rest = line[at + len("NVRM: Xid ("):].partition("):")
    bus = (inside[4:] if inside.startswith("PCI:") else inside).split(".")[0]
    code = rest.strip().split(",")[0].strip()
    if not code.isdigit() or bus.count(":") != 2:
        return None
    return int(code), bus.lower()


# --- disk and memory -----------------------------------------------------------------------

def free_bytes(d):
    """Free bytes for this user where d is, or would be (its nearest existing parent)."""
    path = os.path.abspath(os.path.expanduser(d))
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def memory_available(meminfo="/proc/meminfo"):
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024        # "MemAvailable:  123 kB"
    except (OSError, ValueError, IndexError):
        pass
    return None
