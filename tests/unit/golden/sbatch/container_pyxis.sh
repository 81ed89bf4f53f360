#!/bin/bash
# shellcheck disable=SC2016,SC2317  # literal $ in quoted values; the trap handler runs on a signal
# cluster run 20250101-120000-abcd: SLURM batch script, 2 node(s), torchrun on each.
# Rendered by `cluster up --backend slurm`; every value below is shell-quoted. Do not edit: re-render.
#SBATCH --chdir=/home/u/project
#SBATCH --gpus-per-node=8
#SBATCH --job-name=cluster-20250101-120000-abcd
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --open-mode=append
#SBATCH --output=/home/u/project/slurm-logs/20250101-120000-abcd.out
#SBATCH --requeue
#SBATCH --signal=B:USR2@90
#
# The batch shell runs once, on the first node. It sets what is the same on every node, then
# starts ONE srun step with one task per node; that step's text (CLUSTER_STEP below) is a quoted
# heredoc, so everything per node ($SLURM_NODEID, hostname, interface) expands inside the step,
# on each node, never here.
set -uo pipefail

# Identity of this run: every process started below inherits it.
export CLUSTER_RUN_ID=20250101-120000-abcd
export CLUSTER_NNODES="$SLURM_NNODES"
# Restarts so far: a requeued job is the next attempt of the same run.
export CLUSTER_RESTART_COUNT="${SLURM_RESTART_COUNT:-0}"

MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
export MASTER_ADDR
# A requeued attempt gets a port and rendezvous of its own: the last attempt's processes may
# still be shutting down on the first node, holding the old rendezvous store.
export MASTER_PORT=$(( 30057 + ${SLURM_RESTART_COUNT:-0} ))
# Lines reach the output file (and `cluster up`/`cluster logs`) as they are printed.
export PYTHONUNBUFFERED=1

# Secret environment: HF_TOKEN
# Never in this script, nor in the job's environment (which the controller keeps). The launcher
# left the values in a private file (0600, in a 0700 folder beside the output): NAME=value
# records ended by NUL, read here on every attempt (a requeued job needs them again) and taken
# as they are, never as shell text. The job removes the file when its step succeeds; else the
# launcher does once the job has ended.
CLUSTER_SECRETS=/home/u/project/slurm-logs/.20250101-120000-abcd.secrets/env
if [ ! -r "$CLUSTER_SECRETS" ]; then
  echo "cluster: the secret environment's file $CLUSTER_SECRETS is missing or unreadable on ${SLURMD_NODENAME:-the batch node} (removed, or not on a filesystem this node shares); not starting" >&2
  exit 1
fi
while IFS= read -r -d '' cluster_secret; do
  export "${cluster_secret?}"
done < "$CLUSTER_SECRETS"
unset cluster_secret

# The step runs in a container, through pyxis (srun --container-*), image
# nvcr.io/nvidia/pytorch:24.05-py3: the job's working directory at the same path, the user's home not
# mounted; srun hands the task's environment to the container. Pyxis keeps the node's network
# (the interface chosen in the step holds), and the step needs bash in the image.
# container.options (--ulimit stack=67108864) are docker/podman options: not for pyxis.
CLUSTER_MOUNTS=/home/u/project:/home/u/project,/datasets:/datasets:ro,"$HOME"/'ckpt dir':/ckpt:rw+rslave

# The job step, run once on every node by srun. Quoted heredoc: nothing expands here.
read -r -d '' CLUSTER_STEP <<'CLUSTER_STEP_END' || true
set -euo pipefail
export CLUSTER_NODE="$(hostname)"
export CLUSTER_NODE_RANK="$SLURM_NODEID"
# This node's address: the one its name resolves to (never loopback). torchrun advertises it.
NODE_ADDR=$(getent ahostsv4 "$CLUSTER_NODE" 2>/dev/null | awk 'NR == 1 {print $1}') || true
case "$NODE_ADDR" in 127.*) NODE_ADDR="" ;; esac
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
cluster_ifname "$NODE_ADDR" "$MASTER_ADDR"
if [ -n "$IFNAME" ] && [ "$IFNAME" != lo ]; then
  export NCCL_SOCKET_IFNAME="=$IFNAME"
  export GLOO_SOCKET_IFNAME="$IFNAME"
else
  echo "cluster: no interface found for this node's address; NCCL and Gloo will choose one" >&2
fi
if compgen -G '/sys/class/infiniband/*' >/dev/null; then export NCCL_IB_DISABLE=0; else export NCCL_IB_DISABLE=1; fi
PYTHON=$1
shift
# torchrun, as `python -m torch.distributed.run` runs it, with one difference: what is alive
# at its end is frozen for the garbage collector first, so its interpreter's shutdown does not
# scan torch's objects again (0.2 s instead of 0.7 s on each node, at every end and every stop).
CLUSTER_TORCHRUN='import gc, runpy
try:
    runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)
finally:
    gc.freeze()'
# Static rendezvous: node N of the allocation is node N of the group, so srun's labels, the
# logs and CLUSTER_NODE_RANK name the ranks torch gives (c10d would number the nodes by their
# addresses sorted as strings: 10.0.0.11 before 10.0.0.9). SLURM starts every node or none.
exec "$PYTHON" -c "$CLUSTER_TORCHRUN" \
  --nnodes="$SLURM_NNODES" \
  --nproc_per_node=8 \
  --node_rank="$SLURM_NODEID" \
  --master_addr="$MASTER_ADDR" \
  --master_port="$MASTER_PORT" \
  ${NODE_ADDR:+--local_addr="$NODE_ADDR"} \
  "$@"
CLUSTER_STEP_END

# Preemption or the time limit: SLURM sends SIGUSR2 to this shell (B:USR2@90).
# While the job has been restarted fewer than 3 time(s), requeue it: SLURM then
# stops the step itself (SIGTERM to its tasks, SIGKILL after KillWait) and runs the job again;
# the trainer resumes from its newest checkpoint. After the last restart, stop the step
# gracefully instead: SIGTERM to its tasks (torchrun passes it to its workers; not to srun
# itself, which would SIGKILL them).
cluster_on_signal() {
  if [ "${SLURM_RESTART_COUNT:-0}" -lt 3 ]; then
    echo "cluster: requeueing job $SLURM_JOB_ID (restart $(( ${SLURM_RESTART_COUNT:-0} + 1 )) of 3) on SIGUSR2" >&2
    scontrol requeue "$SLURM_JOB_ID" && return
  fi
  echo "cluster: job $SLURM_JOB_ID got SIGUSR2; not requeueing (restarted ${SLURM_RESTART_COUNT:-0} of 3 time(s)); stopping the step (SIGTERM to its tasks)" >&2
  local step stopped=0
  for step in $(squeue -h -s -j "$SLURM_JOB_ID" -o %i 2>/dev/null | grep -E '[.][0-9]+$'); do
    scancel --signal=TERM "$step" && stopped=1
  done
  [ "$stopped" = 1 ] || kill -TERM "$CLUSTER_SRUN" 2>/dev/null || true
}
trap cluster_on_signal USR2

echo "cluster: run $CLUSTER_RUN_ID job $SLURM_JOB_ID on $SLURM_JOB_NODELIST (restart ${SLURM_RESTART_COUNT:-0}), master $MASTER_ADDR:$MASTER_PORT" >&2
srun --kill-on-bad-exit=1 --wait=60 --label --nodes="$SLURM_NNODES" --ntasks="$SLURM_NNODES" --ntasks-per-node=1 \
  --container-image='nvcr.io#nvidia/pytorch:24.05-py3' --container-mounts="$CLUSTER_MOUNTS" \
  --container-workdir=/home/u/project --no-container-mount-home \
  bash -c "$CLUSTER_STEP" cluster-step \
  python \
  train.py \
  --epochs \
  3 &
CLUSTER_SRUN=$!

# A trapped signal interrupts `wait` (status > 128) while srun still runs: wait again.
while :; do
  wait "$CLUSTER_SRUN"
  CLUSTER_RC=$?
  if [ "$CLUSTER_RC" -gt 128 ] && kill -0 "$CLUSTER_SRUN" 2>/dev/null; then
    continue
  fi
  break
done
# The run is over: the secrets' file goes. Only after success: a failed or stopped step may
# belong to an attempt that SLURM requeues, which needs it again (an EXIT trap would also fire
# when a requeue stops this shell with SIGTERM).
if [ "$CLUSTER_RC" = 0 ]; then
  rm -f -- "$CLUSTER_SECRETS"
  rmdir -- "${CLUSTER_SECRETS%/*}" 2>/dev/null
fi
# The follower (`cluster up`, `cluster logs -f`) takes this line as the cue to look the job up.
echo "cluster: job $SLURM_JOB_ID step ended with exit code $CLUSTER_RC" >&2
exit "$CLUSTER_RC"
