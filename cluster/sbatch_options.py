"""The #SBATCH options cluster writes itself, so that `slurm.extra` may not hold them.

They belong to the sbatch render (cluster.sbatch); they sit here, below the inventory, so that
the inventory can refuse them at load with the file's line.
"""
from __future__ import annotations

import re

# Ones cluster writes itself (None), or ones that change what it renders, set with a slurm
# setting of their own (its name).
SBATCH_OWNED: dict[str, str | None] = {
    "chdir": None, "output": None, "error": None, "open-mode": None, "ntasks": None,
    "ntasks-per-node": None, "array": None, "wrap": None, "hetjob": None, "packjob": None,
    "export": None, "parsable": None, "wait": None, "test-only": None,
    "signal": "signal", "requeue": "max_requeues", "no-requeue": "max_requeues",
    "nodes": "nodes", "gpus-per-node": "gpus_per_node", "gres": "gpus_per_node",
    "cpus-per-task": "cpus_per_task"}
# Options that are also a slurm setting, passed through as they are: one of the two, not both.
SBATCH_ALIASES = {"time": "time", "partition": "partition", "account": "account",
                  "constraint": "constraint", "job-name": "job_name"}
SBATCH_KEY = re.compile(r"^[a-z][a-z0-9-]*\Z")    # the long option without its dashes
