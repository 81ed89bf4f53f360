"""cluster/remote/options.py: the one way the node programs read their command lines."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "cluster" / "remote"))
import options  # noqa: E402


def parse(argv: list[str]):
    return options.parse("prog.py", argv, {"port": int, "grace": 30.0, "name": str, "lines": 20},
                         ("follow",), ("dir",), ("name",))


def test_values_flags_and_words_arrive_typed() -> None:
    got = parse(["/run/d", "--port", "29500", "--name", "--x", "--follow", "--grace", "0.5"])
    assert (got.dir, got.port, got.name, got.follow, got.grace, got.lines) == \
        ("/run/d", 29500, "--x", True, 0.5, 20)     # a value may look like an option


def test_defaults_where_nothing_is_given() -> None:
    got = parse(["d", "--name", "n"])
    assert (got.port, got.grace, got.follow) == (None, 30.0, False)


@pytest.mark.parametrize("argv, says", [
    (["d", "--name", "n", "--nope", "1"], "unknown argument --nope"),
    (["d", "e", "--name", "n"], "unknown argument e"),
    (["--name", "n"], "dir is required"),
    (["d"], "--name is required"),
    (["d", "--name"], "--name needs a value"),
    (["d", "--name", "n", "--port", "eighty"], "--port takes a number, not 'eighty'"),
])
def test_anything_else_ends_the_program_naming_it(argv: list[str], says: str) -> None:
    with pytest.raises(SystemExit) as exc:
        parse(argv)
    assert str(exc.value) == f"prog.py: {says}"
