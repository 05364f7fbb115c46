"""Fixtures of the transformers integration's tests: which of the wrapper's two paths a test runs."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """The integration's tests run width-32 models, whose products gain nothing from a second thread and, on a
    busy machine, wait for it at every operation: one intra-op thread for each test, restored after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def fast(monkeypatch) -> None:
    """The wrapper's fast paths on (hf/compat.py), whatever transformers is installed: a test that holds a fast path
    to transformers' public one then fails the day a release changes an internal the fast path uses."""
    pytest.importorskip("transformers")
    from difftransformer.hf import compat

    monkeypatch.setattr(compat, "FAST", True)


@pytest.fixture(params=["fast", "public"])
def path(request, monkeypatch) -> str:
    """Each wrapper path in turn: the fast paths, then transformers' public ones (what an untested release runs)."""
    pytest.importorskip("transformers")
    from difftransformer.hf import compat

    monkeypatch.setattr(compat, "FAST", request.param == "fast")
    return request.param
