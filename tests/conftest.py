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
