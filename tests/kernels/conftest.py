"""The fused C++ CPU kernel's test modules share one check that it is built."""

import pytest

from difftransformer.kernels import flash_cpu
from tests.helpers import CPP_KERNEL_DISABLED


@pytest.fixture(scope="module")
def cpp_extension():
    """Skip where the kernel is disabled on purpose; fail where it should build and did not."""
    if CPP_KERNEL_DISABLED:
        pytest.skip("DIFFTRANSFORMER_DISABLE_CPU_KERNEL=1")
    if not flash_cpu.is_available():
        pytest.fail(f"the C++ kernel did not build: {flash_cpu.build_error()}; "
                    "set DIFFTRANSFORMER_DISABLE_CPU_KERNEL=1 on a machine without a C++ compiler")
