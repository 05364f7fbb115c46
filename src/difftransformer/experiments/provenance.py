"""What a number was measured on and with: the machine and the command line, recorded with every study."""

from __future__ import annotations

import os
import platform
import shlex
import sys
from pathlib import Path
from typing import Any

import torch

from difftransformer import dist


def hardware() -> dict[str, Any]:
    """The machine a study ran on: tokens/s means little without it."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info: dict[str, Any] = {"cpu": cpu, "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                            "torch": torch.__version__, "python": platform.python_version(),
                            "platform": platform.platform(), "world_size": dist.world_size()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_count"] = torch.cuda.device_count()
    return info


def invocation() -> str:
    """The command line as the user typed it (console script or python -m), for the report."""
    prog = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "difftransformer"
    prog = "python -m difftransformer" if prog in ("__main__.py", "-m", "") else prog
    torchrun = dist.world_size() != 1
    return ("torchrun ... " if torchrun else "") + " ".join([prog, *map(shlex.quote, sys.argv[1:])])
