"""The health gate's verdicts on what a node said of its hardware (remote/health.py's facts):
its GPUs all there and none lost, none of the job's GPUs held by another process, ECC and the
kernel's XID reports, free disk and memory. Pure: facts and the gate's settings in, findings out.

A CPU node (no nvidia-smi) is never failed for GPU facts. Only the job's GPUs are judged (those
CUDA_VISIBLE_DEVICES leaves it, else all): another job on the GPUs it hides is not ours to judge.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..spec import Gate
from .findings import FAIL, GIB, PASS, WARN, Finding

# NVIDIA's XID catalogue (docs.nvidia.com/deploy/xid-errors): the codes that say the hardware, not
# the program, failed. Since boot, one of these leaves the GPU unfit until it is reset or serviced.
XID_FAIL = {
    48: "double-bit ECC error",
    62: "internal micro-controller halt",
    64: "ECC page retirement or row remapping failed",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
    140: "unrecovered ECC error",
}
# ... and those worth a word: the GPU may run, but they come before the ones above.
XID_WARN = {
    61: "internal micro-controller breakpoint",
    63: "ECC page retirement or row remapping recorded (applied at the next reset)",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
}
# The checks whose failure is the hardware's: they count against the node in the ledger. The
# others (another job's process, a full disk) are the operator's to clear and count for nothing.
HARDWARE_CHECKS = frozenset({"gpu health", "ecc", "xid"})
GATE_CHECKS = HARDWARE_CHECKS | {"gpu memory", "disk", "memory", "clock"}
RESET_FIX = ("drain the node and reset the GPU (nvidia-smi -r, or reboot it), then "
             "`cluster nodes release NODE`; or leave it out (--exclude NODE)")


def health_findings(name: str, health: Mapping[str, Any], gate: Gate, *,
                    declared_gpus: int | None = None,
                    visible: str | None = None) -> list[Finding]:
    """Every verdict on one node. declared_gpus: the inventory's `gpus` for it; visible: the
    CUDA_VISIBLE_DEVICES its job runs with (None: every GPU)."""
    out: list[Finding] = []
    nvidia = health.get("nvidia")
    if isinstance(nvidia, Mapping):
        out += gpu_findings(name, nvidia, declared_gpus, visible, gate)
        out += xid_findings(name, health.get("xid") or {})
    out += space_findings(name, health, gate)
    return out


# --- GPUs ---------------------------------------------------------------------------------------


def job_gpus(gpus: Sequence[Mapping[str, Any]], visible: str | None) -> list[Mapping[str, Any]]:
    """The GPUs the job will use: CUDA_VISIBLE_DEVICES names them by index or by UUID (a
    prefix is enough) and stops at the first name it cannot match."""
    if visible is None:
        return list(gpus)
    chosen: list[Mapping[str, Any]] = []
    for word in (w.strip() for w in visible.split(",")):
        match = [g for g in gpus if word and (str(g.get("index")) == word
                                              or str(g.get("uuid") or "").startswith(word))]
        if len(match) != 1:
            break
        chosen.append(match[0])
    return chosen


def gpu_findings(name: str, nvidia: Mapping[str, Any], declared: int | None,
                 visible: str | None, gate: Gate) -> list[Finding]:
    if nvidia.get("error"):
        return [Finding(name, "gpu health", FAIL, f"nvidia-smi failed: {nvidia['error']}",
                        "check the driver on that node (nvidia-smi); " + RESET_FIX)]
    gpus = list(nvidia.get("gpus") or [])
    out = count_findings(name, gpus, nvidia.get("driver_gpus"), declared)
    mine = job_gpus(gpus, visible)
    out += [Finding(name, "gpu health", FAIL, f"GPU {g.get('index')} ({g.get('bus_id')}) is lost: "
                    f"nvidia-smi cannot read it", RESET_FIX) for g in mine if g.get("lost")]
    out += ecc_findings(name, mine, gate)
    out += holder_findings(name, mine, nvidia.get("apps") or [], gate)
    if gpus and not any(f.status == FAIL for f in out):
        out.append(Finding(name, "gpu health", PASS, f"{len(gpus)} x {gpus[0].get('name')}, "
                           f"driver {gpus[0].get('driver')}, none held by another process"))
    return out


def count_findings(name: str, gpus: Sequence[Mapping[str, Any]], driver: Any,
                   declared: int | None) -> list[Finding]:
    """A GPU the driver has and nvidia-smi does not list has fallen off; one the inventory
    declares and the node does not show is missing."""
    out = []
    if isinstance(driver, int) and driver > len(gpus):
        out.append(Finding(name, "gpu health", FAIL, f"the driver has {driver} GPU(s), nvidia-smi "
                           f"lists {len(gpus)}: {driver - len(gpus)} cannot be read", RESET_FIX))
    elif declared is not None and len(gpus) < declared:
        out.append(Finding(name, "gpu health", FAIL, f"the inventory says gpus: {declared}, nvidia-smi "
                           f"lists {len(gpus)}", "find the missing GPU (nvidia-smi -L, the kernel "
                           "log); or correct gpus: for that host"))
    return out


def ecc_findings(name: str, gpus: Sequence[Mapping[str, Any]], gate: Gate) -> list[Finding]:
    out = []
    for g in gpus:
        where = f"GPU {g.get('index')} ({g.get('bus_id')})"
        errors = g.get("ecc_uncorrected")
        if isinstance(errors, int) and errors > gate.ecc_uncorrected:
            out.append(Finding(name, "ecc", FAIL, f"{where}: {errors} uncorrectable ECC "
                               f"error(s) (gate.ecc_uncorrected {gate.ecc_uncorrected})", RESET_FIX))
        if g.get("remapped_failure"):
            out.append(Finding(name, "ecc", FAIL, f"{where}: row remapping failed", "the GPU "
                               "needs service (RMA); leave the node out (--exclude NODE)"))
        elif g.get("remapped_pending") or g.get("retired_pending"):
            out.append(Finding(name, "ecc", FAIL, f"{where}: a row remap or page retirement is "
                               f"pending (it applies at the GPU's next reset)", RESET_FIX))
    return out


def holder_findings(name: str, gpus: Sequence[Mapping[str, Any]],
                    apps: Sequence[Mapping[str, Any]], gate: Gate) -> list[Finding]:
    """Before a start nothing of this run holds a GPU: a process that does is another job's
    (yesterday's stale run is the commonest "CUDA out of memory" at step 0)."""
    index = {g.get("uuid"): g.get("index") for g in gpus}
    out = []
    for app in apps:
        if app.get("gpu_uuid") not in index:
            continue
        held = app.get("used_mib")
        if isinstance(held, (int, float)) and held <= gate.gpu_memory_held_mib:
            continue
        amount = f"{held / 1024:.1f} GiB" if isinstance(held, (int, float)) else "memory"
        who = f"user {app.get('user') or 'unknown'}, {app.get('command') or app.get('name') or '?'}"
        out.append(Finding(name, "gpu memory", FAIL, f"GPU {index[app.get('gpu_uuid')]}: PID "
                           f"{app.get('pid')} ({who}) holds {amount}",
                           f"stop it on {name} (kill {app.get('pid')}) or wait for it; or give "
                           f"the job other GPUs (CUDA_VISIBLE_DEVICES in the node's env)"))
    return out


def xid_findings(name: str, xid: Mapping[str, Any]) -> list[Finding]:
    """The kernel's XID reports since boot, the worst code first; one line per code."""
    out = []
    seen: dict[int, Mapping[str, Any]] = {}
    for event in xid.get("events") or []:
        seen[int(event.get("code", -1))] = event            # the last of each code
    counts = xid.get("counts") or {}
    for code in sorted(seen, key=lambda c: (c not in XID_FAIL, c)):
        table = XID_FAIL if code in XID_FAIL else XID_WARN if code in XID_WARN else None
        if table is None:
            continue                # the program's own (13, 31, 43: a fault in its kernels)
        times = counts.get(str(code), counts.get(code, 1))
        detail = (f"Xid {code} ({table[code]}) on {seen[code].get('bus')}, {times} time(s) since "
                  f"boot: {seen[code].get('text')}")
        out.append(Finding(name, "xid", FAIL if code in XID_FAIL else WARN, detail,
                           RESET_FIX if code in XID_FAIL else "watch it; reset the GPU if it repeats"))
    return out


# --- disk and memory ------------------------------------------------------------------------------


def space_findings(name: str, health: Mapping[str, Any], gate: Gate) -> list[Finding]:
    out = []
    for path, free in (health.get("disk") or {}).items():
        if isinstance(free, (int, float)) and free < gate.min_free_disk_gib * GIB:
            out.append(Finding(name, "disk", FAIL, f"{free / GIB:.1f} GiB free in {path}, below "
                               f"gate.min_free_disk_gib {gate.min_free_disk_gib:g}",
                               "free space there (old checkpoints, caches), or lower "
                               "gate.min_free_disk_gib"))
    memory = health.get("memory_available_bytes")
    if isinstance(memory, (int, float)) and memory < gate.min_free_memory_gib * GIB:
        out.append(Finding(name, "memory", FAIL, f"{memory / GIB:.1f} GiB available, below "
                           f"gate.min_free_memory_gib {gate.min_free_memory_gib:g}",
                           "stop what holds it (another job?), or lower gate.min_free_memory_gib"))
    return out


def hardware_failures(findings: Sequence[Finding]) -> dict[str, list[Finding]]:
    """Per node, its failed checks that are the hardware's (what the ledger counts)."""
    out: dict[str, list[Finding]] = {}
    for f in findings:
        if f.status == FAIL and f.check in HARDWARE_CHECKS and f.node != "all":
            out.setdefault(f.node, []).append(f)
    return out
