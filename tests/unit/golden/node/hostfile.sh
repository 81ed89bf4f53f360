# ==== node 0: gpu01 (gpu01) -> ~/cluster-runs/.cluster/golden-run/gpu01/launch.sh
#!/usr/bin/env bash
# cluster run golden-run: node 0 of 3, gpu01 (gpu01)
# Rendered by `cluster up`; every value below is shell-quoted. Do not edit: re-render instead.
# shellcheck disable=SC2016  # literal $ and backquotes in quoted values
set -euo pipefail

cd "$HOME"/cluster-runs

# Identity of this run: every process started below inherits it, which is how
# `cluster down` finds them all (never by name or pattern).
export CLUSTER_RUN_ID=golden-run
export CLUSTER_NODE=gpu01
export CLUSTER_NODE_RANK=0
export CLUSTER_NNODES=3
export CLUSTER_RESTART_COUNT=0

# Interface, chosen here at run time: the one that holds this node's address (the address the
# other nodes reach it by), else the one the route to the master leaves through; never by
# name, so never docker0, a VPN or lo.
cluster_ifname() {
  local ip master
  ip=$(getent ahostsv4 "$1" 2>/dev/null | awk 'NR == 1 {print $1}') || true
  IFNAME=$(ip -o -4 addr show 2>/dev/null | awk -v a="${ip:-$1}" '{split($4, p, "/"); if (p[1] == a) {print $2; exit}}') || true
  if [ -z "$IFNAME" ] || [ "$IFNAME" = lo ]; then
    master=$(getent ahostsv4 "$2" 2>/dev/null | awk 'NR == 1 {print $1}') || true
    IFNAME=$(ip -o route get "${master:-$2}" 2>/dev/null | sed -n 's/.* dev \([^ ]*\).*/\1/p') || true
  fi
}
IFNAME=""
cluster_ifname gpu01 gpu01
if [ -n "$IFNAME" ] && [ "$IFNAME" != lo ]; then
  export NCCL_SOCKET_IFNAME="=$IFNAME"
  export GLOO_SOCKET_IFNAME="$IFNAME"
else
  echo "cluster: no interface found for this node's address; NCCL and Gloo will choose one" >&2
fi
if compgen -G '/sys/class/infiniband/*' >/dev/null; then export NCCL_IB_DISABLE=0; else export NCCL_IB_DISABLE=1; fi

export MASTER_ADDR=gpu01
export MASTER_PORT=29841

# torchrun, as `python -m torch.distributed.run` runs it, with one difference: what is alive
# at its end is frozen for the garbage collector first, so its interpreter's shutdown does not
# scan torch's objects again (0.2 s instead of 0.7 s on each node, at every end and every stop).
CLUSTER_TORCHRUN='import gc, runpy
try:
    runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)
finally:
    gc.freeze()'

# torchrun, from the interpreter the inventory names.
exec python3 -c "$CLUSTER_TORCHRUN" \
  --nnodes=3 \
  --nproc_per_node=8 \
  --node_rank=0 \
  --master_addr=gpu01 \
  --master_port=29841 \
  --local_addr=gpu01 \
  train.py \
  --epochs \
  3 \
  --name \
  'a b $(x)'
# ==== node 1: gpu02 (gpu02) -> ~/cluster-runs/.cluster/golden-run/gpu02/launch.sh
#!/usr/bin/env bash
# cluster run golden-run: node 1 of 3, gpu02 (gpu02)
# Rendered by `cluster up`; every value below is shell-quoted. Do not edit: re-render instead.
# shellcheck disable=SC2016  # literal $ and backquotes in quoted values
set -euo pipefail

cd "$HOME"/cluster-runs

# Identity of this run: every process started below inherits it, which is how
# `cluster down` finds them all (never by name or pattern).
export CLUSTER_RUN_ID=golden-run
export CLUSTER_NODE=gpu02
export CLUSTER_NODE_RANK=1
export CLUSTER_NNODES=3
export CLUSTER_RESTART_COUNT=0

# Interface, chosen here at run time: the one that holds this node's address (the address the
# other nodes reach it by), else the one the route to the master leaves through; never by
# name, so never docker0, a VPN or lo.
cluster_ifname() {
  local ip master
  ip=$(getent ahostsv4 "$1" 2>/dev/null | awk 'NR == 1 {print $1}') || true
  IFNAME=$(ip -o -4 addr show 2>/dev/null | awk -v a="${ip:-$1}" '{split($4, p, "/"); if (p[1] == a) {print $2; exit}}') || true
  if [ -z "$IFNAME" ] || [ "$IFNAME" = lo ]; then
    master=$(getent ahostsv4 "$2" 2>/dev/null | awk 'NR == 1 {print $1}') || true
    IFNAME=$(ip -o route get "${master:-$2}" 2>/dev/null | sed -n 's/.* dev \([^ ]*\).*/\1/p') || true
  fi
}
IFNAME=""
cluster_ifname gpu02 gpu01
if [ -n "$IFNAME" ] && [ "$IFNAME" != lo ]; then
  export NCCL_SOCKET_IFNAME="=$IFNAME"
  export GLOO_SOCKET_IFNAME="$IFNAME"
else
  echo "cluster: no interface found for this node's address; NCCL and Gloo will choose one" >&2
fi
if compgen -G '/sys/class/infiniband/*' >/dev/null; then export NCCL_IB_DISABLE=0; else export NCCL_IB_DISABLE=1; fi

export MASTER_ADDR=gpu01
export MASTER_PORT=29841

# torchrun, as `python -m torch.distributed.run` runs it, with one difference: what is alive
# at its end is frozen for the garbage collector first, so its interpreter's shutdown does not
# scan torch's objects again (0.2 s instead of 0.7 s on each node, at every end and every stop).
CLUSTER_TORCHRUN='import gc, runpy
try:
    runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)
finally:
    gc.freeze()'

# torchrun, from the interpreter the inventory names.
exec python3 -c "$CLUSTER_TORCHRUN" \
  --nnodes=3 \
  --nproc_per_node=8 \
  --node_rank=1 \
  --master_addr=gpu01 \
  --master_port=29841 \
  --local_addr=gpu02 \
  train.py \
  --epochs \
  3 \
  --name \
  'a b $(x)'
# ==== node 2: worker-3 (worker-3) -> ~/cluster-runs/.cluster/golden-run/worker-3/launch.sh
#!/usr/bin/env bash
# cluster run golden-run: node 2 of 3, worker-3 (worker-3)
# Rendered by `cluster up`; every value below is shell-quoted. Do not edit: re-render instead.
# shellcheck disable=SC2016  # literal $ and backquotes in quoted values
set -euo pipefail

cd "$HOME"/cluster-runs

# Identity of this run: every process started below inherits it, which is how
# `cluster down` finds them all (never by name or pattern).
export CLUSTER_RUN_ID=golden-run
export CLUSTER_NODE=worker-3
export CLUSTER_NODE_RANK=2
export CLUSTER_NNODES=3
export CLUSTER_RESTART_COUNT=0

# Interface, chosen here at run time: the one that holds this node's address (the address the
# other nodes reach it by), else the one the route to the master leaves through; never by
# name, so never docker0, a VPN or lo.
cluster_ifname() {
  local ip master
  ip=$(getent ahostsv4 "$1" 2>/dev/null | awk 'NR == 1 {print $1}') || true
  IFNAME=$(ip -o -4 addr show 2>/dev/null | awk -v a="${ip:-$1}" '{split($4, p, "/"); if (p[1] == a) {print $2; exit}}') || true
  if [ -z "$IFNAME" ] || [ "$IFNAME" = lo ]; then
    master=$(getent ahostsv4 "$2" 2>/dev/null | awk 'NR == 1 {print $1}') || true
    IFNAME=$(ip -o route get "${master:-$2}" 2>/dev/null | sed -n 's/.* dev \([^ ]*\).*/\1/p') || true
  fi
}
IFNAME=""
cluster_ifname worker-3 gpu01
if [ -n "$IFNAME" ] && [ "$IFNAME" != lo ]; then
  export NCCL_SOCKET_IFNAME="=$IFNAME"
  export GLOO_SOCKET_IFNAME="$IFNAME"
else
  echo "cluster: no interface found for this node's address; NCCL and Gloo will choose one" >&2
fi
if compgen -G '/sys/class/infiniband/*' >/dev/null; then export NCCL_IB_DISABLE=0; else export NCCL_IB_DISABLE=1; fi

export MASTER_ADDR=gpu01
export MASTER_PORT=29841

# torchrun, as `python -m torch.distributed.run` runs it, with one difference: what is alive
# at its end is frozen for the garbage collector first, so its interpreter's shutdown does not
# scan torch's objects again (0.2 s instead of 0.7 s on each node, at every end and every stop).
CLUSTER_TORCHRUN='import gc, runpy
try:
    runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)
finally:
    gc.freeze()'

# torchrun, from the interpreter the inventory names.
exec python3 -c "$CLUSTER_TORCHRUN" \
  --nnodes=3 \
  --nproc_per_node=4 \
  --node_rank=2 \
  --master_addr=gpu01 \
  --master_port=29841 \
  --local_addr=worker-3 \
  train.py \
  --epochs \
  3 \
  --name \
  'a b $(x)'
