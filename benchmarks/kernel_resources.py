"""Compile the fused Triton kernel for a GPU this machine does not have and print ptxas's resource report.

The code lives in the package (difftransformer.kernels.resources), where the tests use it too:

    python benchmarks/kernel_resources.py --arch 80 --head-dims 32,64,96,128
    python -m difftransformer.kernels.resources --help
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))

from difftransformer.kernels.resources import main  # noqa: E402

if __name__ == "__main__":
    main()
