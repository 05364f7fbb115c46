"""Session set-up shared by every test module.

Triton decides at import time whether kernels run in its CPU interpreter, and several modules
import it indirectly (torch.compile does), so the switch must be set before any test module loads.
"""

import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(__file__))  # tests import the float64 reference as `reference`

# The fused C++ kernel must build wherever the suite runs, unless it is switched off on purpose
# (a machine without a C++ compiler): then its tests are left out instead of failing.
CPP_KERNEL_DISABLED = os.environ.get("DIFFTRANSFORMER_DISABLE_CPU_KERNEL", "0") == "1"
