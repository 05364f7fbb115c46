"""Two processes (DDP and FSDP2 on gloo) train exactly what one process trains."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from difftransformer.model import DiffTransformerLM
from difftransformer.train import TrainConfig, load_checkpoint, read_metrics, train
from tests.helpers import make_cfg, tiny


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ddp_worker(rank: int, world_size: int, port: int, cfg_dicts: list[dict], model_dict: dict) -> None:
    """Runs each config in turn (a later one resumes the earlier one's checkpoint)."""
    from difftransformer.model import DiffTransformerConfig

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    for cfg_dict in cfg_dicts:
        train(DiffTransformerConfig.from_dict(model_dict), TrainConfig.from_dict(cfg_dict))


@pytest.mark.parametrize("fsdp, trainable", [(False, "all"), (True, "all"), (False, "attention"), (True, "attention")],
                         ids=["ddp", "fsdp2", "ddp-attention-only", "fsdp2-attention-only"])
def test_two_processes_match_one(data_dir, tmp_path, fsdp, trainable):
    """DDP, or FSDP2 trained to step 2 then resumed to 4 (sharded save and load), equals 1 process; also
    with only the attention tensors trainable (frozen parameters inside the wrapped model)."""
    one = train(tiny(), make_cfg(data_dir, tmp_path / "one", max_steps=4, ckpt_interval=4, eval_interval=2,
                                 trainable=trainable))
    cfg2 = make_cfg(data_dir, tmp_path / "two", max_steps=4, ckpt_interval=2, eval_interval=2, fsdp=fsdp,
                    trainable=trainable)
    runs = [cfg2.to_dict()]
    if fsdp:
        runs.insert(0, {**cfg2.to_dict(), "max_steps": 2})  # warmup covers steps 1-2: the same LRs
    mp.spawn(_ddp_worker, args=(2, _free_port(), runs, tiny().to_dict()), nprocs=2, join=True)
    l1, l2 = read_metrics(one.metrics_path), read_metrics(tmp_path / "two" / "metrics.jsonl")
    assert [(r["kind"], r["step"]) for r in l1] == [(r["kind"], r["step"]) for r in l2]
    for a, b in zip(l1, l2):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5), (a, b)
        if a["kind"] == "train":  # λ of sharded (FSDP) vectors is gathered: the same as one process logs
            assert b["lambdas"] == pytest.approx(a["lambdas"], abs=1e-5) and b["lambda_inits"] == a["lambda_inits"]
    two = DiffTransformerLM.from_pretrained(tmp_path / "two" / "final")
    for pa, pb in zip(one.model.parameters(), two.parameters()):
        assert torch.allclose(pa, pb, atol=1e-5)
    if trainable == "attention":  # the frozen tensors are exactly the initial ones in both
        torch.manual_seed(0)
        start = DiffTransformerLM(tiny()).state_dict()
        frozen = [k for k in start if ".self_attn." not in k]
        assert frozen and all(torch.equal(start[k], two.state_dict()[k]) for k in frozen)
    assert load_checkpoint(tmp_path / "two")["state"]["world_size"] == 2


def test_two_processes_match_one_on_a_synthetic_task(tmp_path):
    """A task scores answers only and the ranks' micro-batches hold different numbers of them: two processes (FSDP2,
    accumulating over two micro-batches each) still train on the mean over every answer of the global batch, as
    one process does."""
    from difftransformer.data.ood import FlipFlop
    from difftransformer.data.prepare import prepare_task

    family = FlipFlop(min_instructions=4, max_instructions=12)
    data = str(prepare_task(family, tmp_path / "data").out_dir)
    model = tiny(vocab_size=family.vocab_size, max_position_embeddings=64)
    one = train(model, make_cfg(data, tmp_path / "one", max_steps=4, ckpt_interval=4, eval_interval=2))
    cfg2 = make_cfg(data, tmp_path / "two", max_steps=4, ckpt_interval=4, eval_interval=2, fsdp=True,
                    grad_accum_steps=2)
    mp.spawn(_ddp_worker, args=(2, _free_port(), [cfg2.to_dict()], model.to_dict()), nprocs=2, join=True)
    for a, b in zip(read_metrics(one.metrics_path), read_metrics(tmp_path / "two" / "metrics.jsonl"), strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5), (a, b)
    two = DiffTransformerLM.from_pretrained(tmp_path / "two" / "final")
    for pa, pb in zip(one.model.parameters(), two.parameters()):
        assert torch.allclose(pa, pb, atol=1e-5)


def test_the_process_group_waits_as_long_as_the_config_says(monkeypatch):
    """Rank 0 may write a large checkpoint or evaluate a study's units while the other ranks wait at a collective:
    the group is made with the config's dist_timeout_min, not the backend's default (10 min NCCL, 30 min gloo)."""
    import datetime

    from difftransformer.train import distributed

    made = {}
    monkeypatch.setattr(distributed.dist, "init_process_group", lambda **kw: made.update(kw))
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(distributed.atexit, "register", lambda f: None)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    distributed.init_distributed("cpu", TrainConfig(dist_timeout_min=90).dist_timeout_min)
    assert made["backend"] == "gloo" and made["timeout"] == datetime.timedelta(minutes=90)
    assert TrainConfig().dist_timeout_min == 240


def _gather_worker(rank: int, world_size: int, port: int, model_dict: dict, out: str) -> None:
    """Records what each rank holds of the checkpoint gathers under FSDP after one optimizer step."""
    import json

    from difftransformer.model import DiffTransformerConfig
    from difftransformer.train.distributed import (
        full_model_state,
        full_optimizer_state_by_name,
        init_distributed,
        wrap_model,
    )
    from difftransformer.train.optim import build_optimizer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    env = init_distributed("cpu", 240)
    torch.manual_seed(0)
    model = DiffTransformerLM(DiffTransformerConfig.from_dict(model_dict))
    wrapped = wrap_model(model, env, fsdp=True)
    optimizer = build_optimizer(model, TrainConfig())
    ids = torch.randint(0, 64, (2, 16))
    wrapped(ids, ids).loss.backward()
    optimizer.step()
    state = full_model_state(model, fsdp=True, rank0_only=True)
    optim = full_optimizer_state_by_name(model, optimizer, fsdp=True)
    held = {"model": len(state), "optimizer": len(optim.get("state", {})),
            "devices": sorted({str(t.device) for t in state.values()}),
            "plain": all(type(t) is torch.Tensor for t in state.values())}
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(held, f)


def test_an_fsdp_checkpoint_is_gathered_on_rank_0_only(tmp_path):
    """Under FSDP a checkpoint's full model and optimizer state are gathered into rank 0's host memory alone (the
    one that writes it): no other rank holds the whole model or its Adam moments beside its shards."""
    import json

    mp.spawn(_gather_worker, args=(2, _free_port(), tiny().to_dict(), str(tmp_path)), nprocs=2, join=True)
    zero, one = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert zero["model"] == len(DiffTransformerLM(tiny()).state_dict()) and zero["optimizer"] > 0
    assert zero["devices"] == ["cpu"] and zero["plain"]
    assert one["model"] == 0 and one["optimizer"] == 0


def _final_worker(rank: int, world_size: int, port: int, cfg_dict: dict, model_dict: dict, out: str) -> None:
    """Records what each rank holds of the final model train() returns under FSDP."""
    import json

    from difftransformer.model import DiffTransformerConfig

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    model = train(DiffTransformerConfig.from_dict(model_dict), TrainConfig.from_dict(cfg_dict)).model
    held = None if model is None else {
        "devices": sorted({str(t.device) for t in model.state_dict().values()}),
        "plain": type(model) is DiffTransformerLM and all(type(p) is torch.nn.Parameter for p in model.parameters()),
        "weights": {k: v.tolist() for k, v in model.state_dict().items()}}
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(held, f)


def test_the_final_fsdp_model_is_gathered_on_rank_0_only(data_dir, tmp_path):
    """Writing final/ under FSDP gathers the whole model into rank 0's host memory alone, as a checkpoint does:
    train() returns it there (the weights final/ holds) and None on the other ranks."""
    import json

    cfg = make_cfg(data_dir, tmp_path / "run", max_steps=2, ckpt_interval=2, eval_interval=2, fsdp=True)
    mp.spawn(_final_worker, args=(2, _free_port(), cfg.to_dict(), tiny().to_dict(), str(tmp_path)), nprocs=2,
             join=True)
    zero, one = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert one is None and zero["devices"] == ["cpu"] and zero["plain"]
    saved = DiffTransformerLM.from_pretrained(tmp_path / "run" / "final").state_dict()
    assert zero["weights"].keys() == saved.keys()
    assert all(torch.equal(torch.tensor(zero["weights"][k], dtype=v.dtype), v) for k, v in saved.items())
