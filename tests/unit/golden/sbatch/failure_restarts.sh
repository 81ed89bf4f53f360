#!/bin/bash
# shellcheck disable=SC2016,SC2317  # literal $ in quoted values; the trap handler runs on a signal
# cluster run 20250101-120000-abcd: SLURM batch script, 2 node(s), torchrun on each.
# Rendered by `cluster up --backend slurm`; every value below is shell-quoted. Do not edit: re-render.
#SBATCH --chdir=/home/u/project
#SBATCH --exclude=node9
#SBATCH --job-name=cluster-20250101-120000-abcd
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --open-mode=append
#SBATCH --output="/scratch/it's logs/20250101-120000-abcd.out"
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
NPROC=${SLURM_GPUS_ON_NODE:-}
[ -n "$NPROC" ] || NPROC=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU') || true
[ "${NPROC:-0}" -gt 0 ] || NPROC=1
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
  --nproc_per_node="$NPROC" \
  --node_rank="$SLURM_NODEID" \
  --master_addr="$MASTER_ADDR" \
  --master_port="$MASTER_PORT" \
  ${NODE_ADDR:+--local_addr="$NODE_ADDR"} \
  "$@"
CLUSTER_STEP_END

# --- A failed step (--max-restarts 2) -----------------------------------------
# SLURM_RESTART_COUNT counts every requeue, whatever its cause. The failure requeues are the
# lines below that say "after a failed step" in this job's output; the others (a signal, or
# SLURM's own after a node failure) spend max_requeues.
CLUSTER_OUTPUT='/scratch/it'"'"'s logs/20250101-120000-abcd.out'
CLUSTER_FAILURES=$(grep -c '^cluster: requeueing job [0-9]* (restart [0-9]* of [0-9]*) after a failed step' -- "$CLUSTER_OUTPUT" 2>/dev/null) || true
CLUSTER_FAILURES=${CLUSTER_FAILURES:-0}
CLUSTER_REQUEUES=$(( ${SLURM_RESTART_COUNT:-0} - CLUSTER_FAILURES ))
# Where this attempt's lines begin in the output (srun writes its own lines there too).
CLUSTER_FROM=$(wc -c 2>/dev/null < "$CLUSTER_OUTPUT") || CLUSTER_FROM=0

cluster_attempt_output() {
  tail -c +$(( ${CLUSTER_FROM:-0} + 1 )) -- "$CLUSTER_OUTPUT" 2>/dev/null
}

# The node whose task failed first, and how ("node2 task 1: Exited with exit code 3"), from
# srun's own lines (a task's lines carry srun's "N: " label, these none). A task "Terminated"
# is one srun stopped after the first failure (--kill-on-bad-exit): never the cause. Reads all
# of its input (an early end would fail the pipe under pipefail).
cluster_culprit() {
  awk 'found { next }
       /^srun: error: Node failure on / { print $NF, "node failure"; found = 1; next }
       /^srun: error: [^ :]+: tasks? [0-9,-]+: / && !/: Terminated$/ {
         sub(/^srun: error: /, ""); n = index($0, ": ")
         print substr($0, 1, n - 1), substr($0, n + 2); found = 1 }'
}

# Whether torchrun reported a worker that exited with the stop code 93 (its
# "exitcode  : 93" in a task's lines). torchrun itself exits 1, whatever its
# worker's code.
cluster_stop_code() {
  awk '/^ *[0-9]+: .*[( ]exitcode *: 93[ )]/ { found = 1 } END { exit !found }'
}

# The job's excluded nodes with `node` added, when the job can still run without it: it is
# not one the job asked for by name (--nodelist), and the partition keeps enough nodes up.
# Prints the new ExcNodeList; or why not, and fails.
cluster_exclusion() {
  local node=$1 shown old asked new usable
  shown=$(scontrol -o show job "$SLURM_JOB_ID") || { echo "scontrol show job failed"; return 1; }
  old=$(printf '%s\n' "$shown" | grep -o 'ExcNodeList=[^ ]*' | cut -d= -f2)
  asked=$(printf '%s\n' "$shown" | grep -o 'ReqNodeList=[^ ]*' | cut -d= -f2)
  [ "$old" = "(null)" ] && old=""
  if [ -n "$asked" ] && [ "$asked" != "(null)" ] && scontrol show hostnames "$asked" | grep -qxF -- "$node"; then
    echo "it is one the job asks for by name (--nodelist $asked)"
    return 1
  fi
  new=$(scontrol show hostlist "${old:+$old,}$node") || { echo "scontrol show hostlist failed"; return 1; }
  usable=$(sinfo -h -N -r -p "$SLURM_JOB_PARTITION" -t idle,mix,alloc,comp -o %N | sort -u \
    | grep -cvxF -f <(scontrol show hostnames "$new"))
  if [ "${usable:-0}" -lt "$SLURM_NNODES" ]; then
    echo "without $new the partition $SLURM_JOB_PARTITION has ${usable:-0} node(s) up, fewer than the job's $SLURM_NNODES"
    return 1
  fi
  printf '%s\n' "$new"
}

# After a failed step that no signal stopped: the stop code ends the job; else, while failure
# restarts are left, requeue it without the node that failed first. The requeue stops this
# shell with SIGTERM (SIGKILL after KillWait): ignored here, so that the job is held until its
# excluded nodes are updated (ExcNodeList changes only while a job is pending), then released.
cluster_after_failure() {
  local found node how said excluded="" restart
  if cluster_attempt_output | cluster_stop_code; then
    echo "cluster: job $SLURM_JOB_ID: a rank exited with 93, the stop code; not requeueing" >&2
    CLUSTER_RC=93
    return
  fi
  if [ "$CLUSTER_FAILURES" -ge 2 ]; then
    echo "cluster: job $SLURM_JOB_ID step failed (exit code $CLUSTER_RC); not requeueing: $CLUSTER_FAILURES of 2 failure restart(s) spent" >&2
    return
  fi
  found=$(cluster_attempt_output | cluster_culprit)
  node=$(scontrol show hostnames "${found%% *}" 2>/dev/null | head -n1)
  how=${found#* }
  if [ -z "$node" ]; then
    echo "cluster: job $SLURM_JOB_ID: no node's task failed first in srun's lines; excluding none" >&2
  elif said=$(cluster_exclusion "$node"); then
    excluded=$said
    echo "cluster: excluding $node from job $SLURM_JOB_ID's next attempts: its task failed first ($how); excluded nodes now $excluded" >&2
  else
    echo "cluster: not excluding $node (its task failed first: $how): $said" >&2
  fi
  restart=$(( ${SLURM_RESTART_COUNT:-0} + 1 ))
  trap '' TERM
  echo "cluster: requeueing job $SLURM_JOB_ID (restart $restart of $(( 1 + 2 ))) after a failed step (exit code $CLUSTER_RC; failure restart $(( CLUSTER_FAILURES + 1 )) of 2)" >&2
  if [ -z "$excluded" ]; then
    scontrol requeue "$SLURM_JOB_ID" && return
  elif scontrol requeuehold "$SLURM_JOB_ID"; then
    scontrol update JobId="$SLURM_JOB_ID" ExcNodeList="$excluded" \
      || echo "cluster: job $SLURM_JOB_ID: could not exclude $node (scontrol update failed)" >&2
    scontrol release "$SLURM_JOB_ID" && return
    echo "cluster: job $SLURM_JOB_ID is held: release it with scontrol release $SLURM_JOB_ID" >&2
    return
  fi
  echo "cluster: job $SLURM_JOB_ID could not be requeued (scontrol failed)" >&2
}

# Preemption or the time limit: SLURM sends SIGUSR2 to this shell (B:USR2@90).
# While the job has been requeued so (not after a failed step) fewer than 1 time(s), requeue it: SLURM then
# stops the step itself (SIGTERM to its tasks, SIGKILL after KillWait) and runs the job again;
# the trainer resumes from its newest checkpoint. After the last restart, stop the step
# gracefully instead: SIGTERM to its tasks (torchrun passes it to its workers; not to srun
# itself, which would SIGKILL them).
cluster_on_signal() {
  CLUSTER_SIGNALLED=1
  if [ "$CLUSTER_REQUEUES" -lt 1 ]; then
    echo "cluster: requeueing job $SLURM_JOB_ID (restart $(( ${SLURM_RESTART_COUNT:-0} + 1 )) of 3) on SIGUSR2 (requeue $(( CLUSTER_REQUEUES + 1 )) of 1)" >&2
    scontrol requeue "$SLURM_JOB_ID" && return
  fi
  echo "cluster: job $SLURM_JOB_ID got SIGUSR2; not requeueing (requeued $CLUSTER_REQUEUES of 1 time(s)); stopping the step (SIGTERM to its tasks)" >&2
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
[ "$CLUSTER_RC" = 0 ] || [ -n "${CLUSTER_SIGNALLED:-}" ] || cluster_after_failure
# The follower (`cluster up`, `cluster logs -f`) takes this line as the cue to look the job up.
echo "cluster: job $SLURM_JOB_ID step ended with exit code $CLUSTER_RC" >&2
exit "$CLUSTER_RC"
