"""The network policy of a node, in one place: which interface NCCL and Gloo use, and whether
NCCL may use InfiniBand. Both templates render it through templates/network.sh.j2, and the run
record (env.json) takes its variables from `decided_env`, so what a script exports and what the
record says can never disagree.

Three sources for the interface, first match wins:
- the user's own NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME in `env` (never overridden);
- `network.ifname` from the inventory: a plain name sets both; an NCCL list ('^docker0,lo',
  '=eth0,eth1') goes to NCCL only, since Gloo takes one name (Gloo's is then chosen at run time);
- the interface the node itself reported at the check (`resolved`): written into the script
  as an exact name ('=eth0' for NCCL, whose plain values are prefixes);
- otherwise the script chooses at run time, on the node (a dry run, --no-preflight, SLURM),
  exact for NCCL there too.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from .spec import Host

PLAIN_IFNAME = re.compile(r"^[A-Za-z0-9_.:@-]+\Z")


@dataclass(frozen=True)
class NetworkPolicy:
    nccl: str | None          # NCCL_SOCKET_IFNAME the script exports (None: leave it)
    gloo: str | None          # GLOO_SOCKET_IFNAME the script exports
    detect_nccl: bool         # the script chooses NCCL's interface at run time
    detect_gloo: bool
    ib: str | None            # on | off | auto; None when the user sets NCCL_IB_DISABLE

    @property
    def detect(self) -> bool:
        return self.detect_nccl or self.detect_gloo


def policy(host: Host, resolved: str | None = None) -> NetworkPolicy:
    user = {**dict(host.env), **dict.fromkeys(host.secret_env, "")}
    manual = host.network.ifname
    nccl: str | None
    gloo: str | None
    if manual:
        nccl, gloo = manual, manual if PLAIN_IFNAME.match(manual) else None
    elif resolved:
        nccl, gloo = f"={resolved}", resolved
    else:
        nccl = gloo = None
    user_nccl, user_gloo = "NCCL_SOCKET_IFNAME" in user, "GLOO_SOCKET_IFNAME" in user
    return NetworkPolicy(
        nccl=None if user_nccl else nccl, gloo=None if user_gloo else gloo,
        detect_nccl=not user_nccl and nccl is None,
        detect_gloo=not user_gloo and gloo is None,
        ib=None if "NCCL_IB_DISABLE" in user else host.network.ib)


def decided_env(net: NetworkPolicy) -> list[tuple[str, str]]:
    """The variables the policy fixes before the node runs (what run-time choice leaves open
    is not recorded: the node decides it)."""
    out = []
    if net.nccl:
        out.append(("NCCL_SOCKET_IFNAME", net.nccl))
    if net.gloo:
        out.append(("GLOO_SOCKET_IFNAME", net.gloo))
    if net.ib in ("on", "off"):
        out.append(("NCCL_IB_DISABLE", "0" if net.ib == "on" else "1"))
    return out
