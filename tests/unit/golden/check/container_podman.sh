#!/usr/bin/env bash
# cluster doctor: what the container image sees on node gpu-a, started exactly as a
# run starts it (templates/container.sh.j2), then removed.
set -euo pipefail
cd "$HOME"/runs 2>/dev/null || cd
# The container. Host networking: the interface chosen for NCCL and Gloo and MASTER_ADDR hold.
# Host IPC: NCCL and DataLoader workers need more shared memory than a container's 64 MB.
# The node's GPUs and InfiniBand devices, locked memory for RDMA, the working directory at the
# same path. No value of the environment is ever on this command line (ps would show it).
CLUSTER_CONTAINER=cluster-doctor-x-gpu-a
case "$PWD" in
  *[:,]*) echo "cluster: cannot mount $PWD into a container (a path holds ':' or ',')" >&2; exit 2 ;;
esac
CLUSTER_RUN=(run --rm --init --interactive --name "$CLUSTER_CONTAINER" --network host --ipc host
  --volume "$PWD:$PWD" --workdir "$PWD")
# podman sets limits as the calling user: unlimited locked memory only where it may be raised.
if (ulimit -l unlimited) 2>/dev/null; then
  CLUSTER_RUN+=(--ulimit memlock=-1:-1)
elif [ -d /dev/infiniband ]; then
  echo "cluster: locked memory stays at $(ulimit -Hl) KiB in the container (RDMA wants unlimited: raise memlock in limits.conf)" >&2
fi
if compgen -G '/dev/nvidia[0-9]*' >/dev/null; then
  CLUSTER_RUN+=(--device nvidia.com/gpu=all)   # CDI: nvidia-ctk cdi generate
fi
if [ -d /dev/infiniband ]; then
  CLUSTER_RUN+=(--device /dev/infiniband --cap-add IPC_LOCK)
fi
CLUSTER_RUN+=(--volume /datasets:/datasets:ro)
CLUSTER_RUN+=(--volume "$HOME"/'ckpt dir':/ckpt)
# shellcheck disable=SC2054  # the commas separate mount flags, not array items
CLUSTER_RUN+=(--volume /scratch:/scratch:rw,z)
# The inventory's own options, last: they may override the ones above.
CLUSTER_RUN+=(--ulimit stack=67108864 '--label=owner=a b')
podman "${CLUSTER_RUN[@]}" registry.example.com:5000/team/train:2024.05 /opt/conda/bin/python -c 'print('"'"'@@inside {}'"'"')' </dev/null
