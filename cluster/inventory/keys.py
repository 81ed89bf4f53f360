"""The inventory's key table, generated from the key declarations of cluster.spec.

    python -m cluster.inventory.keys                            print the table (markdown)
    python -m cluster.inventory.keys --write docs/inventory.md  replace it between the markers

tests/unit/test_inventory_keys.py fails when the page and the declarations disagree.
"""
from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from pathlib import Path
from typing import Any

from ..spec import (Container, Gate, HangAuto, Host, Inventory, Key, MetricsEndpoint, Network,
                    SlowNode, SlurmSettings, SshSettings, keys_of)

BEGIN, END = "<!-- keys:begin -->", "<!-- keys:end -->"
# Where each model's keys are written in a file, in the table's order.
SECTIONS: tuple[tuple[str, type], ...] = (
    ("top level", Inventory), ("host", Host), ("network", Network), ("container", Container),
    ("ssh", SshSettings), ("slurm", SlurmSettings), ("hang_auto", HangAuto),
    ("slow_node", SlowNode), ("gate", Gate), ("metrics", MetricsEndpoint))
DEFAULTS_ROW = ("top level", "`defaults`", "mapping", "", "",
                "host keys for every host; a host's own value wins by its merge rule")
HEADER = ("where", "key", "type", "default", "on a host", "help")


def kind(k: Key) -> str:
    """The type a key takes, as the table shows it."""
    if k.kind:
        return k.kind
    if k.check == "integer":
        return f"whole number >= {k.args[0]}"
    if k.check == "number":
        return f"number >= {k.args[0]}"
    if k.check == "choice":
        *first, last = k.args[0]
        return ", ".join(first) + f" or {last}"
    return {"string": "string", "matching": "string", "port": "port (1-65535)",
            "seconds": "seconds (> 0)", "hang_timeout": "seconds (> 0) or auto",
            "nproc": "auto or whole number >= 1",
            "section": "mapping"}[k.check or ""]


def default(value: Any) -> str:
    if value is dataclasses.MISSING:
        return "required"
    if value is None:
        return "unset"
    if value == () or dataclasses.is_dataclass(value):
        return ""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return f"`{value}`"


def rows() -> list[tuple[str, ...]]:
    """One row per key: where, key, type, default, merge rule (host keys), help."""
    out: list[tuple[str, ...]] = []
    for where, cls in SECTIONS:
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for name, k in keys_of(cls).items():
            place = k.scope if cls is Host else where
            merge = k.merge if cls is Host and k.scope != "host" else ""
            shown = k.shown or default(fields[name].default)
            out.append((place, f"`{name}`", kind(k), shown, merge, k.help))
            if cls is Inventory and name == "hosts":
                out.append(DEFAULTS_ROW)
    return out


def table() -> str:
    lines = [HEADER, tuple("---" for _ in HEADER)] + rows()
    return "\n".join("| " + " | ".join(cell.replace("|", "\\|") for cell in line) + " |"
                     for line in lines) + "\n"


def page_with_table(page: str) -> str:
    """The page with the text between its markers replaced by the table."""
    pattern = re.compile(re.escape(BEGIN) + r"\n.*?" + re.escape(END), re.S)
    if not pattern.search(page):
        raise ValueError(f"no {BEGIN} ... {END} markers in the page")
    return pattern.sub(lambda _: f"{BEGIN}\n{table()}{END}", page)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cluster.inventory.keys",
                                     description="The inventory's key table, as markdown.")
    parser.add_argument("--write", metavar="PAGE",
                        help=f"replace the text between {BEGIN} and {END} in PAGE")
    args = parser.parse_args(argv)
    if not args.write:
        sys.stdout.write(table())
        return 0
    page = Path(args.write)
    page.write_text(page_with_table(page.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
