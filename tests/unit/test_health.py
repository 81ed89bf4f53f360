"""remote/health.py, the probe's --health facts: its parsers by table against nvidia-smi's
answers (tests/unit/fixtures/nvidia_smi, whose README says which were recorded and which built),
then the whole of it through real processes: the stand-in nvidia-smi and dmesg of tests/fakes
first on PATH, answering from a fixture set."""
from __future__ import annotations

import json
import os
import pwd
import shutil
import sys
import time
from pathlib import Path

import pytest

from cluster.backends.shipping import boot_command, program
from cluster.nodes import read_answer

REMOTE = Path(__file__).resolve().parents[2] / "cluster" / "remote"
sys.path.insert(0, str(REMOTE))     # as on the node: containers.py beside it
import health  # noqa: E402

SETS = Path(__file__).resolve().parent / "fixtures" / "nvidia_smi"
FAKES = Path(__file__).resolve().parents[1] / "fakes"


def answer(name: str, kind: str, fields: tuple[str, ...]) -> str:
    """What the set's nvidia-smi prints for a query of these fields (the columns of its file,
    as tests/fakes/nvidia-smi answers)."""
    lines = (SETS / name / f"{kind}.csv").read_text().splitlines()
    have = lines[0].split(":", 1)[1].strip().split(",")
    rows = [line.split(", ", len(have) - 1) for line in lines[1:]]
    return "".join(", ".join(r[have.index(f)] for f in fields) + "\n" for r in rows)


def gpus_of(name: str, fields: tuple[str, ...] = health.GPU_FIELDS) -> list[dict]:
    return [health.gpu_entry(r) for r in health.rows(answer(name, "gpu", fields), fields)]


# --- the parsers ------------------------------------------------------------------------------

def test_a_healthy_h200_box() -> None:
    gpus = gpus_of("healthy_h200x8")
    assert [g["index"] for g in gpus] == list(range(8))
    assert gpus[0] == {"index": 0, "uuid": "GPU-be530ebb-9f9b-8860-8c4f-dad003b4bbf6",
                       "name": "NVIDIA H200", "bus_id": "00000000:18:00.0",
                       "driver": "580.159.04", "memory_used_mib": 0, "memory_total_mib": 143771,
                       "ecc_uncorrected": 0, "retired_pending": None, "remapped_pending": False,
                       "remapped_failure": False, "lost": False}


@pytest.mark.parametrize("name, index, expect", [
    ("ecc", 6, {"ecc_uncorrected": 2, "remapped_pending": True, "lost": False}),
    ("foreign_process", 3, {"memory_used_mib": 72246, "lost": False}),
    ("lost_gpu", 5, {"lost": True, "memory_used_mib": None, "ecc_uncorrected": None,
                     "remapped_pending": None, "name": "NVIDIA H200"}),
])
def test_a_faulty_gpu_reads_as_it_is(name: str, index: int, expect: dict) -> None:
    gpus = gpus_of(name)
    assert {k: gpus[index][k] for k in expect} == expect
    assert [g["index"] for g in gpus if g["lost"]] == ([index] if expect["lost"] else [])


def test_a_gpu_missing_from_the_list() -> None:
    assert [g["index"] for g in gpus_of("missing_gpu")] == list(range(7))
    assert (SETS / "missing_gpu" / "driver_gpus").read_text().strip() == "8"


def test_the_fields_an_older_driver_answers_leave_the_others_none() -> None:
    fields = health.without_family(health.GPU_FIELDS, "remapped_rows.pending")
    [g] = gpus_of("r535_fields", fields)[:1]
    assert (g["ecc_uncorrected"], g["remapped_pending"], g["remapped_failure"]) == (0, None, None)
    assert g["driver"] == "535.183.01" and not g["lost"]


def test_the_processes_holding_gpu_memory() -> None:
    by_uuid = {g["uuid"]: g["index"] for g in gpus_of("foreign_process")}
    said = answer("foreign_process", "apps", health.APP_FIELDS)
    [app] = [health.app_entry(r, by_uuid) for r in health.rows(said, health.APP_FIELDS)]
    assert {k: app[k] for k in ("gpu_index", "pid", "used_mib", "name")} == {
        "gpu_index": 3, "pid": 48213, "used_mib": 71680, "name": "/usr/bin/python3"}
    assert health.rows(answer("healthy_h200x8", "apps", health.APP_FIELDS), health.APP_FIELDS) == []


def test_a_process_name_with_commas_stays_whole() -> None:
    [row] = health.rows("GPU-1, 7, 100, /opt/a, b/python\n", health.APP_FIELDS)
    assert row["process_name"] == "/opt/a, b/python"


@pytest.mark.parametrize("text, value, fault", [
    ("143771", "143771", False), ("[N/A]", None, False), ("N/A", None, False),
    ("[Not Supported]", None, False), ("[Insufficient Permissions]", None, False),
    ("[GPU is lost]", None, True), ("[GPU requires reset]", None, True),
    ("[Unknown Error]", None, True), ("Unknown Error", None, True),
])
def test_what_a_field_says(text: str, value: str | None, fault: bool) -> None:
    assert (health.value(text), health.is_fault(text)) == (value, fault)


@pytest.mark.parametrize("text, flag", [("Yes", True), ("No", False), ("1", True), ("0", False),
                                        ("[N/A]", None), (None, None), ("[GPU is lost]", None)])
def test_a_flag(text: str | None, flag: bool | None) -> None:
    assert health.yes_no(text) is flag


@pytest.mark.parametrize("said, field", [
    ('Field "remapped_rows.pending" is not a valid field to query.\n', "remapped_rows.pending"),
    ('Field "cuda_version" is not a valid field to query.\n', "cuda_version"),
    ("No devices were found\n", None),
    ("0, GPU-1, NVIDIA H200\n", None),
])
def test_a_field_the_driver_refuses(said: str, field: str | None) -> None:
    assert health.refused_field(said) == field


def test_a_refused_field_costs_its_family_then_the_basic_fields() -> None:
    fewer = health.without_family(health.GPU_FIELDS, "remapped_rows.failure")
    assert fewer == health.GPU_FIELDS[:-2]
    assert health.without_family(fewer, "retired_pages.pending") == health.GPU_FIELDS[:-3]
    assert health.without_family(fewer, "pci.bus_id") == health.BASIC_FIELDS
    assert health.without_family(fewer, "no.such") == health.BASIC_FIELDS


@pytest.mark.parametrize("name", ["smi_fails", "no_driver", "no_devices"])
def test_what_a_failed_query_said(name: str) -> None:
    said = (SETS / name / "gpu.out").read_text()
    assert health.failure(15, said, health.GPU_FIELDS) == said.strip()


def test_a_failure_among_rows_keeps_the_rows() -> None:
    said = (answer("missing_gpu", "gpu", health.GPU_FIELDS)
            + "Unable to determine the device handle for GPU0000:DB:00.0: Unknown Error\n")
    assert len(health.rows(said, health.GPU_FIELDS)) == 7
    assert health.failure(15, said, health.GPU_FIELDS) == (
        "Unable to determine the device handle for GPU0000:DB:00.0: Unknown Error")
    said = "no answer within 20 s"
    assert health.failure(None, said, health.GPU_FIELDS) == said


@pytest.mark.parametrize("line, found", [
    ("[ 8712.3] NVRM: Xid (PCI:0000:ab:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen "
     "off the bus.", (79, "0000:ab:00")),
    ("NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus.", (79, "0000:3b:00")),
    ("NVRM: Xid (PCI:0000:01:00): 79, GPU has fallen off the bus.", (79, "0000:01:00")),
    ("Feb 14 05:03:41 gpu-1 kernel: NVRM: Xid (PCI:0002:00:00): 13, pid=2519562, name=python3, "
     "Graphics Exception: ChID 000c", (13, "0002:00:00")),
    ("NVRM: Xid (0000:03:00): 14, Channel 00000001", (14, "0000:03:00")),
    ("NVRM: Xid (PCI:0000:B3:00.0): 79, pid=12345, GPU has fallen off the bus.",
     (79, "0000:b3:00")),
    ("NVRM: Xid (PCI:0000:01:00): 16, Head 00000000 Count 0000088a", (16, "0000:01:00")),
    ("NVRM: GPU at PCI:0000:ab:00: GPU-0c0ffee0-0000-4000-8000-000000000005", None),
    ("NVRM: GPU 0000:ab:00.0: GPU has fallen off the bus.", None),
    ("kernel: usb 1-1: Xid (PCI:0000:01:00): 79, a line of no driver", None),
    ("NVRM: Xid (PCI:0000:01:00): remapped, no code", None),
])
def test_an_xid_line(line: str, found: tuple | None) -> None:
    assert health.xid_of(line) == found


def test_the_kernel_logs_xid_lines_counted_and_the_last_kept() -> None:
    summary = health.xid_summary((SETS / "lost_gpu" / "dmesg.txt").read_text())
    assert summary["counts"] == {"13": 2, "79": 1}
    assert [(e["code"], e["bus"]) for e in summary["events"]] == [
        (13, "0000:2a:00"), (13, "0000:2a:00"), (79, "0000:ab:00")]
    many = "".join(f"NVRM: Xid (PCI:0000:2a:00): 13, pid={i}, {'x' * 400}\n" for i in range(25))
    summary = health.xid_summary(many)
    assert summary["counts"] == {"13": 25} and len(summary["events"]) == 20
    assert "pid=5," in summary["events"][0]["text"] and len(summary["events"][0]["text"]) == 300
    json.dumps(summary)


@pytest.mark.parametrize("source, code, said, problem", [
    ("dmesg", 0, "[ 1.0] hello\n", None),
    ("dmesg", 1, "dmesg: read kernel buffer failed: Operation not permitted\n",
     "dmesg: read kernel buffer failed: Operation not permitted"),
    ("dmesg", None, "No such file or directory", "No such file or directory"),
    ("journalctl", 1, "-- No entries --\n", None),
    ("journalctl", 0, "Hint: You are currently not seeing messages from other users and the "
     "system.\n", "Hint: You are currently not seeing messages from other users and the system."),
    ("journalctl", 1, "No journal files were opened due to insufficient permissions.\n",
     "No journal files were opened due to insufficient permissions."),
    ("journalctl", 1, "Compiled without pattern matching support\n",
     "Compiled without pattern matching support"),
])
def test_whether_a_kernel_log_was_read(source: str, code: int | None, said: str,
                                       problem: str | None) -> None:
    assert health.log_problem(source, code, said) == problem


def test_free_disk_where_a_folder_is_or_would_be(tmp_path: Path) -> None:
    st = os.statvfs(tmp_path)
    free = health.free_bytes(str(tmp_path / "not" / "yet"))
    assert free is not None and abs(free - st.f_bavail * st.f_frsize) < 1 << 30


def test_available_memory(tmp_path: Path) -> None:
    (tmp_path / "meminfo").write_text("MemTotal: 100 kB\nMemAvailable:    2048 kB\n")
    assert health.memory_available(str(tmp_path / "meminfo")) == 2048 * 1024
    assert health.memory_available(str(tmp_path / "none")) is None
    assert isinstance(health.memory_available(), int)


# --- through real processes: the stand-ins on PATH --------------------------------------------

def node_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, scenario: str | None,
              system: bool = True, **scripts: str) -> Path:
    """A node's PATH: the stand-in nvidia-smi and dmesg answering from the scenario's set (none
    of them with scenario None), then any script given by name, then the system's folders
    (none with system False: the CI tier that runs as on a GPU machine has nvidia-smi there)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if scenario is not None:
        for tool in ("nvidia-smi", "dmesg"):
            (bin_dir / tool).symlink_to(FAKES / tool)
        (bin_dir / "scenario").write_text(scenario + "\n")
    for name, text in scripts.items():
        (bin_dir / name).write_text("#!/bin/sh\n" + text)
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin" if system else str(bin_dir))
    return bin_dir


def driver_dir(tmp_path: Path, name: str) -> str:
    """/proc/driver/nvidia/gpus as the set has it."""
    folder = tmp_path / "driver"
    count = SETS / name / "driver_gpus"
    if count.exists():
        folder.mkdir()
        for i in range(int(count.read_text())):
            (folder / f"0000:{i:02x}:00.0").mkdir()
    return str(folder)


def facts(tmp_path: Path, name: str, *extra: str) -> dict:
    out = health.health_facts(str(tmp_path), extra, driver_dir=driver_dir(tmp_path, name))
    assert json.loads(json.dumps(out)) == out
    return out


def copy_set(tmp_path: Path, name: str) -> Path:
    folder = tmp_path / "set"
    shutil.copytree(SETS / name, folder)
    return folder


def test_a_healthy_box_through_the_real_processes(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    node_path(tmp_path, monkeypatch, "healthy_h200x8")
    out = facts(tmp_path, "healthy_h200x8", str(tmp_path / "ckpt" / "run1"))
    nv = out["nvidia"]
    assert nv["gpus"] == gpus_of("healthy_h200x8")
    assert (nv["apps"], nv["error"], nv["refused"], nv["driver_gpus"]) == ([], None, [], 8)
    assert out["xid"] == {"source": "dmesg", "error": None, "events": [], "counts": {}}
    assert set(out["disk"]) == {str(tmp_path), str(tmp_path / "ckpt" / "run1")}
    assert all(isinstance(v, int) for v in out["disk"].values())
    assert isinstance(out["memory_available_bytes"], int) and 0 <= out["seconds"] < 20


def test_another_users_process_is_named_with_its_owner_and_command(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The set's process is this test's own: /proc shows its owner and command line."""
    folder = copy_set(tmp_path, "foreign_process")
    apps = folder / "apps.csv"
    apps.write_text(apps.read_text().replace(", 48213, ", f", {os.getpid()}, "))
    node_path(tmp_path, monkeypatch, str(folder))
    [app] = facts(tmp_path, "foreign_process")["nvidia"]["apps"]
    cmdline = Path("/proc/self/cmdline").read_bytes().rstrip(b"\0").replace(b"\0", b" ").decode()
    assert app == {"gpu_uuid": "GPU-0c0ffee0-0000-4000-8000-000000000003", "gpu_index": 3,
                   "pid": os.getpid(), "used_mib": 71680, "name": "/usr/bin/python3",
                   "user": pwd.getpwuid(os.getuid()).pw_name, "command": cmdline[:200]}


def test_a_process_proc_does_not_show_has_no_owner(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    node_path(tmp_path, monkeypatch, "foreign_process")
    [app] = facts(tmp_path, "foreign_process")["nvidia"]["apps"]
    if not Path("/proc/48213").exists():
        assert (app["user"], app["command"]) == (None, None)


def test_a_driver_that_refuses_a_field_is_asked_again_without_its_family(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    node_path(tmp_path, monkeypatch, "r535_fields")
    nv = facts(tmp_path, "r535_fields")["nvidia"]
    assert nv["refused"] == ["remapped_rows.pending", "remapped_rows.failure"]
    assert nv["error"] is None and len(nv["gpus"]) == 8
    assert nv["gpus"][0]["ecc_uncorrected"] == 0 and nv["gpus"][0]["remapped_pending"] is None


def test_each_refused_family_is_left_out_in_turn(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    folder = copy_set(tmp_path, "r535_fields")
    gpu = folder / "gpu.csv"
    gpu.write_text(gpu.read_text().replace(",ecc.errors.uncorrected.volatile.total", ",ecc.x")
                   .replace(",retired_pages.pending", ",retired.x"))
    node_path(tmp_path, monkeypatch, str(folder))
    nv = facts(tmp_path, "r535_fields")["nvidia"]
    assert nv["refused"] == list(health.GPU_FIELDS[len(health.BASIC_FIELDS):])    # in turn
    assert nv["error"] is None and nv["gpus"][7]["bus_id"] == "00000000:DB:00.0"
    assert nv["gpus"][7]["ecc_uncorrected"] is None


def test_a_basic_field_refused_is_the_error(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    folder = copy_set(tmp_path, "healthy_h200x8")
    gpu = folder / "gpu.csv"
    gpu.write_text(gpu.read_text().replace("pci.bus_id", "pci.bus"))
    node_path(tmp_path, monkeypatch, str(folder))
    nv = facts(tmp_path, "healthy_h200x8")["nvidia"]
    assert nv["gpus"] == [] and nv["error"] == 'Field "pci.bus_id" is not a valid field to query.'


@pytest.mark.parametrize("name, said, driver_gpus", [
    ("smi_fails", "Unable to determine the device handle for GPU0000:AB:00.0: Unknown Error", 8),
    ("no_driver", "NVIDIA-SMI has failed because it couldn't communicate", None),
    ("no_devices", "No devices were found", 8),
])
def test_nvidia_smi_failing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str,
                            said: str, driver_gpus: int | None) -> None:
    node_path(tmp_path, monkeypatch, name)
    nv = facts(tmp_path, name)["nvidia"]
    assert (nv["gpus"], nv["apps"], nv["driver_gpus"]) == ([], None, driver_gpus)
    assert nv["error"].startswith(said) and nv["error"].count(said) == 2      # both queries


def test_a_failed_process_list_keeps_the_processes_it_listed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = copy_set(tmp_path, "foreign_process")
    (folder / "apps.rc").write_text("15\n")
    (folder / "apps.out").write_text(
        "GPU-0c0ffee0-0000-4000-8000-000000000003, 48213, 71680, /usr/bin/python3\n"
        "Unable to determine the device handle for GPU0000:AB:00.0: Unknown Error\n")
    node_path(tmp_path, monkeypatch, str(folder))
    nv = facts(tmp_path, "foreign_process")["nvidia"]
    assert [(a["gpu_index"], a["pid"]) for a in nv["apps"]] == [(3, 48213)]
    assert nv["error"] == "Unable to determine the device handle for GPU0000:AB:00.0: Unknown Error"


def test_a_lost_gpu_and_its_xid(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    node_path(tmp_path, monkeypatch, "lost_gpu")
    out = facts(tmp_path, "lost_gpu")
    assert [g["index"] for g in out["nvidia"]["gpus"] if g["lost"]] == [5]
    assert out["xid"]["source"] == "dmesg" and out["xid"]["counts"] == {"13": 2, "79": 1}
    assert out["xid"]["events"][-1]["bus"] == "0000:ab:00"


DMESG_REFUSED = "echo 'dmesg: read kernel buffer failed: Operation not permitted' >&2; exit 1\n"


def test_a_restricted_dmesg_leaves_the_journal(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "journalctl.args"
    bin_dir = node_path(tmp_path, monkeypatch, "healthy_h200x8", journalctl=(
        f'echo "$@" > {log}\n'
        "echo \"Feb 14 05:03:41 gpu-1 kernel: NVRM: Xid (PCI:0000:2a:00): 13, pid=7, x\"\n"))
    (bin_dir / "dmesg").unlink()
    (bin_dir / "dmesg").write_text("#!/bin/sh\n" + DMESG_REFUSED)
    (bin_dir / "dmesg").chmod(0o755)
    xid = facts(tmp_path, "healthy_h200x8")["xid"]
    assert (xid["source"], xid["error"], xid["counts"]) == ("journalctl", None, {"13": 1})
    assert log.read_text().split() == ["-k", "-b", "--no-pager", "-g", "NVRM:", "Xid"]


def test_no_readable_kernel_log_says_why(tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir = node_path(tmp_path, monkeypatch, "healthy_h200x8", journalctl=(
        "echo 'Hint: You are currently not seeing messages from other users and the system.' >&2\n"
        "echo '-- No entries --'; exit 1\n"))
    (bin_dir / "dmesg").unlink()
    (bin_dir / "dmesg").write_text("#!/bin/sh\n" + DMESG_REFUSED)
    (bin_dir / "dmesg").chmod(0o755)
    xid = facts(tmp_path, "healthy_h200x8")["xid"]
    assert (xid["source"], xid["events"], xid["counts"]) == (None, [], {})
    assert xid["error"] == ("dmesg: dmesg: read kernel buffer failed: Operation not permitted; "
                            "journalctl: Hint: You are currently not seeing messages from other "
                            "users and the system.")


def test_a_cpu_node_asks_nothing_of_gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    asked = tmp_path / "asked"
    node_path(tmp_path, monkeypatch, None, system=False, dmesg=f"echo > {asked}\n",
              journalctl=f"echo > {asked}\n")
    out = facts(tmp_path, "healthy_h200x8")
    assert (out["nvidia"], out["xid"]) == (None, None)
    assert not asked.exists()
    assert list(out["disk"]) == [str(tmp_path)] and out["memory_available_bytes"]


SLOW_SMI = ('case "$1" in --query-gpu=*) sleep {s}; echo "0, GPU-1, H200, 00000000:18:00.0, 580, '
            '0, 143771, 0, [N/A], No, No";; --query-compute-apps=*) sleep {s};; esac\n')


def test_both_queries_run_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    node_path(tmp_path, monkeypatch, None, **{"nvidia-smi": SLOW_SMI.format(s=0.8), "dmesg": ""})
    t0 = time.monotonic()
    nv = health.nvidia_facts()
    took = time.monotonic() - t0
    assert nv is not None and len(nv["gpus"]) == 1 and nv["apps"] == []
    assert took < 1.5, f"{took:.2f} s: one after the other would take 1.6 s or more"


def test_a_query_that_does_not_answer_is_ended(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    node_path(tmp_path, monkeypatch, None, **{"nvidia-smi": SLOW_SMI.format(s=30)})
    monkeypatch.setattr(health, "QUERY_SECONDS", 0.5)
    t0 = time.monotonic()
    nv = health.nvidia_facts()
    assert time.monotonic() - t0 < 5
    assert nv is not None and nv["gpus"] == [] and nv["apps"] is None
    assert nv["error"] == "no answer within 0.5 s; no answer within 0.5 s"


def test_a_kernel_log_that_does_not_answer_is_ended(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    node_path(tmp_path, monkeypatch, None, dmesg="sleep 30\n", journalctl="sleep 30\n")
    monkeypatch.setattr(health, "LOG_SECONDS", 0.3)
    t0 = time.monotonic()
    xid = health.kernel_xids()
    assert time.monotonic() - t0 < 5
    assert xid["error"] == "dmesg: no answer within 0.3 s; journalctl: no answer within 0.3 s"


def test_doctors_deep_look_keeps_its_shape() -> None:
    by_uuid = {g["uuid"]: g["index"] for g in gpus_of("foreign_process")}
    said = answer("foreign_process", "apps", health.APP_FIELDS)
    nvidia = {"gpus": gpus_of("foreign_process"), "error": None,
              "apps": [health.app_entry(r, by_uuid) for r in health.rows(said, health.APP_FIELDS)]}
    deep = health.deep_gpus(nvidia)
    assert isinstance(deep, list) and [g["processes"] for g in deep] == [0, 0, 0, 1, 0, 0, 0, 0]
    assert deep[3] == {"index": 3, "name": "NVIDIA H200", "driver": "580.159.04",
                       "uuid": "GPU-0c0ffee0-0000-4000-8000-000000000003",
                       "memory_used_mib": 72246, "memory_total_mib": 143771, "processes": 1}
    assert health.deep_gpus({"gpus": [], "apps": None, "error": "No devices were found"}) == {
        "error": "No devices were found"}
    assert health.deep_gpus(None) is None


# --- in the probe's answer --------------------------------------------------------------------

def probe(tmp_path: Path, *args: str) -> dict:
    import subprocess
    facts = program("probe", "facts", "--dir", str(tmp_path / "run"), *args)
    res = subprocess.run(["bash", "-c", boot_command(sys.executable, facts)], input=facts.data,
                         capture_output=True, timeout=60, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    return read_answer(res.stdout)


def test_the_probe_answers_health_in_the_same_round_trip(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    node_path(tmp_path, monkeypatch, "ecc")
    out = probe(tmp_path, "--workdir", str(tmp_path), "--health", "--health-dir",
                str(tmp_path / "ckpt"))
    h = out["health"]
    assert [g["index"] for g in h["nvidia"]["gpus"] if g["ecc_uncorrected"]] == [6]
    assert set(h["disk"]) == {str(tmp_path), str(tmp_path / "ckpt")}
    assert "health" not in probe(tmp_path, "--workdir", str(tmp_path))


# --- recorded on a real H200 (driver 580.159.04) ---------------------------------------------


def test_the_recorded_h200_answers_every_field_asked() -> None:
    """Recorded: this driver takes remapped_rows.* in --query-gpu (so the whole query is one
    call), prints [N/A] for retired pages on Hopper and No for the row remaps."""
    [g] = gpus_of("h200_recorded")
    assert g == {"index": 0, "uuid": "GPU-7cf785ea-bdf9-4586-6baf-8782d5c13511",
                 "name": "NVIDIA H200", "bus_id": "00000000:00:06.0", "driver": "580.159.04",
                 "memory_used_mib": 0, "memory_total_mib": 143771, "ecc_uncorrected": 0,
                 "retired_pending": None, "remapped_pending": False, "remapped_failure": False,
                 "lost": False}


def test_a_real_process_holding_20_gib_is_named_and_fails_the_gate(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Recorded while a python3 held 20 GiB on the H200 (its own tensor): the compute apps'
    row, through the real processes, and the gate's verdict on it. PID 4548 is gone here, so
    its owner and command are not known (on the machine they were: `cluster up` said
    `PID 531 (user root, python3 -c import torch,time; ...) holds 20.5 GiB`)."""
    from cluster.recovery.findings import FAIL
    from cluster.recovery.hardware import health_findings
    from cluster.spec import Gate
    node_path(tmp_path, monkeypatch, "h200_recorded_held")
    out = facts(tmp_path, "h200_recorded_held")
    [app] = out["nvidia"]["apps"]
    assert (app["gpu_index"], app["pid"], app["used_mib"], app["name"]) == (0, 4548, 20998,
                                                                            "python3")
    assert out["nvidia"]["refused"] == [] and out["xid"]["events"] == []
    failed = [(f.check, f.detail) for f in health_findings("h200", out, Gate()) if f.status == FAIL]
    [(check, detail)] = failed
    assert check == "gpu memory" and detail.startswith("GPU 0: PID 4548 (user ") \
        and detail.endswith(") holds 20.5 GiB"), detail         # here: (user unknown, python3)
