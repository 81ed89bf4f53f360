"""Compiled templates kept between launches (plan.TemplateCache): a warm cache renders what a
cold one does without compiling, an edited template compiles anew, and a folder that is not the
user's alone, or a file that is not what Jinja wrote, only means compiling."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
from jinja2.bccache import bc_magic

from cluster import inventory
from cluster.plan import Job, TemplateCache, Templates, render

GOLDEN = Path(__file__).parent / "golden"
INPUTS = sorted((GOLDEN / "inputs").iterdir())
JOB = Job(run_id="golden-run", script="train.py", args=("--epochs", "3"))


def rendered(source: Path, templates: Templates) -> str:
    """The scripts, rendered as a launch renders them: then the cache is written."""
    text = str(render(inventory.load(source), JOB, templates))
    templates.save()
    return text


def no_compiling(templates: Templates) -> Templates:
    def compile(*args: object, **kwargs: object) -> None:
        raise AssertionError("compiled a template the cache holds")
    templates.env.compile = compile  # type: ignore[method-assign]
    return templates


@pytest.mark.parametrize("source", INPUTS, ids=[p.name for p in INPUTS])
def test_a_warm_cache_renders_what_compiling_does_without_compiling(source: Path,
                                                                    tmp_path: Path) -> None:
    cache = tmp_path / "templates"
    compiled = rendered(source, Templates())
    assert rendered(source, Templates(cache=cache)) == compiled       # fills the cache
    assert oct(cache.stat().st_mode & 0o777) == oct(0o700)
    assert any(cache.iterdir())
    assert rendered(source, no_compiling(Templates(cache=cache))) == compiled


def test_an_edited_template_compiles_anew(tmp_path: Path) -> None:
    own, cache = tmp_path / "own", tmp_path / "cache"
    own.mkdir()
    (own / "node.sh.j2").write_text("echo one {{ host.name }}\n")
    source = GOLDEN / "inputs" / "static.yaml"
    assert "echo one gpu-a" in rendered(source, Templates(own, cache))
    (own / "node.sh.j2").write_text("echo two {{ host.name }}\n")
    assert "echo two gpu-a" in rendered(source, Templates(own, cache))


@pytest.mark.parametrize("mode", [0o770, 0o707, 0o755])
def test_a_folder_others_may_write_or_read_is_not_used(tmp_path: Path, mode: int) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    cache.chmod(mode)
    assert TemplateCache.at(cache) is None
    assert Templates(cache=cache).env.bytecode_cache is None


def test_a_link_or_a_file_is_not_used(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    (tmp_path / "file").write_text("")
    assert TemplateCache.at(tmp_path / "link") is None
    assert TemplateCache.at(tmp_path / "file") is None
    assert TemplateCache.at(tmp_path / "file" / "below") is None


def test_a_broken_cache_file_only_means_compiling(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    source = GOLDEN / "inputs" / "static.yaml"
    compiled = rendered(source, Templates(cache=cache))
    files = list(cache.iterdir())
    broken = [bc_magic + b"not a pickle", bc_magic, b"\x00garbage" * 9, b""]
    assert len(files) >= 2
    for i, f in enumerate(files):     # Jinja's own header, then no checksum; garbage; nothing
        f.write_bytes(broken[i % len(broken)])
    assert rendered(source, Templates(cache=cache)) == compiled
    assert rendered(source, no_compiling(Templates(cache=cache))) == compiled   # written anew


def test_a_cache_that_cannot_be_written_only_means_compiling(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    templates = Templates(cache=cache)
    assert templates.env.bytecode_cache is not None
    cache.write_text("")              # made a file after it was found missing: no folder to write
    source = GOLDEN / "inputs" / "static.yaml"
    assert rendered(source, templates) == rendered(source, Templates())
    assert cache.is_file() and cache.read_text() == ""


def test_rendering_alone_writes_nothing_until_saved(tmp_path: Path) -> None:
    """A check renders every script (api.prepare, a dry run): the cache folder is made and
    written only by save(), a launch's step."""
    cache = tmp_path / "cache" / "templates"
    templates = Templates(cache=cache)
    render(inventory.load(GOLDEN / "inputs" / "static.yaml"), JOB, templates)
    assert list(tmp_path.iterdir()) == []
    templates.save()
    assert any(cache.iterdir()) and oct(cache.stat().st_mode & 0o777) == oct(0o700)
