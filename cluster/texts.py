"""What a user's text may be before it reaches a node's script, a shell or an HTTP request, and
how what may hold a secret is shown: no control character in a field that reaches a script;
an environment entry's rules (a valid name, not one cluster sets itself); an alert's URL
checked, and only ever shown redacted (a webhook's path is its token)."""
from __future__ import annotations

import ipaddress
import re
from urllib.parse import SplitResult, urlsplit

from .errors import InputError

HOSTNAME = re.compile(r"^(?=.{1,253}\Z)[A-Za-z0-9_]([A-Za-z0-9_-]{0,62})(\.[A-Za-z0-9_-]{1,63})*\Z")
ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
CONTROL = re.compile(r"[\x00-\x1f\x7f]")

# Set by cluster itself on every node: the identity that stopping relies on, and the rendezvous.
RESERVED_ENV_PREFIX = "CLUSTER_"
RESERVED_ENV = frozenset({"MASTER_ADDR", "MASTER_PORT"})


def control_char(value: str) -> str | None:
    """A description of the first control character in value ('\\n at position 4'), or None.
    No field that reaches a script may hold one: a newline ends a line of that script."""
    m = CONTROL.search(value)
    if m is None:
        return None
    return f"{m.group()!r} at position {m.start()}"


def reserved_env(name: str) -> str | None:
    """Why an environment name may not be set by the user, or None."""
    if name.startswith(RESERVED_ENV_PREFIX):
        return (f"{name} is set by cluster itself (names starting with {RESERVED_ENV_PREFIX} are "
                f"reserved: they carry the run's identity; choose another name)")
    if name == "MASTER_ADDR":
        return (f"{name} is set by cluster itself, from the rendezvous: the address of the node "
                f"torch numbers 0: the inventory's first host (under `rendezvous: c10d`, the "
                f"host whose address sorts first)")
    if name in RESERVED_ENV:
        return (f"{name} is set by cluster itself, from the rendezvous (choose the rendezvous "
                f"port with master_port / --master-port)")
    return None


def env_problem(name: str, value: str) -> str | None:
    """Why NAME=value may not be in a job's environment, or None: the one rule for the
    inventory's env:, --env, --env-file and the API's env=, since each pair is written into
    the node's script (quoted: a control character would still change its lines)."""
    if not ENV_KEY.match(name):
        return (f"environment variable name {name!r} is not a valid identifier (letters, "
                f"digits and '_', not starting with a digit)")
    why = reserved_env(name)
    if why:
        return why
    bad = control_char(value)
    if bad:
        return (f"control character {bad} in the value of {name} (values reach the node's "
                f"script; a multi-line value can travel as a secret, --secret-env / "
                f"secret_env:, which reaches no script)")
    return None


def check_text(value: str, what: str) -> str:
    """Raise InputError for a control character in a field that reaches a script."""
    bad = control_char(value)
    if bad:
        raise InputError(f"Invalid value for {what}: control character {bad} "
                         f"(fields that reach a script may not hold them)")
    return value


def url_problem(url: str) -> str | None:
    """Why `url` cannot take an alert (cluster.observe.alerts), or None: http or https, a
    host, a port that is a number, no control character or space. Said with the URL
    redacted (redacted_url): a webhook's path is its secret."""
    bad = control_char(url)
    if bad:
        return f"control character {bad} in {redacted_url(url)!r}"
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        return f"{redacted_url(url)!r} is not an http:// or https:// URL"
    if not parts.hostname or " " in url:
        return f"{redacted_url(url)!r} names no host (e.g. https://hooks.slack.com/services/...)"
    if _port(parts) is None and ":" in parts.netloc.rsplit("@", 1)[-1].rsplit("]", 1)[-1]:
        return f"{redacted_url(url)!r} has a port that is not a number from 1 to 65535"
    return None


def redacted_url(url: str) -> str:
    """scheme://host/... : what is ever shown of a URL (its path, query and user part may
    hold a token, as a Slack webhook's does)."""
    parts = urlsplit(url.strip())
    host = parts.hostname or ""
    host = f"[{host}]" if ":" in host else host
    port = _port(parts)
    where = f"{host}:{port}" if port else host
    if not parts.scheme or not parts.scheme.isalnum():
        return "<a URL>"
    return f"{parts.scheme}://{where}/..." if host else f"{parts.scheme}://..."


def redacted_words(words: list[str], urls: tuple[str, ...]) -> list[str]:
    """A command line with each of `urls` in it redacted (`--notify URL`, `--notify=URL`):
    what run.json records."""
    out = []
    for word in words:
        for url in sorted(urls, key=len, reverse=True):
            word = word.replace(url, redacted_url(url))
        out.append(word)
    return out


def _port(parts: SplitResult) -> int | None:
    try:
        return parts.port
    except ValueError:
        return None


def address_problem(address: str) -> str | None:
    """Why `address` cannot be listened on (the live metrics' server), or None: an IP address
    (0.0.0.0: every interface) or a host name (localhost)."""
    try:
        ipaddress.ip_address(address)
    except ValueError:
        if not HOSTNAME.match(address):
            return f"{address!r} is neither an IP address nor a host name"
    return None
