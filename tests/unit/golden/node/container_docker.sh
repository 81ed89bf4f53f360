# ==== node 0: gpu-a (10.0.0.11) -> ~/cluster-runs/.cluster/golden-run/gpu-a/launch.sh
#!/usr/bin/env bash
# cluster run golden-run: node 0 of 2, gpu-a (10.0.0.11)
# Rendered by `cluster up`; every value below is shell-quoted. Do not edit: re-render instead.
# shellcheck disable=SC2016  # literal $ and backquotes in quoted values
set -euo pipefail
# This node's private run directory (where the supervisor put this script).
CLUSTER_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

cd "$HOME"/cluster-runs

# Identity of this run: every process started below inherits it, which is how
# `cluster down` finds them all (never by name or pattern).
export CLUSTER_RUN_ID=golden-run
export CLUSTER_NODE=gpu-a
export CLUSTER_NODE_RANK=0
export CLUSTER_NNODES=2
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

# torchrun, as `python -m torch.distributed.run` runs it, with one difference: what is alive
# at its end is frozen for the garbage collector first, so its interpreter's shutdown does not
# scan torch's objects again (0.2 s instead of 0.7 s on each node, at every end and every stop).
CLUSTER_TORCHRUN='import gc, runpy
try:
    runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)
finally:
    gc.freeze()'

# The container. Host networking: the interface chosen for NCCL and Gloo and MASTER_ADDR hold.
# Host IPC: NCCL and DataLoader workers need more shared memory than a container's 64 MB.
# The node's GPUs and InfiniBand devices, locked memory for RDMA, the working directory at the
# same path. No value of the environment is ever on this command line (ps would show it).
CLUSTER_CONTAINER=cluster-golden-run-gpu-a
case "$PWD$CLUSTER_DIR" in
  *[:,]*) echo "cluster: cannot mount $PWD or $CLUSTER_DIR into a container (a path holds ':' or ',')" >&2; exit 2 ;;
esac
CLUSTER_RUN=(run --rm --init --interactive --name "$CLUSTER_CONTAINER" --network host --ipc host
  --volume "$PWD:$PWD" --workdir "$PWD" --volume "$CLUSTER_DIR:$CLUSTER_DIR")
# As this user, not root: files in the workdir stay the user's, and its processes can be
# stopped by identity like any of the run's.
CLUSTER_RUN+=(--user "$(id -u):$(id -g)" --ulimit memlock=-1:-1)
if compgen -G '/dev/nvidia[0-9]*' >/dev/null; then
  CLUSTER_RUN+=(--gpus all)                    # the NVIDIA container toolkit
fi
if [ -d /dev/infiniband ]; then
  CLUSTER_RUN+=(--device /dev/infiniband --cap-add IPC_LOCK)
fi

# The container's environment: every variable set above, by name, NUL-separated (any value
# arrives byte for byte), in this node's private run directory. Secrets are not in it.
cluster_env_file() {
  local name
  for name in CLUSTER_RUN_ID CLUSTER_NODE CLUSTER_NODE_RANK CLUSTER_NNODES CLUSTER_RESTART_COUNT CLUSTER_HEARTBEAT_FILE MASTER_ADDR MASTER_PORT NCCL_SOCKET_IFNAME GLOO_SOCKET_IFNAME NCCL_IB_DISABLE PYTHONFAULTHANDLER PYTHONUNBUFFERED; do
    if [ -n "${!name+x}" ]; then printf '%s=%s\0' "$name" "${!name}"; fi
  done
}
(umask 077 && cluster_env_file > "$CLUSTER_DIR/container.env")

# The secret environment reaches the container on its standard input, from this shell's own
# environment (printf is a builtin: no process holds a value in its arguments); the runtime
# keeps no copy of it in its state on disk, as it would of `--env NAME`.
cluster_secrets() {
  :
}

# Inside the container: read both, NAME=VALUE each, then become torchrun with them.
CLUSTER_ENTRY='import os, sys
def pairs(data):
    return dict(kv.split(b"=", 1) for kv in data.split(b"\0") if b"=" in kv)
env = dict(os.environb)
with open(sys.argv[1], "rb") as f:
    env.update(pairs(f.read()))
env.update(pairs(sys.stdin.buffer.read()))
os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
os.execve(sys.executable, [sys.executable] + sys.argv[2:], env)'

# torchrun in the container, from the interpreter the inventory names there. The runtime's
# client does not carry the run's identity (a daemon it starts must not pass for the run).
cluster_secrets | env -u CLUSTER_RUN_ID -u CLUSTER_NODE \
  docker "${CLUSTER_RUN[@]}" nvcr.io/nvidia/pytorch:24.05-py3 \
  python3 -c "$CLUSTER_ENTRY" "$CLUSTER_DIR/container.env" \
  -c "$CLUSTER_TORCHRUN" \
  --nnodes=2 \
  --nproc_per_node=8 \
  --node_rank=0 \
  --master_addr=10.0.0.11 \
  --master_port=29841 \
  --local_addr=10.0.0.11 \
  train.py \
  --epochs \
  3 \
  --name \
  'a b $(x)'
# ==== node 1: gpu-b (10.0.0.12) -> ~/cluster-runs/.cluster/golden-run/gpu-b/launch.sh
#!/usr/bin/env bash
# cluster run golden-run: node 1 of 2, gpu-b (10.0.0.12)
# Rendered by `cluster up`; every value below is shell-quoted. Do not edit: re-render instead.
# shellcheck disable=SC2016  # literal $ and backquotes in quoted values
set -euo pipefail
# This node's private run directory (where the supervisor put this script).
CLUSTER_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

cd "$HOME"/cluster-runs

# Identity of this run: every process started below inherits it, which is how
# `cluster down` finds them all (never by name or pattern).
export CLUSTER_RUN_ID=golden-run
export CLUSTER_NODE=gpu-b
export CLUSTER_NODE_RANK=1
export CLUSTER_NNODES=2
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

# torchrun, as `python -m torch.distributed.run` runs it, with one difference: what is alive
# at its end is frozen for the garbage collector first, so its interpreter's shutdown does not
# scan torch's objects again (0.2 s instead of 0.7 s on each node, at every end and every stop).
CLUSTER_TORCHRUN='import gc, runpy
try:
    runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)
finally:
    gc.freeze()'

# The container. Host networking: the interface chosen for NCCL and Gloo and MASTER_ADDR hold.
# Host IPC: NCCL and DataLoader workers need more shared memory than a container's 64 MB.
# The node's GPUs and InfiniBand devices, locked memory for RDMA, the working directory at the
# same path. No value of the environment is ever on this command line (ps would show it).
CLUSTER_CONTAINER=cluster-golden-run-gpu-b
case "$PWD$CLUSTER_DIR" in
  *[:,]*) echo "cluster: cannot mount $PWD or $CLUSTER_DIR into a container (a path holds ':' or ',')" >&2; exit 2 ;;
esac
CLUSTER_RUN=(run --rm --init --interactive --name "$CLUSTER_CONTAINER" --network host --ipc host
  --volume "$PWD:$PWD" --workdir "$PWD" --volume "$CLUSTER_DIR:$CLUSTER_DIR")
# As this user, not root: files in the workdir stay the user's, and its processes can be
# stopped by identity like any of the run's.
CLUSTER_RUN+=(--user "$(id -u):$(id -g)" --ulimit memlock=-1:-1)
if compgen -G '/dev/nvidia[0-9]*' >/dev/null; then
  CLUSTER_RUN+=(--gpus all)                    # the NVIDIA container toolkit
fi
if [ -d /dev/infiniband ]; then
  CLUSTER_RUN+=(--device /dev/infiniband --cap-add IPC_LOCK)
fi

# The container's environment: every variable set above, by name, NUL-separated (any value
# arrives byte for byte), in this node's private run directory. Secrets are not in it.
cluster_env_file() {
  local name
  for name in CLUSTER_RUN_ID CLUSTER_NODE CLUSTER_NODE_RANK CLUSTER_NNODES CLUSTER_RESTART_COUNT CLUSTER_HEARTBEAT_FILE MASTER_ADDR MASTER_PORT NCCL_SOCKET_IFNAME GLOO_SOCKET_IFNAME NCCL_IB_DISABLE PYTHONFAULTHANDLER PYTHONUNBUFFERED; do
    if [ -n "${!name+x}" ]; then printf '%s=%s\0' "$name" "${!name}"; fi
  done
}
(umask 077 && cluster_env_file > "$CLUSTER_DIR/container.env")

# The secret environment reaches the container on its standard input, from this shell's own
# environment (printf is a builtin: no process holds a value in its arguments); the runtime
# keeps no copy of it in its state on disk, as it would of `--env NAME`.
cluster_secrets() {
  :
}

# Inside the container: read both, NAME=VALUE each, then become torchrun with them.
CLUSTER_ENTRY='import os, sys
def pairs(data):
    return dict(kv.split(b"=", 1) for kv in data.split(b"\0") if b"=" in kv)
env = dict(os.environb)
with open(sys.argv[1], "rb") as f:
    env.update(pairs(f.read()))
env.update(pairs(sys.stdin.buffer.read()))
os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
os.execve(sys.executable, [sys.executable] + sys.argv[2:], env)'

# torchrun in the container, from the interpreter the inventory names there. The runtime's
# client does not carry the run's identity (a daemon it starts must not pass for the run).
cluster_secrets | env -u CLUSTER_RUN_ID -u CLUSTER_NODE \
  docker "${CLUSTER_RUN[@]}" nvcr.io/nvidia/pytorch:24.05-py3 \
  python3 -c "$CLUSTER_ENTRY" "$CLUSTER_DIR/container.env" \
  -c "$CLUSTER_TORCHRUN" \
  --nnodes=2 \
  --nproc_per_node=8 \
  --node_rank=1 \
  --master_addr=10.0.0.11 \
  --master_port=29841 \
  --local_addr=10.0.0.12 \
  train.py \
  --epochs \
  3 \
  --name \
  'a b $(x)'
