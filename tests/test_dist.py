"""The one rank helper: rank 0 writes and prints, the answer is the same before and after joining a group."""

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
