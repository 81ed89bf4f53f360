"""docs/inventory.md's key table is generated from the key declarations (cluster.spec), and
stays so; every declared key is read by a reader of cluster.inventory.checks."""
from __future__ import annotations

from pathlib import Path

from cluster.inventory import keys
from cluster.inventory.checks import Checks
from cluster.spec import keys_of

PAGE = Path(__file__).resolve().parents[2] / "docs" / "inventory.md"


def test_the_page_holds_the_table_of_the_declarations() -> None:
    page = PAGE.read_text()
    assert keys.BEGIN in page and keys.END in page, f"{PAGE} lost its markers"
    assert page == keys.page_with_table(page), (
        "docs/inventory.md's key table differs from the declarations in cluster/spec.py: "
        "regenerate it with `python -m cluster.inventory.keys --write docs/inventory.md`")


def test_every_key_is_in_the_table_once() -> None:
    table = keys.table()
    for _, cls in keys.SECTIONS:
        for name in keys_of(cls):
            assert f"| `{name}` |" in table, name
    assert len(keys.rows()) == sum(len(keys_of(cls)) for _, cls in keys.SECTIONS) + 1


def test_every_declared_check_is_a_reader() -> None:
    for _, cls in keys.SECTIONS:
        for name, k in keys_of(cls).items():
            # None: read by the file's structure (hosts, name, address); a section, by the parser
            assert k.check in (None, "section") or callable(getattr(Checks, k.check, None)), \
                (cls, name)


def test_the_model_is_imported_from_spec_only() -> None:
    import cluster.inventory
    for name in ("Host", "Inventory", "Container", "Network", "Mount", "SshSettings",
                 "SlurmSettings"):
        assert not hasattr(cluster.inventory, name), f"cluster.inventory.{name}: import it from cluster.spec"
