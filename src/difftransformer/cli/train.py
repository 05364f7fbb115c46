"""`difftransformer train`: one model from a run config and/or a preset (data prepared first if needed)."""

from __future__ import annotations

import argparse
import json

from difftransformer import dist
from difftransformer.cli.common import add_config_args, out_dir, refuse_inside_study
from difftransformer.data import ensure_data
from difftransformer.model import ATTENTION_KINDS
from difftransformer.run_config import load_run_config
from difftransformer.train import RunDir, train

HELP = "train one model (prepares the data first if needed)"
DESCRIPTION = ("Train one model from a config file and/or a preset. The data are prepared first if the "
               "data folder has none. Resumes from the newest checkpoint in the out dir unless --no-resume. "
               "Under torchrun every rank runs this same command (DDP; FSDP with --set train.fsdp=true).")
EXAMPLES = """
    examples:
      difftransformer train --preset cpu-small --attention diff --out-dir runs/diff
      difftransformer train --config configs/cpu-small.toml --set train.lr=6e-4 --set train.max_steps=2000
      difftransformer train --preset tiny --set train.max_steps=50 --set train.seq_len=64
      torchrun --nproc_per_node 8 -m difftransformer train --config configs/gpu-350m.toml
      difftransformer train --init-from retrofitted/smollm2 --set train.trainable=attention --out-dir runs/rf

    config sections: [model] (preset + attention + overrides, or every DiffTransformerConfig field),
    [train] (TrainConfig fields; train.seed is the training seed), [data] (corpus, vocab_size,
    data_dir, val/test fractions, split_seed)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_args(p, "attention kind: " + ", ".join(ATTENTION_KINDS), "[model], [train], [data]")
    p.add_argument("--init-from", metavar="MODEL_DIR",
                   help="start from the weights of this model folder (a run's final/, a `retrofit` or `convert --to "
                        "difftransformer` output) instead of a random init: the model and its tokenizer are the "
                        "folder's, so leave out --preset/--attention and [model] size settings (same as "
                        "train.init_from)")


def run(args: argparse.Namespace) -> int:
    overrides = list(args.overrides)
    if args.init_from is not None:
        if args.preset or args.attention:
            raise ValueError(f"--init-from takes the model from {args.init_from}; drop --preset/--attention")
        named = [o for o in overrides if o.replace(" ", "").startswith("train.init_from=")]
        if named:
            raise ValueError(f"--init-from {args.init_from} and --set {named[-1]} both name the model folder; "
                             f"give it once")
        overrides.append(f"train.init_from={json.dumps(args.init_from)}")
    cfg = load_run_config(args.config, preset=args.preset, attention=args.attention, overrides=overrides)
    if out_dir(args) is not None:
        cfg.train.out_dir = args.out_dir
    refuse_inside_study(cfg.train.out_dir)
    data = ensure_data(cfg.data)
    cfg.resolve_vocab(data.vocab_size)
    result = train(cfg.model, cfg.train, resume=not args.no_resume)
    if dist.is_main():
        val = "n/a" if result.final_val_loss is None else f"{result.final_val_loss:.4f}"
        speed = (f"{result.tokens_per_s:,.0f} train tokens/s" if result.steps_trained else
                 "nothing left to train (raise train.max_steps to go on)")
        final = RunDir(result.out_dir).final
        print(f"done: step {result.final_step}, final val loss {val}, {speed}; weights in {final}")
    return 0
