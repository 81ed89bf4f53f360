#!/usr/bin/env bash
# The checks of a one-GPU machine (an H200): the unit and trainer test tiers, then the
# trainer's throughput under `cluster up --local`, under bare torchrun and as a plain script,
# each against a plain training loop, and the cost of the step timing (heartbeat file set vs
# not). About 7 minutes on an H200: the tests ~3, the figures 5 cases x 2 repeats of ~25 s.
#
#   bench/gpu_check.sh OUT_DIR [WHEELS_DIR]
#
# OUT_DIR gets: env.txt (torch, GPU), pytest.txt, trainer_speed.txt (the table: the ratios
# against the plain loop; target >= 0.98 for cluster up and torchrun), trainer_speed.log (every
# process's output), gpu.csv (clocks, power), summary.txt. WHEELS_DIR: wheels of fabric,
# paramiko and their dependencies, installed (pip --no-index) only when `import fabric` fails.
# PYTHON (default python3) is the python with CUDA torch and torchvision.
set -uo pipefail
[ $# -ge 1 ] || { echo "usage: $0 OUT_DIR [WHEELS_DIR]" >&2; exit 2; }
out=$(mkdir -p "$1" && cd "$1" && pwd) || exit 2
wheels=${2:-}
repo=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-python3}
cd "$repo" || exit 2
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export CLUSTER_TEST_PYTHON=${CLUSTER_TEST_PYTHON:-$(command -v "$py")}

if ! "$py" -c 'import fabric, paramiko' 2>/dev/null; then
  if [ -n "$wheels" ]; then
    "$py" -m pip install --no-index --find-links "$wheels" fabric paramiko >"$out/pip.txt" 2>&1 \
      || { echo "installing fabric from $wheels failed: $out/pip.txt" >&2; exit 1; }
  else
    echo "fabric/paramiko are not importable by $py: pass WHEELS_DIR" >&2; exit 1
  fi
fi
{ "$py" -c 'import torch, torchvision; print("torch", torch.__version__, "cuda", torch.version.cuda,
  "available", torch.cuda.is_available(), torch.cuda.device_count(), "GPU(s)",
  torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-", "torchvision", torchvision.__version__)'
  nvidia-smi; git -C "$repo" log --oneline -1 2>/dev/null; } >"$out/env.txt" 2>&1
head -n 1 "$out/env.txt"

echo "== tests (tests/unit tests/train) -> $out/pytest.txt"
timeout 360 "$py" -m pytest -q -rs tests/unit tests/train >"$out/pytest.txt" 2>&1
tests_rc=$?
tail -n 15 "$out/pytest.txt"

echo "== figures -> $out/trainer_speed.txt"
timeout 360 "$py" bench/trainer_speed.py --groups resnet50,torchrun,cluster,steptime --repeats 2 \
  --steps 300 --warmup 80 --log "$out/trainer_speed.log" --gpu-log "$out/gpu.csv" \
  >"$out/trainer_speed.txt" 2>&1
bench_rc=$?
cat "$out/trainer_speed.txt"

{ echo "tests: exit $tests_rc ($(tail -n 1 "$out/pytest.txt"))"
  echo "figures: exit $bench_rc"
  grep '^|' "$out/trainer_speed.txt"; } >"$out/summary.txt"
echo "== summary ($out/summary.txt)"; cat "$out/summary.txt"
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ]
