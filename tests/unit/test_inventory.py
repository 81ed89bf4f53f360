"""Inventory loading: typed hosts, and every rejection names file, line and key (exit code 2)."""
from __future__ import annotations

from pathlib import Path

import pytest

from cluster import inventory, spec
from cluster.cli import run_cli
from cluster.errors import InputError, InventoryError

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str, name: str = "inv.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_example_inventory_loads_with_defaults_and_overrides() -> None:
    inv = inventory.load(REPO / "inventory" / "example.yaml")
    a, b = inv.hosts
    assert (a.name, a.address, a.user, a.gpus, a.network.ifname) == ("gpu-a", "10.0.0.11", "alice", 8, "eth0")
    assert b.network.ifname == "ens5" and b.network.ib == "auto"
    assert dict(b.env) == {"OMP_NUM_THREADS": "8", "FOO": "bar"}
    assert dict(a.env) == {"OMP_NUM_THREADS": "8"}
    assert a.master_port == 29500 and a.rendezvous == "static" and a.python == "/opt/venv/bin/python"


def test_hostfile_with_hostlists_and_slots() -> None:
    inv = inventory.load(REPO / "inventory" / "hostfile")
    assert [(h.name, h.nproc_per_node) for h in inv.hosts] == [("gpu01", 8), ("gpu02", 8), ("worker-3", 4)]


def test_hostlist_expression_in_yaml_names() -> None:
    inv = inventory.parse_yaml("hosts:\n  - {name: 'gpu[01-03]', gpus: 4}\n  - cpu1\n", "x.yaml")
    assert [h.name for h in inv.hosts] == ["gpu01", "gpu02", "gpu03", "cpu1"]
    assert inv.hosts[0].address == "gpu01" and inv.hosts[2].gpus == 4


def test_mpich_style_hostfile() -> None:
    inv = inventory.parse_hostfile("a:2\nb:4 # comment\n\n# only a comment\n", "hf")
    assert [(h.name, h.nproc_per_node) for h in inv.hosts] == [("a", 2), ("b", 4)]


def test_yaml_on_off_are_ib_policies() -> None:
    inv = inventory.parse_yaml("defaults:\n  network: {ib: off}\nhosts: [a]\n", "x.yaml")
    assert inv.hosts[0].network.ib == "off"


BAD = [
    # (inventory text, line, key, words in the message)
    ("hosts:\n  - {name: a, adress: 10.0.0.1}\n", 2, "adress", "did you mean 'address'?"),
    ("defaults:\n  usr: bob\nhosts: [a]\n", 2, "usr", "did you mean 'user'?"),
    ("hostz: [a]\n", 1, "hostz", "did you mean 'hosts'?"),
    ("hosts:\n  - {name: a, network: {ifnam: eth0}}\n", 2, "ifnam", "did you mean 'ifname'?"),
    ("hosts:\n  - a\n  - b\n  - a\n", 4, "name", "duplicate host name 'a'"),
    ("hosts:\n  - {name: a, address: 10.0.0.1}\n  - {name: b, address: 10.0.0.1}\n", 3, "address",
     "duplicate address"),
    ("hosts:\n  - {name: a, port: 0}\n", 2, "port", "port number"),
    ("hosts:\n  - {name: a, port: 70000}\n", 2, "port", "port number"),
    ("defaults:\n  master_port: x\nhosts: [a]\n", 2, "master_port", "port number"),
    ("defaults:\n  nproc_per_node: 0\nhosts: [a]\n", 2, "nproc_per_node", ">= 1"),
    ("hosts:\n  - {name: a, nproc_per_node: -3}\n", 2, "nproc_per_node", ">= 1"),
    ("hosts:\n  - {name: 'bad host'}\n", 2, "name", "not a valid host name"),
    ("hosts:\n  - {name: 'a;rm'}\n", 2, "name", "not a valid host name"),
    ("hosts:\n  - name: a\n    env: {1BAD: x}\n", 3, "1BAD", "not a valid identifier"),
    ("hosts:\n  - name: a\n    env:\n      'A-B': x\n", 4, "A-B", "not a valid identifier"),
    ("defaults:\n  rendezvous: etcd\nhosts: [a]\n", 2, "rendezvous", "static, c10d"),
    ("defaults:\n  network: {ib: maybe}\nhosts: [a]\n", 2, "ib", "auto, on or off"),
    ("hosts:\n  - {name: a, address: 'not an address!'}\n", 2, "address", "neither an IP"),
    ("hosts: []\n", 1, "hosts", "non-empty list"),
    ("hosts:\n  - {name: a\n", 3, None, "not valid YAML"),
    ("slurm:\n  signal: USR1@60\nhosts: [a]\n", 2, "signal", "USR1 is used by NCCL"),
    # control characters in fields that reach a script (YAML double quotes make them)
    ('slurm:\n  partition: "gpu\\ntouch /tmp/x #"\nhosts: [a]\n', 2, "partition", "control character"),
    ('defaults:\n  workdir: "/w\\rx"\nhosts: [a]\n', 2, "workdir", "control character"),
    ('defaults:\n  python: "py\\x00"\nhosts: [a]\n', 2, "python", "control character"),
    ('hosts:\n  - {name: a, user: "bob\\n"}\n', 2, "user", "control character"),
    ('hosts:\n  - {name: a, identity_file: "k\\tx"}\n', 2, "identity_file", "control character"),
    ('slurm:\n  job_name: "x\\ey"\nhosts: [a]\n', 2, "job_name", "control character"),
    ('slurm:\n  account: "a\\u007f"\nhosts: [a]\n', 2, "account", "control character"),
    ('slurm:\n  time: "1:00\\n"\nhosts: [a]\n', 2, "time", "control character"),
    ('slurm:\n  constraint: "\\na"\nhosts: [a]\n', 2, "constraint", "control character"),
    ('slurm:\n  output_dir: "o\\n"\nhosts: [a]\n', 2, "output_dir", "control character"),
    ('ssh:\n  config: "c\\n"\nhosts: [a]\n', 2, "config", "control character"),
    ('hosts:\n  - {name: a, address: "10.0.0.1\\n"}\n', 2, "address", "control character"),
    ('hosts:\n  - {name: a, network: {ifname: "eth0\\n"}}\n', 2, "ifname", "control character"),
    # names cluster sets itself
    ("hosts:\n  - name: a\n    env: {CLUSTER_RUN_ID: x}\n", 3, "CLUSTER_RUN_ID", "set by cluster itself"),
    ("defaults:\n  env: {CLUSTER_NODE: x}\nhosts: [a]\n", 2, "CLUSTER_NODE", "reserved"),
    ("defaults:\n  env: {MASTER_PORT: '1'}\nhosts: [a]\n", 2, "MASTER_PORT", "master_port"),
    ("defaults:\n  secret_env: [CLUSTER_NODE]\nhosts: [a]\n", 2, "secret_env", "reserved"),
    ("defaults:\n  secret_env: ['1X']\nhosts: [a]\n", 2, "secret_env", "not a valid environment"),
    ("defaults:\n  secret_env: TOKEN\nhosts: [a]\n", 2, "secret_env", "must be a list"),
    ("defaults:\n  env: {TOKEN: x}\n  secret_env: [TOKEN]\nhosts: [a]\n", 3, "secret_env",
     "in both 'env' and 'secret_env'"),
    # job-wide settings are not per host: rejected rather than silently ignored
    ("hosts:\n  - {name: a, rendezvous: static}\n", 2, "rendezvous", "set it under 'defaults'"),
    ("hosts:\n  - {name: a, master_port: 29400}\n", 2, "master_port", "set it under 'defaults'"),
    ("stop_grace: 0\nhosts: [a]\n", 1, "stop_grace", "positive number of seconds"),
    ("ssh: {keepalive: -1}\nhosts: [a]\n", 1, "keepalive", "positive number of seconds"),
    # containers
    ("defaults:\n  container: {runtime: docker}\nhosts: [a]\n", 2, "container", "needs an 'image'"),
    ("defaults:\n  container: {image: x, runtim: podman}\nhosts: [a]\n", 2, "runtim",
     "did you mean 'runtime'?"),
    ("defaults:\n  container: {image: x, runtime: singularity}\nhosts: [a]\n", 2, "runtime",
     "docker, podman"),
    ("defaults:\n  container: {image: '--privileged'}\nhosts: [a]\n", 2, "image",
     "not an image reference"),
    ("defaults:\n  container: {image: 'a b'}\nhosts: [a]\n", 2, "image", "not an image reference"),
    ('defaults:\n  container: {image: "x\\n"}\nhosts: [a]\n', 2, "image", "control character"),
    ('defaults:\n  container: {image: x, python: "py\\r"}\nhosts: [a]\n', 2, "python",
     "control character"),
    ("defaults:\n  container:\n    image: x\n    mounts:\n      - /a:/a\n      - data:/data\n"
     "hosts: [a]\n", 6, "mounts", "absolute source"),
    ("defaults:\n  container: {image: x, mounts: ['/a']}\nhosts: [a]\n", 2, "mounts", "SRC:DST"),
    ("defaults:\n  container: {image: x, mounts: ['/a,b:/b']}\nhosts: [a]\n", 2, "mounts", "','"),
    ("defaults:\n  container: {image: x, mounts: ['/a:/b:r o']}\nhosts: [a]\n", 2, "mounts", "flags"),
    ("defaults:\n  container: {image: x, mounts: /a:/a}\nhosts: [a]\n", 2, "mounts", "must be a list"),
    ('defaults:\n  container: {image: x, mounts: ["/a:/b\\n"]}\nhosts: [a]\n', 2, "mounts",
     "control character"),
    ("defaults:\n  container:\n    image: x\n    options:\n      - --cpus=4\n"
     "      - --network=bridge\nhosts: [a]\n", 6, "options", "host networking"),
    ("defaults:\n  container: {image: x, options: [--shm-size=16g]}\nhosts: [a]\n", 2, "options",
     "podman refuses both"),
    ("defaults:\n  container: {image: x, options: [-it]}\nhosts: [a]\n", 2, "options", "standard input"),
    ("defaults:\n  container: {image: x, options: [-eTOKEN=x]}\nhosts: [a]\n", 2, "options",
     "visible in ps"),
    ("defaults:\n  container: {image: x, options: [--env-file, f]}\nhosts: [a]\n", 2, "options",
     "environment file"),
    ("defaults:\n  container: {image: x, options: [--name=x]}\nhosts: [a]\n", 2, "options",
     "named after the run"),
    ('defaults:\n  container: {image: x, options: ["--label=a\\tb"]}\nhosts: [a]\n', 2, "options",
     "control character"),
    ("hosts:\n  - {name: a, container: {mounts: ['/a:/a']}}\n", 2, "container", "needs an 'image'"),
]


@pytest.mark.parametrize("text,line,key,words", BAD)
def test_rejections_name_file_line_and_key(tmp_path: Path, text: str, line: int, key: str | None,
                                           words: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(InventoryError) as info:
        inventory.load(path)
    msg = str(info.value)
    assert msg.startswith(f"{path}:{line}"), msg
    if key:
        assert f": {key}:" in msg, msg
    assert words in msg
    assert "problems in" not in msg, f"one mistake reported more than once: {msg}"


THREE = ("defaults:\n"
         "  usr: bob\n"                          # 2: unknown key
         "hosts:\n"
         "  - {name: a, port: 70000}\n"          # 4: port out of range
         "  - b\n"
         "ssh: {keepalive: -1}\n")               # 6: read before the hosts, listed after them


def test_every_problem_of_a_file_is_reported_in_file_order_then_the_count(tmp_path: Path) -> None:
    path = write(tmp_path, THREE)
    with pytest.raises(InventoryError) as info:
        inventory.load(path)
    assert str(info.value) == (
        f"{path}:2: usr: unknown key 'defaults.usr' (did you mean 'user'?)\n"
        f"{path}:4: port: must be a port number from 1 to 65535, got 70000\n"
        f"{path}:6: keepalive: must be a positive number of seconds, got -1\n"
        f"3 problems in {path}")
    assert [(p.line, p.key) for p in info.value.problems] == [(2, "usr"), (4, "port"), (6, "keepalive")]


def test_cli_reports_every_problem_exits_2_and_runs_nothing(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    path = write(tmp_path, THREE)
    assert run_cli(["up", "-i", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"cluster: error: {path}:2: usr: ")
    assert f"\n{path}:4: port: " in err and f"\n{path}:6: keepalive: " in err
    assert err.endswith(f"\n3 problems in {path}\n")
    assert not (tmp_path / "runs").exists(), "bad input must not create a run"


def test_problems_in_hosts_env_and_duplicates_are_all_reported() -> None:
    text = ("hosts:\n"
            "  - {name: a, adress: 10.0.0.1}\n"               # 2
            "  - name: b\n"
            "    env: {1BAD: x, CLUSTER_X: y, GOOD: z}\n"     # 4, 4
            "  - {name: 'bad host'}\n"                        # 5
            "  - a\n"                                         # 6: a again
            "slurm: {signal: USR1, nodes: 0}\n")              # 7, 7
    with pytest.raises(InventoryError) as info:
        inventory.parse_yaml(text, "inv.yaml")
    assert [(p.line, p.key) for p in info.value.problems] == [
        (2, "adress"), (4, "1BAD"), (4, "CLUSTER_X"), (5, "name"), (6, "name"), (7, "signal"),
        (7, "nodes")]
    assert str(info.value).endswith("\n7 problems in inv.yaml")


def test_a_misspelt_hosts_key_is_one_problem_not_two() -> None:
    with pytest.raises(InventoryError) as info:
        inventory.parse_yaml("hostz: [a]\nstop_grace: 0\n", "inv.yaml")
    assert [(p.line, p.key) for p in info.value.problems] == [(1, "hostz"), (2, "stop_grace")]


@pytest.mark.parametrize("text,line,key,words", BAD[:6])
def test_cli_exits_2_and_runs_nothing(tmp_path: Path, monkeypatch, capsys, text, line, key, words) -> None:
    monkeypatch.chdir(tmp_path)
    path = write(tmp_path, text)
    assert run_cli(["up", "-i", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}:{line}" in err and words in err
    assert not (tmp_path / "runs").exists(), "bad input must not create a run"


def test_secret_env_merges_defaults_and_host_names_only() -> None:
    inv = inventory.parse_yaml("defaults:\n  secret_env: [HF_TOKEN]\nhosts:\n"
                               "  - {name: a, secret_env: [WANDB_API_KEY]}\n  - b\n", "x.yaml")
    assert inv.hosts[0].secret_env == ("HF_TOKEN", "WANDB_API_KEY")
    assert inv.hosts[1].secret_env == ("HF_TOKEN",)


def test_container_merges_defaults_and_host_key_by_key() -> None:
    inv = inventory.parse_yaml(
        "defaults:\n  container:\n    runtime: podman\n    image: reg.example:5000/train:1\n"
        "    mounts: [/data:/data:ro, '~/ckpt:/ckpt']\n    options: [--ulimit, stack=1, -v/x:/x]\n"
        "hosts:\n  - a\n  - {name: b, container: {image: other:2, python: /opt/conda/bin/python}}\n"
        "  - c\n", "x.yaml")
    a, b, _ = inv.hosts
    assert a.container is not None and b.container is not None
    assert a.container.runtime == "podman" and a.container.image == "reg.example:5000/train:1"
    assert [str(m) for m in a.container.mounts] == ["/data:/data:ro", "~/ckpt:/ckpt"]
    assert a.container.options == ("--ulimit", "stack=1", "-v/x:/x")
    assert (b.container.image, b.container.python, b.container.runtime) == (
        "other:2", "/opt/conda/bin/python", "podman")
    assert b.container.mounts == a.container.mounts
    assert inventory.parse_yaml("hosts: [a]\n", "x.yaml").hosts[0].container is None


def test_container_survives_the_run_record() -> None:
    import yaml as _yaml
    inv = inventory.parse_yaml("defaults:\n  container: {image: 'x:1', mounts: ['/a:/b:ro,z']}\n"
                               "hosts: [a]\n", "x.yaml")
    back = spec.host_from_dict(_yaml.safe_load(spec.dump(inv))["hosts"][0])
    assert back.container == inv.hosts[0].container


def test_timing_settings() -> None:
    inv = inventory.parse_yaml("stop_grace: 90\nssh: {keepalive: 300}\nhosts: [a]\n", "x.yaml")
    assert inv.stop_grace == 90.0 and inv.ssh.keepalive == 300.0
    default = inventory.parse_yaml("hosts: [a]\n", "x.yaml")
    assert default.stop_grace == 30.0 and default.ssh.keepalive == 60.0


def test_hostfile_reports_every_bad_line(tmp_path: Path) -> None:
    path = write(tmp_path, "a slots=x\nb\nc cpus=2\nb\n", "hostfile")
    with pytest.raises(InventoryError) as info:
        inventory.load(path)
    assert str(info.value).splitlines() == [
        f"{path}:1: slots: must be a whole number >= 1, got 'x'",
        f"{path}:3: cpus: unknown hostfile field 'cpus=2' (expected 'NAME slots=N')",
        f"{path}:4: name: duplicate host name 'b' (first defined on line 2)",
        f"3 problems in {path}"]


def test_hostfile_rejections(tmp_path: Path) -> None:
    with pytest.raises(InventoryError, match=r"hf:2: slots: must be a whole number"):
        inventory.parse_hostfile("a slots=2\nb slots=zero\n", "hf")
    with pytest.raises(InventoryError, match=r"hf:1: cpus: unknown hostfile field"):
        inventory.parse_hostfile("a cpus=2\n", "hf")


def test_select_nodes_hosts_exclude() -> None:
    inv = inventory.parse_yaml("hosts: ['n[1-4]']\n", "x.yaml")
    assert [h.name for h in inv.select(nodes=2).hosts] == ["n1", "n2"]
    assert [h.name for h in inv.select(hosts="n[3-4]").hosts] == ["n3", "n4"]
    assert [h.name for h in inv.select(exclude="n1", nodes=2).hosts] == ["n2", "n3"]
    with pytest.raises(InputError, match="--nodes: 5 requested but only 4"):
        inv.select(nodes=5)
    with pytest.raises(InputError, match="--hosts: n9 not in"):
        inv.select(hosts="n9")


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="cannot read inventory"):
        inventory.load(tmp_path / "nope.yaml")


def test_every_example_inventory_loads() -> None:
    for path in sorted((REPO / "inventory").iterdir()):
        inv = inventory.load(path)
        assert inv.hosts, path
    inv = inventory.load(REPO / "inventory" / "modules-and-venv.yaml")
    assert inv.hosts[0].python == "auto" and len(inv.hosts[0].setup) == 2
    assert inv.slurm.extra == (("exclusive", None), ("mem", "0"), ("qos", "normal"))


def test_gate_takes_a_level_or_a_mapping_and_names_a_bad_level(tmp_path) -> None:
    from cluster.inventory import load
    base = "hosts: [a]\n"
    for text, level in (("gate: deep\n", "deep"), ("gate: off\n", "off"),
                        ("gate: {level: basic, min_free_disk_gib: 50}\n", "basic"), ("", "basic")):
        (tmp_path / "inv.yaml").write_text(base + text)
        assert load(str(tmp_path / "inv.yaml")).gate.level == level, text
    (tmp_path / "inv.yaml").write_text(base + "gate: {min_free_disk_gib: 50}\n")
    assert load(str(tmp_path / "inv.yaml")).gate.min_free_disk_gib == 50.0
    (tmp_path / "inv.yaml").write_text(base + "gate: thorough\n")
    with pytest.raises(InventoryError) as exc:
        load(str(tmp_path / "inv.yaml"))
    assert "inv.yaml:2: level:" in str(exc.value), str(exc.value)
    assert "off, basic, deep" in str(exc.value)


def test_spare_hosts_and_nodes_say_how_many_run(tmp_path) -> None:
    from cluster.inventory import load
    from cluster.resolve import running_count
    (tmp_path / "inv.yaml").write_text("hosts: [a, b, {name: c, spare: true}]\n")
    inv = load(str(tmp_path / "inv.yaml"))
    assert [h.spare for h in inv.hosts] == [False, False, True]
    assert running_count(None, inv) == 2 and running_count(3, inv) == 3
    (tmp_path / "inv.yaml").write_text("nodes: 1\nhosts: [a, b]\n")
    assert running_count(None, load(str(tmp_path / "inv.yaml"))) == 1
    with pytest.raises(InputError, match="Invalid value for --nodes: 5 requested but only 2"):
        running_count(5, load(str(tmp_path / "inv.yaml")))
    (tmp_path / "inv.yaml").write_text("hosts: [{name: a, spare: yes please}]\n")
    with pytest.raises(InventoryError, match="inv.yaml:1: spare: must be true or false"):
        load(str(tmp_path / "inv.yaml"))
