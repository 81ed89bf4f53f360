"""An installed wheel (not the checkout) finds its templates, supervisor and trainer."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_wheel_carries_templates_supervisor_and_trainer(tmp_path: Path) -> None:
    wheels, site, work = tmp_path / "wheels", tmp_path / "site", tmp_path / "work"
    work.mkdir()
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    str(REPO), "-w", str(wheels)], check=True, cwd=tmp_path)
    (wheel,) = wheels.glob("cluster-*.whl")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site),
                    str(wheel)], check=True)
    env = dict(os.environ, PYTHONPATH=str(site), CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, "-m", "cluster", "up", "--local", "--dry-run"], cwd=work,
                         env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert f"{site}/cluster/train/train.py" in out.stdout
    probe = subprocess.run([sys.executable, "-c", "import cluster.backends.supervised as s; "
                            "print(s.SUPERVISOR, s.SUPERVISOR.exists())"], cwd=work, env=env,
                           capture_output=True, text=True)
    assert probe.stdout.strip() == f"{site}/cluster/remote/supervisor.py True"
