# ==== node 0: gpu-a (10.0.0.11) -> ~/cluster-runs/.cluster/golden-run/gpu-a/launch.sh
#!/usr/bin/env bash
# cluster run golden-run: node 0 of 2, gpu-a (10.0.0.11)
# Rendered by `cluster up`; every value below is shell-quoted. Do not edit: re-render instead.
# shellcheck disable=SC2016  # literal $ and backquotes in quoted values
set -euo pipefail

cd "$HOME"/cluster-runs

# Identity of this run: every process started below inherits it, which is how
# `cluster down` finds them all (never by name or pattern).
export CLUSTER_RUN_ID=golden-run
export CLUSTER_NODE=gpu-a
export CLUSTER_NODE_RANK=0
export CLUSTER_NNODES=2
export CLUSTER_RESTART_COUNT=0

# Environment from the inventory (defaults, then this host's own values).
export OMP_NUM_THREADS=8
export NASTY='$(touch /tmp/pwned) `id` "dq" '"'"'s'"'"' 64(x2) 100% ; rm -rf ~'

export NCCL_SOCKET_IFNAME='^docker0,lo'
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
cluster_ifname 10.0.0.11 10.0.0.11
if [ -n "$IFNAME" ] && [ "$IFNAME" != lo ]; then
  export GLOO_SOCKET_IFNAME="$IFNAME"
else
  echo "cluster: no interface found for this node's address; NCCL and Gloo will choose one" >&2
fi
export NCCL_IB_DISABLE=1

export MASTER_ADDR=10.0.0.11
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
  --nnodes=2 \
  --nproc_per_node=2 \
  --node_rank=0 \
  --master_addr=10.0.0.11 \
  --master_port=29841 \
  --local_addr=10.0.0.11 \
  train.py \
  --epochs \
  3 \
  --name \
  'a b $(x)'
# ==== node 1: gpu-b (10.0.0.12) -> /scratch/bob/.cluster/golden-run/gpu-b/launch.sh
#!/usr/bin/env bash
# cluster run golden-run: node 1 of 2, gpu-b (10.0.0.12)
# Rendered by `cluster up`; every value below is shell-quoted. Do not edit: re-render instead.
# shellcheck disable=SC2016  # literal $ and backquotes in quoted values
set -euo pipefail

cd /scratch/bob

# Identity of this run: every process started below inherits it, which is how
# `cluster down` finds them all (never by name or pattern).
export CLUSTER_RUN_ID=golden-run
export CLUSTER_NODE=gpu-b
export CLUSTER_NODE_RANK=1
export CLUSTER_NNODES=2
export CLUSTER_RESTART_COUNT=0

# Environment from the inventory (defaults, then this host's own values).
export OMP_NUM_THREADS=4
export NASTY='$(touch /tmp/pwned) `id` "dq" '"'"'s'"'"' 64(x2) 100% ; rm -rf ~'
export FOO=bar
export NCCL_SOCKET_IFNAME=ib0

export GLOO_SOCKET_IFNAME=ens5
export NCCL_IB_DISABLE=1

export MASTER_ADDR=10.0.0.11
export MASTER_PORT=29841

NPROC=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU') || true
[ "${NPROC:-0}" -gt 0 ] || NPROC=1

# torchrun, as `python -m torch.distributed.run` runs it, with one difference: what is alive
# at its end is frozen for the garbage collector first, so its interpreter's shutdown does not
# scan torch's objects again (0.2 s instead of 0.7 s on each node, at every end and every stop).
CLUSTER_TORCHRUN='import gc, runpy
try:
    runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)
finally:
    gc.freeze()'

# torchrun, from the interpreter the inventory names.
exec "$HOME"/venv/bin/python -c "$CLUSTER_TORCHRUN" \
  --nnodes=2 \
  --nproc_per_node="$NPROC" \
  --node_rank=1 \
  --master_addr=10.0.0.11 \
  --master_port=29841 \
  --local_addr=10.0.0.12 \
  train.py \
  --epochs \
  3 \
  --name \
  'a b $(x)'
