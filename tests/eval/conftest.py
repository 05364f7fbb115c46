"""Fixtures of the evaluation tests (shared helpers live in tests/helpers.py)."""

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a shared CPU they lose a lot to spinning."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
