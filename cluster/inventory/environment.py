"""Values from the launching shell: env_forward, and dotenv files (--env-file)."""
from __future__ import annotations

import dataclasses
import fnmatch
import re
from collections.abc import Mapping
from pathlib import Path

from ..errors import InputError, InventoryError
from ..spec import Inventory
from ..texts import env_problem


def forward_env(inventory: Inventory, environ: Mapping[str, str],
                dry_run: bool = False) -> Inventory:
    """Each host's env_forward names and globs, copied from the launching shell into its env
    (over the inventory's own values). A plain name that is not set is an error, except in a
    dry run, which leaves it out (unset_forwarded names it); a glob may match nothing. Never
    the secret names (their values go over the connection), never a name cluster sets itself."""
    hosts = []
    for host in inventory.hosts:
        if not host.env_forward:
            hosts.append(host)
            continue
        where = f"{inventory.source or 'inventory'}" + (f":{host.line}" if host.line else "")
        values: dict[str, str] = {}
        for pattern in host.env_forward:
            if not any(c in pattern for c in "*?"):
                if pattern in host.secret_env:
                    raise InputError(f"{where}: env_forward: {pattern} is also a secret_env name; "
                                     "keep it in secret_env only (never written to a file)")
                if pattern not in environ and dry_run:
                    continue
                if pattern not in environ:
                    raise InputError(f"{where}: env_forward: {pattern} is not set in this shell "
                                     f"(host {host.name}); export it, or take it out of env_forward")
                values[pattern] = environ[pattern]
                why = env_problem(pattern, environ[pattern])
                if why:
                    raise InputError(f"{where}: env_forward: {why} (host {host.name})")
                continue
            for name in sorted(environ):
                if (fnmatch.fnmatchcase(name, pattern) and name not in host.secret_env
                        and not env_problem(name, environ[name])):
                    values[name] = environ[name]     # a glob passes over what may not go
        hosts.append(host.replace(env=tuple({**dict(host.env), **values}.items())))
    return dataclasses.replace(inventory, hosts=tuple(hosts))


def unset_forwarded(inventory: Inventory, environ: Mapping[str, str]) -> list[str]:
    """The plain env_forward names this shell does not set: a dry run says so, a launch refuses."""
    return sorted({name for h in inventory.hosts for name in h.env_forward
                   if not any(c in name for c in "*?") and name not in environ})


_DOTENV = re.compile(r"^\s*(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)\s*=\s*(.*?)\s*\Z")
_DOUBLE_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", '"': '"', "\\": "\\", "$": "$"}


def load_env_file(path: str | Path) -> dict[str, str]:
    """A dotenv file: KEY=VALUE lines (`export ` allowed), # comments, blank lines; a value is
    as written, or in '…' (literal) or "…" (with \\n \\t \\" \\\\ escapes); nothing is expanded,
    so $HOME stays $HOME. Errors name the file and line."""
    source = str(path)
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"Invalid value for --env-file: cannot read {source}: {exc}") from None
    out: dict[str, str] = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        m = _DOTENV.match(line)
        if not m:
            raise InventoryError(source, lineno, None, "expected KEY=VALUE (KEY letters, digits "
                                 "and '_', not starting with a digit)")
        key, raw = m.groups()
        value = _dotenv_value(raw, source, lineno, key)
        why = env_problem(key, value)       # a quoted value's \n and \t included
        if why:
            raise InventoryError(source, lineno, key, why)
        out[key] = value
    return out


def _dotenv_value(raw: str, source: str, lineno: int, key: str) -> str:
    if raw[:1] in ("'", '"'):
        quote = raw[0]
        end = _closing_quote(raw, quote)
        rest = raw[end + 1:].strip() if end is not None else ""
        if end is None or (rest and not rest.startswith("#")):
            raise InventoryError(source, lineno, key, f"unterminated or trailing text after {quote}…{quote}")
        body = raw[1:end]
        if quote == "'":
            return body
        return re.sub(r"\\(.)", lambda e: _DOUBLE_ESCAPES.get(e.group(1), "\\" + e.group(1)), body)
    return re.split(r"\s+#", raw, maxsplit=1)[0]         # an unquoted value ends at ' #'


def _closing_quote(raw: str, quote: str) -> int | None:
    i = 1
    while i < len(raw):
        if raw[i] == "\\" and quote == '"':
            i += 2
            continue
        if raw[i] == quote:
            return i
        i += 1
    return None
