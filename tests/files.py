"""A folder of files from a dict, for the tests that sync, pull or clean them."""
from __future__ import annotations

from pathlib import Path


def tree(root: Path, files: dict[str, str]) -> Path:
    """Write each relative path's text under root (folders made as needed); root back."""
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root
