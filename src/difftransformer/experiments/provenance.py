"""What a number was measured on and with: the machine and the command line, recorded with every study.

`hardware()` is the one description of the machine: studies record it in their manifest and result
files, and the benchmarks print it in one line (benchmarks/common.machine)."""

from __future__ import annotations

import os
import platform
import shlex
import sys
from pathlib import Path
from typing import Any

import torch

from difftransformer import dist
from difftransformer.numerics import denormals_mode


def hardware(device: torch.device | None = None) -> dict[str, Any]:
    """The machine a number was measured on (tokens/s means little without it): the CPU's model, cores and
    torch threads, whether subnormal floats are flushed on CPU (difftransformer.numerics: where they are
    kept, a converged model's step can take 10x as long), the torch and Python versions, the platform and
    the world size; with a GPU visible also the GPU's name (`device`'s, default the first GPU), the GPU
    count and the CUDA version."""
    info: dict[str, Any] = {"cpu": _cpu_model(), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                            "denormals": denormals_mode(),
                            "torch": torch.__version__, "python": platform.python_version(),
                            "platform": platform.platform(), "world_size": dist.world_size()}
    if torch.cuda.is_available():
        gpu = device if device is not None and device.type == "cuda" else 0
        info["gpu"] = torch.cuda.get_device_name(gpu)
        info["gpu_count"] = torch.cuda.device_count()
        info["cuda"] = torch.version.cuda
    return info


def _cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux), else what the platform module says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def invocation() -> str:
    """The command line as the user typed it (console script or python -m), for the report."""
    prog = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "difftransformer"
    prog = "python -m difftransformer" if prog in ("__main__.py", "-m", "") else prog
    torchrun = dist.world_size() != 1
    return ("torchrun ... " if torchrun else "") + " ".join([prog, *map(shlex.quote, sys.argv[1:])])
