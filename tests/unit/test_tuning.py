"""NCCL socket tuning: the grid, the choice, the cache and its use by `cluster up`, with a
fake measurement (the real one needs GPUs on two nodes)."""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from cluster import api, tuning
from cluster.cli import run_cli
from cluster.deep import tune_nccl, tuning_lines
from cluster.errors import InputError, PreflightError
from cluster.inventory import parse_yaml
from cluster.runs import RunDir

REPO = Path(__file__).resolve().parents[2]
TWO = "hosts: [{name: a, address: 10.0.0.1}, {name: b, address: 10.0.0.2}]\n"


def link(env) -> dict:
    """A fake socket link: bandwidth grows with connections up to 4, then contention costs;
    NCCL's defaults (no variable) behave like 1 x 1."""
    t = int(env.get("NCCL_SOCKET_NTHREADS", 1))
    s = int(env.get("NCCL_NSOCKS_PERTHREAD", 1))
    conns = t * s
    big = 2.9 * min(conns, 4) - 0.05 * max(0, conns - 4) - 0.1 * t
    return {"backend": "nccl", "allreduce": [{"bytes": 1 << 20, "busbw_gbps": 1.0},
                                             {"bytes": 64 << 20, "busbw_gbps": big}]}


def test_the_grid_starts_with_ncclss_defaults_and_keeps_to_its_limit() -> None:
    settings = tuning.grid()
    assert settings[0] == {}
    assert len(settings) == 1 + 16
    for s in settings[1:]:
        assert set(s) == set(tuning.VARIABLES)
        assert int(s["NCCL_SOCKET_NTHREADS"]) * int(s["NCCL_NSOCKS_PERTHREAD"]) <= tuning.MAX_PRODUCT
    assert len(tuning.grid((16,), (1, 4, 8))) == 1 + 2          # 16 x 8 = 128 is left out
    with pytest.raises(InputError):
        tuning.grid((0,), (1,))


def test_the_sweep_measures_every_setting_in_order_and_the_best_is_kept() -> None:
    seen = []
    rows = tuning.sweep(lambda env: seen.append(env) or link(env), tuning.grid())
    assert seen == tuning.grid()
    best = tuning.choose(rows)
    # 4 connections with the fewest threads: 1 thread x 4 sockets
    assert best.env == {"NCCL_SOCKET_NTHREADS": "1", "NCCL_NSOCKS_PERTHREAD": "4"}


def test_defaults_are_kept_when_nothing_beats_them_by_more_than_noise() -> None:
    flat = lambda env: {"backend": "nccl", "allreduce": [  # noqa: E731
        {"bytes": 64 << 20, "busbw_gbps": 3.0 if not env else 3.1}]}
    assert tuning.choose(tuning.sweep(flat, tuning.grid())).env == {}
    better = lambda env: {"backend": "nccl", "allreduce": [  # noqa: E731
        {"bytes": 64 << 20, "busbw_gbps": 3.0 if not env else 3.3}]}
    assert tuning.choose(tuning.sweep(better, tuning.grid())).env != {}


def test_the_cache_is_private_and_keyed_by_the_nodes(tmp_path: Path) -> None:
    cache = tuning.Cache(tmp_path / "c" / "cluster" / "nccl-tuning.json")
    inv = parse_yaml(TWO, "two.yaml")
    rows = tuning.sweep(link, tuning.grid())
    cache.store(inv, tuning.choose(rows), rows)
    assert stat.S_IMODE(os.stat(cache.path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(cache.path.parent).st_mode) == 0o700
    swapped = parse_yaml("hosts: [{name: y, address: 10.0.0.2}, {name: x, address: 10.0.0.1}]\n", "s.yaml")
    assert cache.lookup(swapped)["env"] == {"NCCL_SOCKET_NTHREADS": "1", "NCCL_NSOCKS_PERTHREAD": "4"}
    other = parse_yaml("hosts: [{name: a, address: 10.0.0.1}, {name: c, address: 10.0.0.3}]\n", "o.yaml")
    assert cache.lookup(other) is None
    assert len(cache.lookup(swapped)["table"]) == len(rows)


def test_a_broken_cache_names_its_file(tmp_path: Path) -> None:
    path = tmp_path / "nccl-tuning.json"
    path.write_text("{not json")
    with pytest.raises(InputError, match=str(path)):
        tuning.Cache(path).lookup(parse_yaml(TWO, "two.yaml"))


def test_a_cached_entry_sets_only_ncclss_socket_variables(tmp_path: Path) -> None:
    inv = parse_yaml(TWO, "two.yaml")
    path = tmp_path / "nccl-tuning.json"
    path.write_text(json.dumps({"version": 1, "entries": {tuning.key(inv): {
        "env": {"NCCL_SOCKET_NTHREADS": "2", "LD_PRELOAD": "/tmp/evil.so"}}}}))
    assert tuning.applied(inv, tuning.Cache(path)) is inv


def stored(tmp_path: Path, text: str = TWO) -> tuning.Cache:
    cache = tuning.Cache(tuning.cache_path({"XDG_CACHE_HOME": str(tmp_path)}))
    rows = [tuning.Row({}, {64 << 20: 2.9}),
            tuning.Row({"NCCL_SOCKET_NTHREADS": "2", "NCCL_NSOCKS_PERTHREAD": "2"}, {64 << 20: 9.6})]
    cache.store(parse_yaml(text, "inv.yaml"), tuning.choose(rows), rows)
    return cache


def test_the_users_env_wins_over_the_cache(tmp_path: Path) -> None:
    text = ("hosts:\n  - {name: a, address: 10.0.0.1, env: {NCCL_SOCKET_NTHREADS: '8'}}\n"
            "  - {name: b, address: 10.0.0.2, secret_env: [NCCL_NSOCKS_PERTHREAD]}\n")
    inv = tuning.applied(parse_yaml(text, "inv.yaml"), stored(tmp_path, text))
    a, b = (dict(h.env) for h in inv.hosts)
    assert a == {"NCCL_SOCKET_NTHREADS": "8", "NCCL_NSOCKS_PERTHREAD": "2"}
    assert b == {"NCCL_SOCKET_NTHREADS": "2"}                       # a secret is never overwritten
    assert inv.tuning["env"] == {"NCCL_SOCKET_NTHREADS": "2", "NCCL_NSOCKS_PERTHREAD": "2"}


def test_up_applies_the_cache_visibly_and_no_tuning_ignores_it(tmp_path: Path, monkeypatch, capsys) -> None:
    inv = tmp_path / "inv.yaml"
    inv.write_text(TWO)
    stored(tmp_path / "cache")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CLUSTER_RUNS_DIR", raising=False)
    assert run_cli(["up", "-i", str(inv), "--dry-run", "--", "t.py"]) == 0
    captured = capsys.readouterr()
    assert captured.out.count("export NCCL_SOCKET_NTHREADS=2") == 2
    assert captured.out.count("export NCCL_NSOCKS_PERTHREAD=2") == 2
    assert "cluster doctor --tune-nccl" in captured.err and "--no-tuning" in captured.err
    run = RunDir.find(None, tmp_path / "runs", dry_runs=True)
    assert run.meta()["nccl_tuning"]["env"] == {"NCCL_SOCKET_NTHREADS": "2", "NCCL_NSOCKS_PERTHREAD": "2"}
    assert json.loads((run.path / "env.json").read_text())["b"]["NCCL_NSOCKS_PERTHREAD"] == "2"
    for script in (run.path / "scripts").iterdir():
        assert "export NCCL_SOCKET_NTHREADS=2" in script.read_text()

    assert run_cli(["up", "-i", str(inv), "--dry-run", "--no-tuning", "--", "t.py"]) == 0
    captured = capsys.readouterr()
    assert "NCCL_SOCKET_NTHREADS" not in captured.out and "tune-nccl" not in captured.err
    [newest] = [p for p in (tmp_path / "runs").iterdir() if p != run.path]
    assert "nccl_tuning" not in json.loads((newest / "run.json").read_text())


def test_other_nodes_and_slurm_take_nothing_from_the_cache(tmp_path: Path) -> None:
    stored(tmp_path)
    environ = {"XDG_CACHE_HOME": str(tmp_path), "PATH": os.environ.get("PATH", "")}
    inv = tmp_path / "one.yaml"
    inv.write_text("hosts: [{name: a, address: 10.0.0.1}, {name: c, address: 10.0.0.3}]\n")
    prepared = api.prepare(api.Request(inventory_path=str(inv), command=("t.py",)), environ)
    assert prepared.inventory.tuning is None
    prepared.backend.close()
    slurm = tmp_path / "slurm.yaml"
    slurm.write_text("backend: slurm\n" + TWO)
    prepared = api.prepare(api.Request(inventory_path=str(slurm), command=("t.py",)), environ)
    assert prepared.inventory.tuning is None
    prepared.backend.close()


def test_doctor_refuses_to_tune_without_nccl_or_with_one_node(tmp_path: Path) -> None:
    cache = tuning.Cache(tmp_path / "nccl-tuning.json")
    gloo = lambda env: {"backend": "gloo", "allreduce": []}  # noqa: E731
    with pytest.raises(PreflightError, match="ran on gloo, not NCCL"):
        tune_nccl(parse_yaml(TWO, "two.yaml"), gloo, cache)
    with pytest.raises(PreflightError, match="2 or more nodes"):
        tune_nccl(parse_yaml("hosts: [a]\n", "one.yaml"), link, cache)
    assert not cache.path.exists(), "nothing is stored after a refusal"


def test_doctor_keeps_the_best_and_shows_the_table(tmp_path: Path) -> None:
    cache = tuning.Cache(tmp_path / "nccl-tuning.json")
    inv = parse_yaml(TWO, "two.yaml")
    shown = []
    tuned = tune_nccl(inv, link, cache, shown=shown.append)
    assert len(shown) == len(tuning.grid())
    assert tuned["chosen"] == cache.lookup(inv)["env"] == {"NCCL_SOCKET_NTHREADS": "1",
                                                           "NCCL_NSOCKS_PERTHREAD": "4"}
    text = "\n".join(tuning_lines(tuned))
    assert text.count("<- kept") == 1
    assert "1 threads x 4 sockets" in [line for line in text.splitlines() if "<- kept" in line][0]
    assert "NCCL defaults" in text and str(cache.path) in text
