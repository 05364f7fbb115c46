"""The one rank helper: rank 0 writes and prints, the answer is the same before and after joining a group."""

import pytest

from difftransformer import dist


def test_rank_and_world_size_come_from_torchrun_before_a_group_exists(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert (dist.rank(), dist.world_size(), dist.local_rank(), dist.is_main()) == (0, 1, 0, True)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert (dist.rank(), dist.world_size(), dist.local_rank(), dist.is_main()) == (3, 4, 3, False)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert dist.local_rank() == 1


def test_full_tensor_passes_plain_tensors_and_gathers_shards():
    import torch

    t = torch.arange(3.0)
    assert dist.full_tensor(t) is t

    class Shard:
        def full_tensor(self):
            return "gathered"

    assert dist.full_tensor(Shard()) == "gathered"


@pytest.mark.parametrize("name", ["cpu", "cuda", "cuda:0", "cuda:12"])
def test_device_names_this_package_runs_on(name):
    assert dist.is_device_name(name) and dist.is_device_name(name, auto=True)


@pytest.mark.parametrize("name", ["tpu", "CPU", "cuda:", "cuda:x", "cuda:0 ", " cpu", "cpu\n", "mps", "", None, 0])
def test_other_device_names_are_refused(name):
    assert not dist.is_device_name(name) and not dist.is_device_name(name, auto=True)


def test_auto_is_a_device_name_only_where_allowed():
    assert dist.is_device_name("auto", auto=True) and not dist.is_device_name("auto")
