# ==== node 0: gpu-a (10.0.0.11) -> ~/cluster-runs/.cluster/golden-run/gpu-a/launch.sh
#!/usr/bin/env bash
# cluster run golden-run: node 0 of 2, gpu-a (10.0.0.11)
# Rendered by `cluster up`; every value below is shell-quoted. Do not edit: re-render instead.
# shellcheck disable=SC2016  # literal $ and backquotes inside quoted values are intended
set -euo pipefail

cd "$HOME"/cluster-runs

# Identity of this run: every process started below inherits it, which is how
# `cluster down` finds them all (never by name or pattern).
export CLUSTER_RUN_ID=golden-run
export CLUSTER_NODE=gpu-a
export CLUSTER_NODE_RANK=0
export CLUSTER_NNODES=2

export NCCL_SOCKET_IFNAME='^docker0,lo'
# Interface: the one that holds this node's address, which is the address the other
# nodes reach it by (not docker0, not a VPN, not lo).
cluster_ifname() {
  local ip
  ip=$(getent ahostsv4 "$1" 2>/dev/null | awk 'NR == 1 {print $1}') || true
  ip -o -4 addr show 2>/dev/null | awk -v a="${ip:-$1}" '{split($4, p, "/"); if (p[1] == a) {print $2; exit}}'
}
IFNAME=$(cluster_ifname 10.0.0.11) || true
if [ -z "$IFNAME" ]; then
  IFNAME=$(ip -o route get 10.0.0.11 2>/dev/null | sed -n 's/.* dev \([^ ]*\).*/\1/p') || true
fi
if [ -n "$IFNAME" ]; then
  export GLOO_SOCKET_IFNAME="$IFNAME"
else
  echo "cluster: no interface holds 10.0.0.11; NCCL and Gloo will choose one" >&2
fi
export NCCL_IB_DISABLE=1

# Environment from the inventory (defaults, then this host's own values).
export OMP_NUM_THREADS=8
export NASTY='$(touch /tmp/pwned) `id` "dq" '"'"'s'"'"' 64(x2) 100% ; rm -rf ~'
export MULTI='line one
line two'

export MASTER_ADDR=10.0.0.11
export MASTER_PORT=29841

# torchrun, from the interpreter the inventory names.
exec python3 -m torch.distributed.run \
  --nnodes=2 \
  --nproc_per_node=2 \
  --rdzv_backend=c10d \
  --rdzv_endpoint=10.0.0.11:29841 \
  --rdzv_id=golden-run \
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
# shellcheck disable=SC2016  # literal $ and backquotes inside quoted values are intended
set -euo pipefail

cd /scratch/bob

# Identity of this run: every process started below inherits it, which is how
# `cluster down` finds them all (never by name or pattern).
export CLUSTER_RUN_ID=golden-run
export CLUSTER_NODE=gpu-b
export CLUSTER_NODE_RANK=1
export CLUSTER_NNODES=2

export GLOO_SOCKET_IFNAME=ens5
export NCCL_IB_DISABLE=1

# Environment from the inventory (defaults, then this host's own values).
export OMP_NUM_THREADS=4
export NASTY='$(touch /tmp/pwned) `id` "dq" '"'"'s'"'"' 64(x2) 100% ; rm -rf ~'
export MULTI='line one
line two'
export FOO=bar
export NCCL_SOCKET_IFNAME=ib0

export MASTER_ADDR=10.0.0.11
export MASTER_PORT=29841

NPROC=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU') || true
[ "${NPROC:-0}" -gt 0 ] || NPROC=1

# torchrun, from the interpreter the inventory names.
exec "$HOME"/venv/bin/python -m torch.distributed.run \
  --nnodes=2 \
  --nproc_per_node="$NPROC" \
  --rdzv_backend=c10d \
  --rdzv_endpoint=10.0.0.11:29841 \
  --rdzv_id=golden-run \
  --local_addr=10.0.0.12 \
  train.py \
  --epochs \
  3 \
  --name \
  'a b $(x)'
