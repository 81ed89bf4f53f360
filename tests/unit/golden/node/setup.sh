# ==== node 0: gpu-a (10.0.0.11) -> ~/cluster-runs/.cluster/golden-run/gpu-a/launch.sh
#!/usr/bin/env bash
# cluster run golden-run: node 0 of 2, gpu-a (10.0.0.11)
# Rendered by `cluster up`; every value below is shell-quoted. Do not edit: re-render instead.
# shellcheck disable=SC2016,SC1090,SC1091  # literal $ and backquotes in quoted values; setup may source files
set -euo pipefail

cd "$HOME"/cluster-runs

# Identity of this run: every process started below inherits it, which is how
# `cluster down` finds them all (never by name or pattern).
export CLUSTER_RUN_ID=golden-run
export CLUSTER_NODE=gpu-a
export CLUSTER_NODE_RANK=0
export CLUSTER_NNODES=2
export CLUSTER_RESTART_COUNT=0

# Setup from the inventory, run as written (each line in this shell, in order).
set +u
{ module load cuda/12.4 nccl
} </dev/null || { rc=$?; printf 'cluster: setup line %s failed (exit %s): %s\n' 1 "$rc" 'module load cuda/12.4 nccl' >&2; exit 2; }
{ source ~/venvs/train/bin/activate
} </dev/null || { rc=$?; printf 'cluster: setup line %s failed (exit %s): %s\n' 2 "$rc" 'source ~/venvs/train/bin/activate' >&2; exit 2; }
{ export HF_HOME="/scratch/$USER/hf"
} </dev/null || { rc=$?; printf 'cluster: setup line %s failed (exit %s): %s\n' 3 "$rc" 'export HF_HOME="/scratch/$USER/hf"' >&2; exit 2; }
set -u

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
  export NCCL_SOCKET_IFNAME="=$IFNAME"
  export GLOO_SOCKET_IFNAME="$IFNAME"
else
  echo "cluster: no interface found for this node's address; NCCL and Gloo will choose one" >&2
fi
if compgen -G '/sys/class/infiniband/*' >/dev/null; then export NCCL_IB_DISABLE=0; else export NCCL_IB_DISABLE=1; fi

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

# torchrun, from the python the setup left on PATH.
PYTHON=$(command -v python3 || command -v python) || {
  echo "cluster: no python3 on PATH after setup (PATH=$PATH)" >&2
  exit 127
}
exec "$PYTHON" -c "$CLUSTER_TORCHRUN" \
  --nnodes=2 \
  --nproc_per_node="$NPROC" \
  --node_rank=0 \
  --master_addr=10.0.0.11 \
  --master_port=29841 \
  --local_addr=10.0.0.11 \
  --monitor-interval=1 \
  --log-dir \
  'logs dir/$(x)' \
  train.py \
  --epochs \
  3 \
  --name \
  'a b $(x)'
# ==== node 1: gpu-b (10.0.0.12) -> ~/cluster-runs/.cluster/golden-run/gpu-b/launch.sh
#!/usr/bin/env bash
# cluster run golden-run: node 1 of 2, gpu-b (10.0.0.12)
# Rendered by `cluster up`; every value below is shell-quoted. Do not edit: re-render instead.
# shellcheck disable=SC2016,SC1090,SC1091  # literal $ and backquotes in quoted values; setup may source files
set -euo pipefail

cd "$HOME"/cluster-runs

# Identity of this run: every process started below inherits it, which is how
# `cluster down` finds them all (never by name or pattern).
export CLUSTER_RUN_ID=golden-run
export CLUSTER_NODE=gpu-b
export CLUSTER_NODE_RANK=1
export CLUSTER_NNODES=2
export CLUSTER_RESTART_COUNT=0

# Setup from the inventory, run as written (each line in this shell, in order).
set +u
{ ulimit -n 65536
} </dev/null || { rc=$?; printf 'cluster: setup line %s failed (exit %s): %s\n' 1 "$rc" 'ulimit -n 65536' >&2; exit 2; }
set -u

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
cluster_ifname 10.0.0.12 10.0.0.11
if [ -n "$IFNAME" ] && [ "$IFNAME" != lo ]; then
  export NCCL_SOCKET_IFNAME="=$IFNAME"
  export GLOO_SOCKET_IFNAME="$IFNAME"
else
  echo "cluster: no interface found for this node's address; NCCL and Gloo will choose one" >&2
fi
if compgen -G '/sys/class/infiniband/*' >/dev/null; then export NCCL_IB_DISABLE=0; else export NCCL_IB_DISABLE=1; fi

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
exec /opt/py/bin/python3 -c "$CLUSTER_TORCHRUN" \
  --nnodes=2 \
  --nproc_per_node="$NPROC" \
  --node_rank=1 \
  --master_addr=10.0.0.11 \
  --master_port=29841 \
  --local_addr=10.0.0.12 \
  --monitor-interval=1 \
  --log-dir \
  'logs dir/$(x)' \
  train.py \
  --epochs \
  3 \
  --name \
  'a b $(x)'
