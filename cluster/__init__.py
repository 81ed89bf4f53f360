"""cluster: launch PyTorch distributed training on many machines at once.

The Python API (cluster.up, cluster.Run, cluster.Request) lives in cluster.api, imported on
first use so that `import cluster` and the command line stay quick."""
from typing import Any

__version__ = "0.1.0"
__all__ = ["up", "Run", "Request", "__version__"]


def __getattr__(name: str) -> Any:
    if name in ("up", "Run", "Request"):
        from . import api
        return getattr(api, name)
    raise AttributeError(f"module 'cluster' has no attribute {name!r}")
