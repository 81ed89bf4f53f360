"""A rendered container node script run for real with bash, through a fake runtime on PATH
(fake_runtime.py, installed as `podman` or `docker`) and a stand-in torchrun inside the
"image" (a `torch.distributed.run` module found first on the image's PYTHONPATH). What the
stand-in writes tells what reached the program; the fake's call log tells what the runtime
was given (its arguments, its environment)."""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from cluster.spec import Container, Host, Inventory, Mount, Network
from cluster.plan import Job, NodePlan, Templates, render

FAKE_RUNTIME = Path(__file__).with_name("fake_runtime.py")
IMAGE = "fake.example/train:1"

# The stand-in torchrun. STUB_MODE=exit: record and end; sleep: record, then count TERMs in
# STUB_OUT.term and end a moment after the first one.
STUB = '''
import json, os, signal, sys, time
out = os.environ["STUB_OUT"]
with open(out, "w") as f:
    json.dump({"argv": sys.argv[1:], "env": dict(os.environ), "cwd": os.getcwd(),
               "stdin": os.readlink("/proc/self/fd/0")}, f)
if os.environ.get("STUB_MODE") == "sleep":
    terms = []
    def on_term(signum, frame):
        terms.append(signum)
        with open(out + ".term", "w") as f:
            f.write(str(len(terms)))
    signal.signal(signal.SIGTERM, on_term)
    deadline = None
    while True:
        time.sleep(0.05)
        if terms and deadline is None:
            deadline = time.time() + 0.3
        if deadline and time.time() > deadline:
            sys.exit(0)
'''


@dataclass
class FakeBox:
    root: Path
    runtime: str = "podman"

    def __post_init__(self) -> None:
        self.bin = self.root / "bin"
        self.state = self.root / "runtime-state"
        self.image_lib = self.root / "image-lib"
        for d in (self.bin, self.state, self.image_lib / "torch" / "distributed"):
            d.mkdir(parents=True, exist_ok=True)
        (self.bin / self.runtime).symlink_to(FAKE_RUNTIME)
        FAKE_RUNTIME.chmod(0o755)
        (self.image_lib / "torch" / "__init__.py").write_text("")
        (self.image_lib / "torch" / "distributed" / "__init__.py").write_text("")
        (self.image_lib / "torch" / "distributed" / "run.py").write_text(STUB)
        self.out = self.root / "received.json"

    def host(self, workdir: Path, env: dict[str, str] | None = None, secret_env: tuple[str, ...] = (),
             mounts: tuple[Mount, ...] = (), options: tuple[str, ...] = (),
             python: str = sys.executable) -> Host:
        box = Container(image=IMAGE, runtime=self.runtime, python=python, mounts=mounts,
                        options=options)
        return Host(name="n1", address="127.0.0.1", workdir=str(workdir), python=sys.executable,
                    nproc_per_node=1, network=Network(ifname="lo", ib="off"),
                    env=tuple((env or {}).items()), secret_env=secret_env, container=box)

    def node(self, host: Host, job: Job) -> NodePlan:
        return render(Inventory(hosts=(host,)), job, Templates()).nodes[0]

    def env(self, mode: str = "exit") -> dict[str, str]:
        """The environment a node's shell needs for the fake: PATH first, the fake's state,
        and what the "image" holds (its PYTHONPATH, where the stand-in writes)."""
        image_env = "\n".join([f"PYTHONPATH={self.image_lib}", f"STUB_OUT={self.out}",
                               f"STUB_MODE={mode}"])
        return {"PATH": f"{self.bin}:{os.environ['PATH']}", "HOME": str(self.root),
                "FAKE_RUNTIME_DIR": str(self.state), "FAKE_RUNTIME_IMAGES": IMAGE,
                "FAKE_RUNTIME_IMAGE_ENV": image_env}

    def calls(self, verb: str | None = None) -> list[dict]:
        path = self.state / "calls.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        calls = [json.loads(line) for line in lines]
        return [c for c in calls if verb is None or c["argv"][:1] == [verb]]

    def received(self) -> dict:
        return json.loads(self.out.read_text())
