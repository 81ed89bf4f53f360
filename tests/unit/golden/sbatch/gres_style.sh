#!/bin/bash
# shellcheck disable=SC2016,SC2317  # literal $ in quoted values; the trap handler runs on a signal
# cluster run 20250101-120000-abcd: SLURM batch script, 4 node(s), torchrun on each.
# Rendered by `cluster up --backend slurm`; every value below is shell-quoted. Do not edit: re-render.
#SBATCH --chdir=/home/u/project
#SBATCH --gres=gpu:4
#SBATCH --job-name=cluster-20250101-120000-abcd
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=1
#SBATCH --open-mode=append
#SBATCH --output=/home/u/project/slurm-logs/20250101-120000-abcd.out
#SBATCH --partition=old
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

# The job step, run once on every node by srun. Quoted heredoc: nothing expands here.
read -r -d '' CLUSTER_STEP <<'CLUSTER_STEP_END' || true
set -euo pipefail
export CLUSTER_NODE="$(hostname)"
export CLUSTER_NODE_RANK="$SLURM_NODEID"
# This node's address: the one its name resolves to (never loopback). torchrun advertises it.
NODE_ADDR=$(getent ahostsv4 "$CLUSTER_NODE" 2>/dev/null | awk 'NR == 1 {print $1}') || true
case "$NODE_ADDR" in 127.*) NODE_ADDR="" ;; esac
export NCCL_SOCKET_IFNAME=ib0
export GLOO_SOCKET_IFNAME=ib0
export NCCL_IB_DISABLE=0
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
  --nproc_per_node=4 \
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
  bash -c "$CLUSTER_STEP" cluster-step \
  /opt/venv/bin/python \
  train.py &
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
# The follower (`cluster up`, `cluster logs -f`) takes this line as the cue to look the job up.
echo "cluster: job $SLURM_JOB_ID step ended with exit code $CLUSTER_RC" >&2
exit "$CLUSTER_RC"
