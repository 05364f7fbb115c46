"""`difftransformer retrofit LLAMA SRC`: a pretrained Llama-family model (GQA) as a `diff_retrofit` DIFF
model whose logits equal the source's at conversion (convert/llama_retrofit.py; docs/interop.md,
"Retrofit"), ready for continued training with `difftransformer train` (init from OUT_DIR).

LLAMA is a transformers Llama folder (config.json + safetensors) or a .gguf file (dequantised by
transformers; needs the `gguf` extra). The result is our model folder (config.json, model.safetensors and the
source's tokenizer.json when it has one), written complete or not at all, with the source's special-token ids,
generation settings, tokenizer settings and chat template (cli/convert.py's SIDE_FILES; from a .gguf file only the
ids and generation settings transformers reads from it): to transformers and lm-eval the result is the source's model.
`--check N` runs the source and the retrofitted model on N random tokens and prints the max abs logit difference.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from difftransformer.cli.convert import (
    SPECIAL_IDS,
    _check_destination,
    _write_atomically,
    add_special_ids,
    copy_side_files,
    special_ids,
)
from difftransformer.convert import ConversionError, calibrate_head_norm, read_checkpoint, retrofit_llama
from difftransformer.convert.llama_retrofit import SECOND_MAPS
from difftransformer.model import DiffTransformerLM
from difftransformer.train.run_dir import TOKENIZER_FILE

HELP = "turn a pretrained Llama-family model into a DIFF model with the same logits"
DESCRIPTION = ("Retrofit a pretrained Llama (GQA) as attention kind 'diff_retrofit': each source head becomes a "
               "DIFF head whose first map is the source's, a second map weighted by lambda = 0, and a head norm "
               "ramped in from 0 by the trainer, so the logits equal the source's at conversion. See "
               "docs/interop.md, 'Retrofit', for the departures from V1 and the continued-training recipe.")
EXAMPLES = """
    examples:
      difftransformer retrofit hf/llama-folder retrofitted/llama-diff
      difftransformer retrofit path/SmolLM2-135M-Instruct.Q4_1.gguf retrofitted/smollm2 --check 64
      difftransformer retrofit hf/llama-folder out --second-map copy --ramp-steps 500"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", metavar="LLAMA", help="a transformers Llama folder (safetensors) or a .gguf file")
    p.add_argument("dst", metavar="OUT_DIR", help="new folder to write (must not exist, or be empty)")
    p.add_argument("--second-map", choices=SECOND_MAPS, default="uniform",
                   help="how the second map starts: uniform (q2 = 0, k2 = k1) or copy (q2 = q1)")
    p.add_argument("--ramp-steps", type=int, default=1000, metavar="N",
                   help="optimizer steps over which training ramps the head norm in (0: never)")
    p.add_argument("--seed", type=int, default=0, help="seed of the lambda vectors (any seed: lambda = 0)")
    p.add_argument("--calibrate", metavar="TEXT_FILE",
                   help="fit the head-norm weight on this text (encoded with the source's tokenizer) so that ramping "
                        "the norm in changes little; the function at conversion is unchanged (recommended)")
    p.add_argument("--calibrate-tokens", type=int, default=4096, metavar="N",
                   help="how many tokens of --calibrate to use, in windows of 256 (default 4096)")
    p.add_argument("--check", type=int, default=0, metavar="N",
                   help="compare the logits of source and result on N random tokens (needs transformers)")


def run(args: argparse.Namespace) -> int:
    src, dst = Path(args.src), Path(args.dst)
    _check_destination(src, dst)
    if args.ramp_steps < 0:
        raise ConversionError(f"--ramp-steps must be >= 0 (0: no ramp), got {args.ramp_steps}")
    if args.check < 0:
        raise ConversionError(f"--check must be >= 0 (random tokens to compare; 0: no check), got {args.check}")
    if args.calibrate_tokens < 1:
        raise ConversionError(f"--calibrate-tokens must be a positive number of tokens, got {args.calibrate_tokens}")
    source, tokenizer = None, None
    t0 = time.perf_counter()
    if src.suffix == ".gguf":  # transformers dequantises it; there is no file to read the tensors from
        source = _hf_load().load_llama_model(src)
        state, config, tokenizer = _hf_load().load_llama(src, source)
    else:  # the file's own tensors and dtype, with or without --check
        ckpt = read_checkpoint(src)
        if ckpt.format != "llama":
            raise ConversionError(f"{src} holds a {ckpt.format!r} checkpoint; retrofit takes a transformers Llama "
                                  f"folder or a .gguf file")
        state, config = ckpt.state, ckpt.config
        if (src / TOKENIZER_FILE).is_file():
            tokenizer = _source_tokenizer(src / TOKENIZER_FILE)
        if args.check:  # the reference model for the logits comparison only
            source = _hf_load().load_llama_model(src)
    loaded = time.perf_counter() - t0
    ours, cfg = retrofit_llama(state, config, second_map=args.second_map, head_norm_ramp_steps=args.ramp_steps,
                               seed=args.seed)
    if args.check > cfg.max_position_embeddings:
        raise ConversionError(f"--check {args.check} is longer than the model's context ({cfg.max_position_embeddings} "
                              f"tokens, max_position_embeddings); use --check <= {cfg.max_position_embeddings}")
    model = DiffTransformerLM(cfg)
    model.load_state_dict(ours, strict=True)
    del ours
    if args.calibrate:
        ids = _calibration_ids(Path(args.calibrate), tokenizer, args.calibrate_tokens,
                               min(256, cfg.max_position_embeddings))
        means = calibrate_head_norm(model.eval(), ids)
        print(f"head-norm weight fitted on {args.calibrate}: mean per layer {min(means):.3g} .. {max(means):.3g}")

    ids = _gguf_special_ids(source) if src.suffix == ".gguf" else special_ids(src)

    def write(folder: Path) -> None:
        model.save_pretrained(folder)
        add_special_ids(folder, ids)
        if tokenizer is not None:
            (folder / TOKENIZER_FILE).write_text(tokenizer)
        if src.suffix == ".gguf":
            source.generation_config.save_pretrained(folder)
        else:
            copy_side_files(src, folder)

    _write_atomically(dst, write)
    params = model.num_parameters()
    print(f"retrofitted {src} to {dst}: attention 'diff_retrofit', {cfg.num_hidden_layers} layers, "
          f"{cfg.num_attention_heads} DIFF heads / {cfg.num_key_value_heads} kv groups of d = {cfg.head_dim}, "
          f"{params:,} parameters (loaded in {loaded:.0f} s)")
    if args.check:
        ids = torch.randint(0, cfg.vocab_size, (1, args.check), generator=torch.Generator().manual_seed(0))
        model = DiffTransformerLM.from_pretrained(dst)
        with torch.no_grad():
            diff = (model(ids).logits - source(ids).logits).abs().max().item()
        print(f"max abs logit difference on {args.check} random tokens: {diff:.3g}")
    return 0


def _gguf_special_ids(source) -> dict:
    """The special-token ids transformers read from a .gguf file into its model's config."""
    return {k: getattr(source.config, k) for k in SPECIAL_IDS if getattr(source.config, k, None) is not None}


def _source_tokenizer(path: Path) -> str:
    """The text of the source's tokenizer.json, checked to be a tokenizers file: a damaged one is refused
    here, naming it, rather than failing later with tokenizers' bare Exception or a codec error that names
    no file (--calibrate), or being copied into OUT where only `train --init-from OUT` would find it."""
    from tokenizers import Tokenizer

    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConversionError(f"{path} is not a tokenizer.json file (not UTF-8 text: byte 0x{e.object[e.start]:02x} "
                              f"at offset {e.start}); restore the model's own tokenizer.json") from None
    try:
        Tokenizer.from_str(text)
    except Exception as e:  # tokenizers raises a bare Exception for a JSON or schema error
        raise ConversionError(f"{path} is not a tokenizer.json file ({e}); restore the model's own "
                              f"tokenizer.json") from None
    return text


def _calibration_ids(path: Path, tokenizer: str | None, tokens: int, window: int) -> torch.Tensor:
    """The first `tokens` tokens of the text file `path` (source tokenizer) as windows: (N, window)."""
    from tokenizers import Tokenizer

    if tokenizer is None:
        raise ConversionError("--calibrate needs the source's tokenizer (a tokenizer.json beside its config.json, or "
                              "the vocabulary a .gguf file carries); this source has none")
    if path.is_dir():
        raise ConversionError(f"--calibrate {path} is a folder; give one text file (e.g. {path}/FILE.txt)")
    if not path.is_file():
        raise ConversionError(f"--calibrate {path}: no such text file")
    if tokens < window:
        raise ConversionError(f"--calibrate-tokens {tokens} is less than one calibration window of {window} tokens; "
                              f"use --calibrate-tokens >= {window}")
    ids = Tokenizer.from_str(tokenizer).encode(path.read_text(errors="replace")).ids[:tokens]
    n = len(ids) // window * window
    if n == 0:
        raise ConversionError(f"--calibrate {path} has {len(ids)} tokens; it needs at least {window} (one window)")
    return torch.tensor(ids[:n], dtype=torch.long).view(-1, window)


def _hf_load():
    try:
        from difftransformer.hf import load
    except ImportError:
        raise ConversionError("reading a .gguf file or --check needs transformers: pip install 'difftransformer[hf]'"
                              ) from None
    return load
