"""Inventory: YAML, MPI/DeepSpeed hostfiles and SLURM hostlists -> one typed, validated
cluster.spec.Inventory. The model (Host, Inventory, ...) is imported from cluster.spec only.

    loader       YAML with line marks
    checks       the readers that check one key each
    parser       the YAML inventory, read by walking the key declarations of cluster.spec
    keys         the key table (docs/inventory.md), generated from those declarations
    hostfile     MPI/DeepSpeed hostfiles and SLURM hostlists
    environment  env_forward and dotenv files: values from the launching shell
"""
from __future__ import annotations

import re
from pathlib import Path

from ..errors import InputError
from .. import spec
from .environment import forward_env, load_env_file, unset_forwarded
from .hostfile import check_unique, parse_hostfile
from .parser import parse_yaml

__all__ = ["load", "from_hostnames", "parse_yaml", "parse_hostfile", "forward_env",
           "load_env_file", "unset_forwarded"]


def load(path: str | Path) -> spec.Inventory:
    """Read an inventory file: YAML (a mapping with 'hosts') or an MPI/DeepSpeed hostfile."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise InputError(f"cannot read inventory {path}: {exc.strerror}") from None
    if _looks_like_yaml(path, text):
        return parse_yaml(text, str(path))
    return parse_hostfile(text, str(path))


def from_hostnames(expr: str) -> spec.Inventory:
    """`--hosts gpu[01-04]` with no inventory: SSH hosts with every setting at its default."""
    hosts = tuple(spec.Host(name=n, address=n) for n in spec.expand_names(expr, "--hosts"))
    check_unique(hosts, "--hosts")
    return spec.Inventory(hosts=hosts, source="--hosts")


def _looks_like_yaml(path: Path, text: str) -> bool:
    if path.suffix in (".yaml", ".yml"):
        return True
    if path.suffix in (".txt", ".hostfile") or path.name == "hostfile":
        return False
    return bool(re.search(r"^(hosts|defaults)\s*:", text, re.M))
