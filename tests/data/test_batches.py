"""Batches as a pure function of (seed, step), rank slices, and in-order evaluation windows."""

import numpy as np
import pytest
import torch

from difftransformer.data import BatchSampler, Document, TokenDataset, iter_eval_batches, num_eval_windows, write_shard


@pytest.fixture()
def seq_tokens() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 60_000, size=5_000).astype(np.uint16)


def test_batch_sampler_deterministic_windows(seq_tokens):
    s = BatchSampler(seq_tokens, batch_size=8, seq_len=32, seed=5)
    x, y = s.batch(7)
    assert x.shape == y.shape == (8, 32) and x.dtype == y.dtype == torch.int64
    x2, y2 = BatchSampler(seq_tokens, batch_size=8, seq_len=32, seed=5).batch(7)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert not torch.equal(x, s.batch(8)[0])
    assert not torch.equal(x, BatchSampler(seq_tokens, 8, 32, seed=6).batch(7)[0])
    for row_x, row_y, off in zip(x, y, s.offsets(7)):
        window = torch.from_numpy(seq_tokens[off : off + 33].astype(np.int64))
        assert torch.equal(row_x, window[:-1]) and torch.equal(row_y, window[1:])
    np.testing.assert_array_equal(s.offsets(7), np.random.default_rng([5, 7]).integers(0, 5_000 - 32, size=8))
    first_two = [b for _, b in zip(range(2), s)]
    assert torch.equal(first_two[1][0], s.batch(1)[0])


def test_batch_sampler_reaches_last_window():
    tokens = np.arange(11, dtype=np.uint16)  # exactly one window of seq_len + 1 = 11 tokens
    x, y = BatchSampler(tokens, batch_size=4, seq_len=10).batch(0)
    assert (x == torch.arange(10)).all() and (y == torch.arange(1, 11)).all()


@pytest.mark.parametrize("world_size", [2, 4])
def test_rank_slices_equal_global_batch(seq_tokens, world_size):
    s = BatchSampler(seq_tokens, batch_size=8, seq_len=16, seed=1)
    for step in (0, 3, 1000):
        gx, gy = s.batch(step)
        parts = [s.batch(step, rank=r, world_size=world_size) for r in range(world_size)]
        assert all(p[0].shape == (8 // world_size, 16) for p in parts)
        assert torch.equal(torch.cat([p[0] for p in parts]), gx) and torch.equal(torch.cat([p[1] for p in parts]), gy)


def test_batch_errors(seq_tokens, tok, tmp_path):
    s = BatchSampler(seq_tokens, batch_size=6, seq_len=16)
    with pytest.raises(ValueError, match="batch_size 6 is not divisible by world_size 4"):
        s.batch(0, rank=0, world_size=4)
    with pytest.raises(ValueError, match="need 0 <= rank < world_size"):
        s.batch(0, rank=2, world_size=2)
    write_shard(tmp_path / "val", [Document("a", "the of")], tok, split="val")
    small = TokenDataset(tmp_path / "val")
    pattern = rf"split 'val' has {small.num_tokens} tokens, fewer than seq_len \+ 1 = 65.*smaller seq_len or more data"
    with pytest.raises(ValueError, match=pattern):
        BatchSampler(small, batch_size=2, seq_len=64)
    with pytest.raises(ValueError, match=pattern + ": a larger val/test fraction"):
        next(iter_eval_batches(small, 2, 64))
    write_shard(tmp_path / "train", [Document("a", "the of")], tok, split="train")
    with pytest.raises(ValueError, match="smaller val/test fractions \\(they take documents from train\\)"):
        BatchSampler(TokenDataset(tmp_path / "train"), batch_size=2, seq_len=64)


def test_eval_batches_cover_in_order_without_overlap(seq_tokens):
    L, B = 48, 7
    n_windows = num_eval_windows(seq_tokens, L)
    assert n_windows == (5_000 - 1) // L
    batches = list(iter_eval_batches(seq_tokens, B, L))
    assert len(batches) == -(-n_windows // B) and batches[-1][0].shape[0] == (n_windows % B or B)
    xs = torch.cat([b[0] for b in batches]).flatten()
    ys = torch.cat([b[1] for b in batches]).flatten()
    expected = torch.from_numpy(seq_tokens.astype(np.int64))
    assert torch.equal(xs, expected[: n_windows * L]) and torch.equal(ys, expected[1 : n_windows * L + 1])
    assert len(list(iter_eval_batches(seq_tokens, B, L, max_batches=3))) == 3
    assert [torch.equal(a[0], b[0]) for a, b in zip(iter_eval_batches(seq_tokens, B, L), batches)] == [True] * len(
        batches
    )


def test_eval_batches_split_across_ranks(seq_tokens):
    whole = list(iter_eval_batches(seq_tokens, 4, 32, max_batches=10))
    r0 = list(iter_eval_batches(seq_tokens, 4, 32, max_batches=10, rank=0, world_size=3))
    r1 = list(iter_eval_batches(seq_tokens, 4, 32, max_batches=10, rank=1, world_size=3))
    r2 = list(iter_eval_batches(seq_tokens, 4, 32, max_batches=10, rank=2, world_size=3))
    assert (len(r0), len(r1), len(r2)) == (4, 3, 3)
    for i, b in enumerate(whole):
        assert torch.equal([r0, r1, r2][i % 3][i // 3][0], b[0])
