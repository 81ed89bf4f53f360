"""The health gate's verdicts on a node's hardware facts (cluster.recovery.hardware), by table:
each fault is named with its evidence, a healthy node and a CPU node pass."""
from __future__ import annotations

from typing import Any

import pytest

from cluster.recovery.findings import FAIL, PASS, WARN
from cluster.recovery.hardware import hardware_failures, health_findings, job_gpus
from cluster.spec import Gate

GIB = 1 << 30


def gpu(i: int, **over: Any) -> dict[str, Any]:
    return {"index": i, "uuid": f"GPU-{i:04d}aaaa", "name": "NVIDIA H200",
            "bus_id": f"00000000:{0x18 + i:02X}:00.0", "driver": "580.159.04",
            "memory_used_mib": 0.0, "memory_total_mib": 143771.0, "ecc_uncorrected": 0,
            "retired_pending": None, "remapped_pending": False, "remapped_failure": False,
            "lost": False, **over}


def node(gpus: list[dict[str, Any]] | None = None, apps: list[dict[str, Any]] | None = None,
         driver: int | None = 8, xid: list[dict[str, Any]] | None = None,
         disk: float = 500 * GIB, memory: float = 1500 * GIB, error: str | None = None) -> dict:
    gpus = [gpu(i) for i in range(8)] if gpus is None else gpus
    return {"nvidia": {"gpus": gpus, "apps": apps or [], "error": error, "driver_gpus": driver},
            "xid": {"source": "dmesg", "events": xid or [],
                    "counts": {str(e["code"]): 1 for e in xid or []}},
            "disk": {"/home/u/cluster-runs": disk}, "memory_available_bytes": memory}


def failed(findings) -> list[tuple[str, str]]:
    return [(f.check, f.detail) for f in findings if f.status == FAIL]


def test_a_healthy_h200_node_passes() -> None:
    found = health_findings("node2", node(), Gate())
    assert failed(found) == []
    assert [f.status for f in found if f.check == "gpu health"] == [PASS]


def test_a_cpu_node_is_never_failed_for_gpu_facts() -> None:
    facts = {"nvidia": None, "xid": None, "disk": {"/w": 500 * GIB}, "memory_available_bytes": GIB * 64}
    assert health_findings("cpu1", facts, Gate(), declared_gpus=8) == []


def test_a_foreign_process_holding_70_gib_on_gpu_3_is_named_with_pid_user_and_command() -> None:
    apps = [{"gpu_uuid": "GPU-0003aaaa", "gpu_index": 3, "pid": 4242, "used_mib": 71680.0,
             "name": "python", "user": "bob", "command": "python old_train.py --epochs 90"}]
    (check, detail), = failed(health_findings("node2", node(apps=apps), Gate()))
    assert check == "gpu memory"
    assert detail == "GPU 3: PID 4242 (user bob, python old_train.py --epochs 90) holds 70.0 GiB"


def test_a_small_holder_and_one_on_a_hidden_gpu_pass() -> None:
    apps = [{"gpu_uuid": "GPU-0001aaaa", "pid": 1, "used_mib": 300.0},
            {"gpu_uuid": "GPU-0005aaaa", "pid": 2, "used_mib": 70000.0}]
    assert failed(health_findings("n", node(apps=apps), Gate(), visible="0,1,2,3")) == []
    assert failed(health_findings("n", node(apps=apps), Gate(gpu_memory_held_mib=100),
                                  visible="0,1,2,3"))[0][1].startswith("GPU 1: PID 1")


def test_uncorrectable_ecc_and_a_pending_remap_fail_and_count_as_hardware() -> None:
    gpus = [gpu(i) for i in range(8)]
    gpus[5] = gpu(5, ecc_uncorrected=3)
    gpus[6] = gpu(6, remapped_pending=True)
    found = health_findings("node2", node(gpus=gpus), Gate())
    assert [c for c, _ in failed(found)] == ["ecc", "ecc"]
    assert "GPU 5 (00000000:1D:00.0): 3 uncorrectable ECC error(s)" in failed(found)[0][1]
    assert list(hardware_failures(found)) == ["node2"]
    assert failed(health_findings("node2", node(gpus=gpus), Gate(ecc_uncorrected=5)))[0][1] \
        .startswith("GPU 6")


@pytest.mark.parametrize("driver, declared, want", [
    (8, None, "the driver has 8 GPU(s), nvidia-smi lists 7: 1 cannot be read"),
    (None, 8, "the inventory says gpus: 8, nvidia-smi lists 7"),
])
def test_a_missing_gpu(driver: int | None, declared: int | None, want: str) -> None:
    found = health_findings("node2", node(gpus=[gpu(i) for i in range(7)], driver=driver),
                            Gate(), declared_gpus=declared)
    assert failed(found) == [("gpu health", want)]


def test_a_lost_gpu_and_a_failing_nvidia_smi() -> None:
    gpus = [gpu(i) for i in range(8)]
    gpus[2] = gpu(2, lost=True)
    assert failed(health_findings("n", node(gpus=gpus), Gate())) == [
        ("gpu health", "GPU 2 (00000000:1A:00.0) is lost: nvidia-smi cannot read it")]
    err = "Unable to determine the device handle for GPU0000:1A:00.0: Unknown Error"
    assert failed(health_findings("n", node(error=err), Gate())) == [
        ("gpu health", f"nvidia-smi failed: {err}")]


def test_xid_79_fails_13_is_the_programs_and_63_warns() -> None:
    line = "NVRM: Xid (PCI:0000:1b:00): 79, pid=1234, GPU has fallen off the bus."
    xid = [{"code": 13, "bus": "0000:1a:00", "text": "NVRM: Xid (PCI:0000:1a:00): 13, ..."},
           {"code": 79, "bus": "0000:1b:00", "text": line},
           {"code": 63, "bus": "0000:1c:00", "text": "NVRM: Xid (PCI:0000:1c:00): 63, ..."}]
    found = [f for f in health_findings("n", node(xid=xid), Gate()) if f.check == "xid"]
    assert [(f.status, f.detail.split(" (")[0]) for f in found] == [(FAIL, "Xid 79"), (WARN, "Xid 63")]
    assert line in found[0].detail


def test_disk_and_memory_below_the_gate() -> None:
    found = failed(health_findings("n", node(disk=2 * GIB, memory=GIB), Gate()))
    assert found == [("disk", "2.0 GiB free in /home/u/cluster-runs, below gate.min_free_disk_gib 10"),
                     ("memory", "1.0 GiB available, below gate.min_free_memory_gib 2")]
    assert hardware_failures(health_findings("n", node(disk=2 * GIB), Gate())) == {}


def test_cuda_visible_devices_by_index_uuid_and_a_gap() -> None:
    gpus = [gpu(i) for i in range(4)]
    assert [g["index"] for g in job_gpus(gpus, "2,GPU-0000")] == [2, 0]
    assert [g["index"] for g in job_gpus(gpus, "1,,3")] == [1]
    assert job_gpus(gpus, "") == [] and len(job_gpus(gpus, None)) == 4


def test_the_check_judges_the_gate_and_the_clock_from_its_own_round_trip() -> None:
    from cluster import inventory
    from cluster.plan import Job, Templates, render
    from cluster.recovery.gate import evaluate
    plan = render(inventory.parse_yaml("hosts: [a, b]\n", "x.yaml"), Job(run_id="r", script="t.py"),
                  Templates())
    base = {"torch": {"run_py": "/x", "version": "2.13"}, "network": {"ifname": "eth0", "how": "x"}}
    healthy = {"nvidia": None, "disk": {"/w": 500 * GIB}, "memory_available_bytes": 64 * GIB}
    facts = {"a": {**base, "health": healthy, "asked": {"sent": 1000.0, "received": 1000.2},
                   "time_start": 1000.05, "time": 1000.1},
             "b": {**base, "health": node(disk=GIB), "asked": {"sent": 1000.0, "received": 1000.2},
                   "time_start": 1120.05, "time": 1120.1}}       # b's clock is two minutes ahead
    found = failed(evaluate(plan, facts))
    assert ("clock", "+119.975 s from this machine, give or take 0.075 s (half the round trip)") \
        in found, found
    assert [c for c, _ in found] == ["disk", "clock"], "a passes; b fails on its disk and clock"
