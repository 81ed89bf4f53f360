#!/usr/bin/env bash
# cluster doctor: what the container image sees on node gpu-a, started exactly as a
# run starts it (templates/container.sh.j2), then removed.
set -euo pipefail
cd "$HOME"/cluster-runs 2>/dev/null || cd
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
# As this user, not root: files in the workdir stay the user's, and its processes can be
# stopped by identity like any of the run's.
CLUSTER_RUN+=(--user "$(id -u):$(id -g)" --ulimit memlock=-1:-1)
if compgen -G '/dev/nvidia[0-9]*' >/dev/null; then
  CLUSTER_RUN+=(--gpus all)                    # the NVIDIA container toolkit
fi
if [ -d /dev/infiniband ]; then
  CLUSTER_RUN+=(--device /dev/infiniband --cap-add IPC_LOCK)
fi
docker "${CLUSTER_RUN[@]}" nvcr.io/nvidia/pytorch:24.05-py3 python3 -c 'print('"'"'@@inside {}'"'"')' </dev/null
