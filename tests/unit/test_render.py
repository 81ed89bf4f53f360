"""Rendered node scripts: golden files, `bash -n`, shellcheck."""
from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from cluster import inventory
from cluster.errors import InputError
from cluster.plan import Job, Templates, render, shpath

from .golden import check_golden

GOLDEN = Path(__file__).parent / "golden"
INPUTS = sorted((GOLDEN / "inputs").iterdir())
JOB = Job(run_id="golden-run", script="train.py", args=("--epochs", "3", "--name", "a b $(x)"))


def rendered(path: Path) -> str:
    return str(render(inventory.load(path), JOB, Templates()))


@pytest.mark.parametrize("source", INPUTS, ids=[p.name for p in INPUTS])
def test_golden(source: Path) -> None:
    check_golden(GOLDEN / "node" / f"{source.stem}.sh", rendered(source), "tests/unit/test_render.py")


def node_scripts(source: Path) -> list[str]:
    return [n.script for n in render(inventory.load(source), JOB, Templates()).nodes]


@pytest.mark.parametrize("source", INPUTS, ids=[p.name for p in INPUTS])
def test_bash_syntax(source: Path, tmp_path: Path) -> None:
    for i, script in enumerate(node_scripts(source)):
        f = tmp_path / f"{i}.sh"
        f.write_text(script)
        out = subprocess.run(["bash", "-n", str(f)], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr


@pytest.mark.skipif(not shutil.which("shellcheck"), reason="shellcheck not installed")
@pytest.mark.parametrize("source", INPUTS, ids=[p.name for p in INPUTS])
def test_shellcheck(source: Path, tmp_path: Path) -> None:
    for i, script in enumerate(node_scripts(source)):
        f = tmp_path / f"{i}.sh"
        f.write_text(script)
        out = subprocess.run(["shellcheck", "-s", "bash", str(f)], capture_output=True, text=True)
        assert out.returncode == 0, out.stdout


def test_ranks_follow_inventory_order_and_master_is_first_host() -> None:
    plan = render(inventory.load(GOLDEN / "inputs" / "static.yaml"), JOB, Templates())
    assert [n.host.name for n in plan.nodes] == ["gpu-a", "gpu-b"]
    assert plan.master_addr == "10.0.0.11"
    for rank, node in enumerate(plan.nodes):
        assert f"--node_rank={rank}" in node.script
        assert "--master_addr=10.0.0.11" in node.script
        assert f"--local_addr={node.host.address}" in node.script


def test_c10d_uses_run_id_and_local_addr() -> None:
    plan = render(inventory.load(GOLDEN / "inputs" / "c10d.yaml"), JOB, Templates())
    for node in plan.nodes:
        assert "--rdzv_backend=c10d" in node.script
        assert "--rdzv_id=golden-run" in node.script
        assert f"--local_addr={node.host.address}" in node.script
        assert "--node_rank" not in node.script


def test_user_env_wins_over_network_policy() -> None:
    plan = render(inventory.load(GOLDEN / "inputs" / "overrides.yaml"), JOB, Templates())
    gpu_b = plan.nodes[1].script
    assert "export NCCL_SOCKET_IFNAME=ib0" in gpu_b
    assert "export NCCL_SOCKET_IFNAME=ens5" not in gpu_b
    gpu_a = plan.nodes[0].script
    assert "export NCCL_SOCKET_IFNAME='^docker0,lo'" in gpu_a
    assert "GLOO_SOCKET_IFNAME" not in gpu_a.split("cluster_ifname")[0]


def test_template_override_by_name(tmp_path: Path) -> None:
    (tmp_path / "node.sh.j2").write_text("#!/bin/bash\necho {{ host.name | shquote }} {{ rank }}\n")
    plan = render(inventory.load(GOLDEN / "inputs" / "static.yaml"), JOB, Templates(tmp_path))
    assert plan.nodes[1].script == "#!/bin/bash\necho gpu-b 1\n"


def test_a_broken_template_is_named_with_its_line(tmp_path: Path) -> None:
    inv = inventory.load(GOLDEN / "inputs" / "static.yaml")
    (tmp_path / "node.sh.j2").write_text("#!/bin/bash\n{% if rank %}\necho\n")
    with pytest.raises(InputError, match=r"template .*node\.sh\.j2:3: Unexpected end of template"):
        render(inv, JOB, Templates(tmp_path))
    (tmp_path / "node.sh.j2").write_text("#!/bin/bash\necho {{ nowhere }}\n")
    with pytest.raises(InputError, match=r"^template node\.sh\.j2: 'nowhere' is undefined$"):
        render(inv, JOB, Templates(tmp_path))
    with pytest.raises(InputError, match=r"template 'gone\.j2' not found in \["):
        Templates(tmp_path).render("gone.j2")


def test_derived_port_is_stable_and_differs_between_runs() -> None:
    inv = inventory.load(GOLDEN / "inputs" / "c10d.yaml")
    a1 = render(inv, Job(run_id="run-a", script="t.py"), Templates()).master_port
    a2 = render(inv, Job(run_id="run-a", script="t.py"), Templates()).master_port
    b = render(inv, Job(run_id="run-b", script="t.py"), Templates()).master_port
    assert a1 == a2 and a1 != b and 29500 <= a1 < 30500


@pytest.mark.parametrize("path,expected", [
    ("~", '"$HOME"'), ("~/x y", "\"$HOME\"/'x y'"), ("/abs/p", "/abs/p"), ("rel ative", "'rel ative'"),
])
def test_shpath(path: str, expected: str) -> None:
    assert shpath(path) == expected


def test_a_missing_golden_file_fails(tmp_path: Path) -> None:
    if os.environ.get("CLUSTER_REGEN_GOLDEN") == "1":
        pytest.skip("regenerating")
    with pytest.raises(pytest.fail.Exception, match="is missing"):
        check_golden(tmp_path / "nope.sh", "text", "tests/unit/test_render.py")
    assert not (tmp_path / "nope.sh").exists(), "a missing golden file is never written silently"
    with pytest.raises(AssertionError, match="differs"):
        (tmp_path / "old.sh").write_text("old")
        check_golden(tmp_path / "old.sh", "new", "tests/unit/test_render.py")


def test_c10d_ranks_follow_torchs_order_of_local_addr_strings() -> None:
    """torch's c10d rendezvous numbers nodes by sorting their --local_addr as strings:
    10.0.0.10 before 10.0.0.9. Labels, log names and CLUSTER_NODE_RANK must agree with it."""
    hosts = "\n".join(f"  - {{name: n{i}, address: 10.0.0.{i}}}" for i in (9, 10, 11, 2))
    inv = inventory.parse_yaml(f"defaults: {{rendezvous: c10d}}\nhosts:\n{hosts}\n", "x.yaml")
    plan = render(inv, JOB, Templates())
    assert [n.host.name for n in plan.nodes] == ["n10", "n11", "n2", "n9"]
    assert [n.rank for n in plan.nodes] == [0, 1, 2, 3]
    assert plan.master.host.name == "n9" and plan.master_addr == "10.0.0.9"
    for n in plan.nodes:
        assert f"export CLUSTER_NODE_RANK={n.rank}\n" in n.script
        assert dict(n.env)["CLUSTER_NODE_RANK"] == str(n.rank)
        assert "--rdzv_endpoint=10.0.0.9:" in n.script
    static = inventory.parse_yaml(f"hosts:\n{hosts}\n", "x.yaml")     # the default: static
    assert [n.host.name for n in render(static, JOB, Templates()).nodes] == ["n9", "n10", "n11", "n2"]


@pytest.mark.parametrize("source", ["container_podman.yaml", "container_docker.yaml"])
def test_doctors_look_inside_the_image_starts_it_as_a_run_does(source: str, tmp_path: Path) -> None:
    """The check script includes the same run options as the node script (one template), with
    the image's python given the code on its command line and no run directory."""
    from cluster.plan import container_check
    inv = inventory.load(GOLDEN / "inputs" / source)
    host = inv.hosts[0]
    script = container_check(host, "cluster-doctor-x-gpu-a", Templates(), "print('@@inside {}')")
    check_golden(GOLDEN / "check" / f"{Path(source).stem}.sh", script, "tests/unit/test_render.py")
    node = render(inv, JOB, Templates()).nodes[0].script
    options = script[script.index("CLUSTER_RUN=("):script.index("\n", script.rindex("CLUSTER_RUN+=("))]
    assert options.replace(' --volume "$CLUSTER_DIR:$CLUSTER_DIR"', "") in node.replace(
        ' --volume "$CLUSTER_DIR:$CLUSTER_DIR"', "")
    assert "CLUSTER_DIR" not in script
    f = tmp_path / "check.sh"
    f.write_text(script)
    assert subprocess.run(["bash", "-n", str(f)], capture_output=True).returncode == 0
    if shutil.which("shellcheck"):
        out = subprocess.run(["shellcheck", "-s", "bash", str(f)], capture_output=True, text=True)
        assert out.returncode == 0, out.stdout


def test_a_container_runs_torchrun_even_with_python_auto_and_setup() -> None:
    """python: auto names the node's own python (for cluster's supervisor); the job's torchrun
    is the image's, after the setup lines ran on the node."""
    inv = inventory.parse_yaml("defaults:\n  python: auto\n  setup: ['module load cuda']\n"
                               "  container: {runtime: podman, image: 'x:1', python: /opt/py}\n"
                               "hosts: [a]\n", "x.yaml")
    script = render(inv, JOB, Templates()).nodes[0].script
    assert "module load cuda" in script
    assert script.index("module load cuda") < script.index('podman "${CLUSTER_RUN[@]}" x:1')
    assert "/opt/py -c \"$CLUSTER_ENTRY\"" in script and 'exec "$PYTHON"' not in script


FAKE_IP = """#!/bin/sh
# ip -o -4 addr show / ip -o route get ADDR, as a node with a decoy that sorts first
case "$*" in
  *"addr show"*) printf '%s\\n' '1: lo    inet 127.0.0.1/8 scope host lo' \\
      '2: docker0    inet 172.17.0.1/16 scope global docker0' \\
      '3: eth10    inet 10.1.0.5/24 scope global eth10' \\
      '4: eth1    inet 10.0.0.2/24 scope global eth1' ;;
  *"route get"*) echo "$4 dev eth1 src 10.0.0.2 uid 0" ;;
esac
"""


@pytest.mark.parametrize("own", ["10.0.0.2", "10.9.9.9"])   # its own address, else the route
def test_the_run_time_choice_is_the_nodes_interface_and_exact_for_nccl(
        own: str, tmp_path: Path) -> None:
    from cluster.network import NetworkPolicy
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("ip", FAKE_IP), ("getent", "#!/bin/sh\nexit 2\n")):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    net = NetworkPolicy(nccl=None, gloo=None, detect_nccl=True, detect_gloo=True, ib=None)
    snippet = Templates().render("network.sh.j2", net=net, own_addr=own, master_addr="10.0.0.1")
    out = subprocess.run(["bash", "-c", snippet + 'echo "$NCCL_SOCKET_IFNAME|$GLOO_SOCKET_IFNAME"'],
                         env={"PATH": f"{bin_dir}:/usr/bin:/bin"}, capture_output=True, text=True)
    assert out.stdout.strip() == "=eth1|eth1", out.stderr


@pytest.mark.parametrize("changes,script,checked", [
    ({}, "train.py", "train.py"),
    ({"torchrun_args": ("--monitor-interval=1",)}, "sub/t.py", "sub/t.py"),
    ({"torchrun_args": ("-m",)}, "pkg.train", None),                  # a module, not a file
    ({"torchrun_args": ("--no-python",)}, "echo", None),              # a program on PATH
    ({"setup": ("cd /elsewhere",)}, "train.py", None),                # read from elsewhere
    ({"setup": ("module load x && pushd src",)}, "train.py", None),
    ({"setup": ("source ~/venv/bin/activate",)}, "train.py", "train.py"),
    ({"container": "img"}, "/opt/app/train.py", None),               # inside the image
    ({"container": "img"}, "train.py", "train.py"),                   # the workdir is mounted
])
def test_the_script_is_checked_as_a_file_only_where_python_opens_it(changes, script, checked) -> None:
    from cluster.spec import Container
    inv = inventory.load(GOLDEN / "inputs" / "static.yaml")
    if "container" in changes:
        changes = {**changes, "container": Container(image=changes["container"])}
    host = inv.hosts[0].replace(**changes)
    plan = render(dataclasses.replace(inv, hosts=(host,)), Job(run_id="r", script=script), Templates())
    assert plan.nodes[0].script_file == checked


def test_a_node_template_of_ones_own_decides_what_the_script_is(tmp_path: Path) -> None:
    (tmp_path / "node.sh.j2").write_text("#!/bin/bash\necho {{ script | shquote }}\n")
    inv = inventory.load(GOLDEN / "inputs" / "static.yaml")
    assert {n.script_file for n in render(inv, JOB, Templates(tmp_path)).nodes} == {None}
    assert {n.script_file for n in render(inv, JOB, Templates()).nodes} == {JOB.script}
