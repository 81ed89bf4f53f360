"""What the nodes said about themselves, judged: pure functions from facts to findings.

`cluster up` acts on the fast subset before it starts anything (every node has torch, the
same torch, an interface that exists and reaches the master, the master port free and open
to every node); `cluster doctor` shows all of them, deep ones included. Each finding names the
node, the check, pass / warn / fail, what was seen and, for a problem, the fix in one line.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..plan import LaunchPlan
from ..spec import Container
from ..torchrun_options import last_value
from .findings import FAIL, GIB, PASS, WARN, Finding
from .hardware import health_findings

CLOCK_WARN = 2.0       # seconds a node's clock may be off for sure before a warning
CLOCK_FAIL = 60.0      # ... and before a failure (logs and timeouts no longer line up)


Facts = Mapping[str, Mapping[str, Any]]


@dataclass(frozen=True)
class Clock:
    """A node's clock against this machine's: node time - this machine's time = offset,
    give or take error (seconds)."""
    offset: float
    error: float


def clock_offset(sent: float, received: float, node_start: float, node_end: float) -> Clock:
    """NTP's estimate from four timestamps: this machine asked at `sent` and had the answer at
    `received` (its clock); the node read node_start as it began and node_end as it answered
    (the node's clock). The node's own work between its two readings is left out; the rest of
    the round trip (login, start, the way back) is split between there and back in shares
    nobody knows, so the true offset lies within half of it either side of the estimate."""
    offset = ((node_start - sent) + (node_end - received)) / 2
    trip = max(0.0, (received - sent) - (node_end - node_start))
    return Clock(offset, trip / 2)


def evaluate(plan: LaunchPlan, facts: Facts, reach: Mapping[str, Mapping[str, Any]] | None = None,
             *, deep: bool = False, clock: Mapping[str, Clock] | None = None) -> list[Finding]:
    out: list[Finding] = []
    for node in plan.nodes:
        f = facts.get(node.host.name)
        if f is None:
            continue
        out += node_findings(node, f, plan)
        if reach is not None and node.host.name in reach:
            out.append(reach_finding(node.host.name, reach[node.host.name], plan))
        if deep:
            out += deep_findings(node, f, (clock or {}).get(node.host.name))
    out += agreement(facts, deep=deep)
    return out


def failures(findings: Sequence[Finding]) -> list[Finding]:
    return [f for f in findings if f.status == FAIL]


# --- one node -----------------------------------------------------------------------------------


def node_findings(node: Any, f: Mapping[str, Any], plan: LaunchPlan) -> list[Finding]:
    name, out = node.host.name, []
    torch = f.get("torch") or {}
    if node.host.container:              # torch comes with the image, not from the node
        out.append(container_finding(name, node.host.container, f.get("container") or {}))
    elif not torch.get("run_py"):
        out.append(no_torch(name, node.host.python, f.get("executable")))
    else:
        out.append(Finding(name, "torch", PASS, f"torch {torch.get('version')} "
                           f"(CUDA {torch.get('cuda') or 'none'}), python {f.get('python')}"))
    out.append(interface_finding(name, f.get("network") or {}))
    out += ib_findings(name, node.host.network.ib, f.get("ib_devices") or [])
    if "script" in f:
        out.append(script_finding(node, f["script"]))
    out += processes_per_gpu(node, f, plan)
    if "health" in f:                      # the health gate's facts (remote/health.py)
        out += health_findings(name, f["health"], plan.gate, declared_gpus=node.host.gpus,
                               visible=cuda_visible(node, f))
        asked = f.get("asked") or {}
        if "sent" in asked and "time" in f:   # the check's own round trip, timed both ends
            out.append(clock_finding(name, clock_offset(
                asked["sent"], asked["received"], f.get("time_start", f["time"]), f["time"])))
    if "port_free" in f:
        out.append(Finding(name, "master port", PASS if f["port_free"] else FAIL,
                           f"port {plan.master_port} is {'free' if f['port_free'] else 'in use'} here",
                           "" if f["port_free"] else "another program listens on it: choose "
                           "another master_port (or leave it out to have one derived)"))
    return out


def visible_gpus(node: Any, f: Mapping[str, Any]) -> int | None:
    """The GPUs the node's job will see: the driver's, less those CUDA_VISIBLE_DEVICES hides
    (the job's own environment first, else the node's). None where the driver was not seen."""
    found = f.get("nvidia_gpus")
    if not isinstance(found, int):
        return None
    visible = cuda_visible(node, f)
    if visible is None:
        return found
    names = [v.strip() for v in visible.split(",")]
    return min(found, names.index("") if "" in names else len(names))   # CUDA stops at a gap


def cuda_visible(node: Any, f: Mapping[str, Any]) -> str | None:
    """The CUDA_VISIBLE_DEVICES the node's job runs with: its own environment's, else the
    node's (None: every GPU)."""
    env = {**dict(node.host.env), **dict(node.env)}
    value = env.get("CUDA_VISIBLE_DEVICES", f.get("cuda_visible"))
    return value if isinstance(value, str) else None


def asks_for_cpu(args: Sequence[str]) -> bool:
    """The job's arguments say --device cpu (the reference trainer's; the last one wins)."""
    return last_value(args, "--device") == "cpu"


def processes_per_gpu(node: Any, f: Mapping[str, Any], plan: LaunchPlan) -> list[Finding]:
    """More processes than GPUs on a node with GPUs: the job's processes past the last GPU
    fail (CUDA's 'invalid device ordinal'), unless the job runs on the CPU (--device cpu).
    A container's GPUs are the image check's (cluster doctor)."""
    nproc, gpus = node.host.nproc_per_node, visible_gpus(node, f)
    if (not isinstance(nproc, int) or not gpus or nproc <= gpus or node.host.container
            or asks_for_cpu(plan.args)):
        return []
    return [Finding(node.host.name, "gpus", FAIL, f"nproc_per_node {nproc} but this node shows "
                    f"{gpus} GPU(s): the processes past the last GPU have none",
                    f"one process per GPU: nproc_per_node {gpus} (--nproc-per-node {gpus}), or "
                    f"run on the CPU (the trainer's --device cpu, or CUDA_VISIBLE_DEVICES= in "
                    f"the node's env)")]


def no_torch(name: str, asked: str, executable: str | None) -> Finding:
    """The python asked for has no torch: most often the wrong python was asked (the system's
    python3 where torch lives in a venv), so naming another comes first."""
    which = asked if executable in (None, asked) else f"{asked} ({executable})"
    return Finding(name, "torch", FAIL, f"torch is not installed for {which}, the python "
                   f"asked for on this node",
                   f"name the python that has torch (`python:` in the inventory, or --python "
                   f"PATH), or else install torch into {executable or asked}")


def script_finding(node: Any, s: Mapping[str, Any]) -> Finding:
    """The job's script is a file on the node, where its torchrun will look (the workdir):
    found here, nothing starts anywhere, rather than after every node has started."""
    script, name = node.script_file, node.host.name
    if s.get("file"):
        return Finding(name, "script", PASS, f"{script} is there ({s.get('path')})")
    return Finding(name, "script", FAIL, f"{script} is not a file on this node (looked for "
                   f"{s.get('path')}, from the workdir {node.host.workdir})",
                   "copy it there (over SSH, --sync DIR copies DIR into the workdir first); "
                   "a relative path is read from the workdir")


RUNTIME_FIX = {
    "docker": "install docker there, start its daemon, and let this user use it (the docker group)",
    "podman": "install podman there (with uidmap and catatonit, for a user without root)",
}


def container_finding(name: str, container: Container, c: Mapping[str, Any]) -> Finding:
    """The runtime answers and the image is on the node (a pull at the start would hold every
    other node at the rendezvous meanwhile); with doctor's deeper look, whether its registry
    has an image that is not there."""
    pull = f"{container.runtime} pull {container.image}"
    if c.get("error"):
        return Finding(name, "container", FAIL, c["error"], RUNTIME_FIX[container.runtime])
    if c.get("image_id"):
        return Finding(name, "container", PASS, f"image {container.image} ({c['image_id'][:19]}), "
                       f"{c.get('version')}")
    if c.get("pullable"):
        return Finding(name, "container", WARN, f"image {container.image} is not on this node; its "
                       f"registry has it", f"pull it ahead ({pull}): a pull at the start holds "
                       f"every other node at the rendezvous")
    if "pullable" in c:
        return Finding(name, "container", FAIL, f"image {container.image} is not on this node and "
                       f"cannot be pulled: {c.get('pull_error')}",
                       f"check its name and the registry login, or `{container.runtime} load` it there")
    return Finding(name, "container", FAIL, f"image {container.image} is not on this node",
                   f"pull it there first ({pull}); cluster doctor says whether its registry has it")


def inside_findings(name: str, container: Container, gpus: Sequence[Any],
                    inside: Mapping[str, Any]) -> list[Finding]:
    """What the container sees, started as a run starts it: torch, and the node's GPUs."""
    if inside.get("error"):
        return [Finding(name, "image torch", FAIL, f"in {container.image}: {inside['error']}",
                        f"check that {container.python} in the image has torch (container.python)")]
    out = [Finding(name, "image torch", PASS, f"torch {inside.get('torch')} (CUDA "
                   f"{inside.get('cuda') or 'none'}), python {inside.get('python')} in {container.image}")]
    seen = inside.get("device_count") or 0
    if gpus and not seen:
        out.append(Finding(name, "image gpus", FAIL, f"the node has {len(gpus)} GPU(s); none is "
                           f"visible in the container", GPU_FIX[container.runtime]))
    elif gpus and seen < len(gpus):
        out.append(Finding(name, "image gpus", WARN, f"{seen} of the node's {len(gpus)} GPU(s) "
                           f"visible in the container", GPU_FIX[container.runtime]))
    elif gpus:
        out.append(Finding(name, "image gpus", PASS, f"{seen} GPU(s) visible in the container"))
    return out


GPU_FIX = {
    "docker": "install the NVIDIA container toolkit and restart docker (`--gpus all` needs it)",
    "podman": "generate the CDI spec: nvidia-ctk cdi generate --output=/etc/cdi/nvidia.yaml",
}


def interface_finding(name: str, net: Mapping[str, Any]) -> Finding:
    if net.get("error"):
        have = ", ".join(net.get("interfaces") or []) or "none"
        return Finding(name, "interface", FAIL, net["error"],
                       f"set network.ifname to one this node has ({have}), or fix its address")
    text = f"{net.get('ifname')} ({net.get('how')})"
    if net.get("warning"):
        return Finding(name, "interface", WARN, f"{text}; {net['warning']}",
                       "check the routes, or set network.ifname")
    return Finding(name, "interface", PASS, text)


def ib_findings(name: str, policy: str, devices: Sequence[str]) -> list[Finding]:
    if policy == "on" and not devices:
        return [Finding(name, "infiniband", FAIL, "ib: on, but /sys/class/infiniband is empty",
                        "set network.ib to off or auto on this node")]
    if policy == "off" and devices:
        return [Finding(name, "infiniband", WARN, f"ib: off, yet the node has {', '.join(devices)}",
                        "set network.ib to auto to let NCCL use them")]
    return []


def reach_finding(name: str, r: Mapping[str, Any], plan: LaunchPlan) -> Finding:
    target = f"{plan.master_addr}:{plan.master_port}"
    if r.get("ok"):
        return Finding(name, "reach master", PASS, f"connected to {target} in {r.get('seconds', 0):.3f} s")
    return Finding(name, "reach master", FAIL, f"cannot connect to {target}: {r.get('error')}",
                   f"allow TCP from this node to {plan.master.host.name} port {plan.master_port} "
                   f"(firewall, security group), or choose another master_port")


# --- doctor's deeper look ---------------------------------------------------------------------


def listed_gpus(f: Mapping[str, Any]) -> list[Any]:
    """The GPUs a node's facts list (none when the probe could not list them)."""
    found = f.get("gpus")
    return found if isinstance(found, list) else []


def deep_findings(node: Any, f: Mapping[str, Any], clock: Clock | None) -> list[Finding]:
    name, out = node.host.name, []
    rt = f.get("torch_runtime") or {}
    gpus = listed_gpus(f)
    if node.host.container:
        if "inside" in f:
            out += inside_findings(name, node.host.container, gpus, f["inside"])
    elif rt.get("error") and (f.get("torch") or {}).get("run_py"):   # else the torch check said it
        exe = f.get("executable") or node.host.python
        out.append(Finding(name, "torch import", FAIL, f"importing torch with {exe}: {rt['error']}",
                           f"reinstall torch for {exe}, or name a python whose torch imports "
                           f"(`python:` in the inventory, or --python PATH)"))
    nproc = node.host.nproc_per_node
    if isinstance(nproc, int) and gpus and nproc > len(gpus) and isinstance(f.get("nvidia_gpus"), int):
        pass                     # node_findings judged it from the driver's count (processes_per_gpu)
    elif isinstance(nproc, int) and gpus and nproc > len(gpus):
        out.append(Finding(name, "gpus", FAIL, f"nproc_per_node {nproc} but {len(gpus)} GPU(s)",
                           f"set nproc_per_node to {len(gpus)} (or auto)"))
    elif isinstance(nproc, int) and gpus and nproc < len(gpus):
        out.append(Finding(name, "gpus", WARN, f"nproc_per_node {nproc} leaves "
                           f"{len(gpus) - nproc} of {len(gpus)} GPU(s) idle", "set nproc_per_node: auto"))
    elif gpus:
        out.append(Finding(name, "gpus", PASS, f"{len(gpus)} x {gpus[0]['name']}, driver {gpus[0]['driver']}"))
    busy = [g for g in gpus if g.get("processes") or (g.get("memory_used_mib") or 0) > 1024]
    if busy:
        out.append(Finding(name, "gpus busy", WARN, "; ".join(
            f"GPU {g['index']}: {g.get('processes')} process(es), {g.get('memory_used_mib') or 0:.0f} MiB used"
            for g in busy), "another job holds these GPUs: wait, or stop it"))
    out += threshold(name, "/dev/shm", f.get("shm_bytes"), 1 * GIB, None,
                     "DataLoader workers and NCCL use shared memory: mount a larger /dev/shm "
                     "(docker: --shm-size or --ipc=host; a container key gets host IPC)")
    out += threshold(name, "disk", f.get("disk_free_bytes"), 5 * GIB, 1 * GIB,
                     "free space in the workdir (checkpoints)")
    nofile = f.get("nofile")
    if nofile is not None and nofile < 4096:
        out.append(Finding(name, "open files", WARN, f"ulimit -n is {nofile}",
                           "raise it to 65536 (limits.conf, or ulimit -n in the node's setup)"))
    if clock is not None:
        out.append(clock_finding(name, clock))
    return out


def clock_finding(name: str, clock: Clock) -> Finding:
    """Judged on what is certain: the offset less its error bound, so that a slow round trip
    (a loaded machine, a slow login) never looks like a skewed clock."""
    surely = abs(clock.offset) - clock.error
    status = FAIL if surely > CLOCK_FAIL else WARN if surely > CLOCK_WARN else PASS
    return Finding(name, "clock", status, f"{clock.offset:+.3f} s from this machine, "
                   f"give or take {clock.error:.3f} s (half the round trip)",
                   "" if status == PASS else "run chrony or ntpd on the nodes (and here)")


def threshold(name: str, what: str, value: float | None, warn_below: float,
              fail_below: float | None, fix: str) -> list[Finding]:
    if value is None:
        return []
    text = f"{value / GIB:.1f} GiB"
    if fail_below is not None and value < fail_below:
        return [Finding(name, what, FAIL, text, fix)]
    if value < warn_below:
        return [Finding(name, what, WARN, text, fix)]
    return [Finding(name, what, PASS, text)]


# --- across nodes: the same software where it matters -------------------------------------------


def fingerprint(facts: Facts, *, deep: bool = False) -> dict[str, dict[str, list[str]]]:
    """Attribute -> value -> the nodes that have it: one row per value, not one per node."""
    rows: dict[str, dict[str, list[str]]] = {}

    def put(attr: str, node: str, value: Any) -> None:
        rows.setdefault(attr, {}).setdefault(str(value), []).append(node)
    for node, f in facts.items():
        torch, container, inside = f.get("torch"), f.get("container"), f.get("inside") or {}
        put("python", node, f.get("python"))
        if container:                   # torch is the image's: the same image, and what it holds
            found = container.get("image_id") or ("unknown" if container.get("error") else "absent")
            put("image", node, f"{container.get('image')} {found[:19]}")
            if inside.get("torch"):
                put("torch", node, inside["torch"])
                put("torch CUDA", node, inside.get("cuda"))
        elif torch:               # a node without torch fails on its own; no second row
            put("torch", node, torch.get("version"))
            put("torch CUDA", node, torch.get("cuda"))
        if deep:
            rt = inside if container else (f.get("torch_runtime") or {})
            gpus = listed_gpus(f)
            put("NCCL", node, rt.get("nccl"))
            put("cuDNN", node, rt.get("cudnn"))
            put("driver", node, gpus[0]["driver"] if gpus else None)
            put("GPU", node, f"{len(gpus)} x {gpus[0]['name']}" if gpus else "none")
    return rows


# Differences that break a job fail; the others warn.
BREAKING = {"torch", "NCCL"}


def agreement(facts: Facts, *, deep: bool = False) -> list[Finding]:
    out = []
    for attr, values in fingerprint(facts, deep=deep).items():
        if len(values) < 2:
            continue
        detail = "; ".join(f"{v} on {', '.join(nodes)}" for v, nodes in values.items())
        status = FAIL if attr in BREAKING or (attr == "torch CUDA" and _majors(values) > 1) else WARN
        out.append(Finding("all", f"same {attr}", status, f"{attr} differs: {detail}",
                           f"install the same {attr} on every node"))
    return out


def _majors(values: Mapping[str, list[str]]) -> int:
    return len({v.split(".")[0] for v in values})
