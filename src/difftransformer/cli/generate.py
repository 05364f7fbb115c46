"""`difftransformer generate`: continue a prompt with a trained model."""

from __future__ import annotations

import argparse
import sys

import torch

from difftransformer.cli.common import add_renamed_flag, check_device, load_trained, model_tokenizer
from difftransformer.eval import encode_prompt, generate_text, new_token_budget
from difftransformer.run_config import ConfigError

HELP = "generate text from a trained model"
DESCRIPTION = ("Continue a prompt with a trained model: a final/ folder, a run folder (its final/, else "
               "its newest checkpoint) or a checkpoint folder. The tokenizer is final/tokenizer.json, the "
               "run's prepared data, or --tokenizer.")
EXAMPLES = """
    examples:
      difftransformer generate runs/demo/diff "The state of the Union is"
      difftransformer generate runs/demo/transformer/final "My fellow citizens," --temperature 0
      difftransformer generate runs/diff --prompt "Congress must" -n 200 --top-p 0.9 --num-samples 3"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="PATH", help="final/ folder, run folder or checkpoint folder")
    p.add_argument("prompt_pos", nargs="?", metavar="PROMPT", help="prompt text (or use --prompt)")
    p.add_argument("--prompt", help="prompt text (default: empty, i.e. start a new document)")
    p.add_argument("-n", "--max-new-tokens", type=int, default=100, metavar="N", help="tokens to generate (100)")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=None, metavar="K", help="sample from the K most likely tokens")
    p.add_argument("--top-p", type=float, default=None, metavar="P", help="nucleus sampling mass in (0, 1]")
    p.add_argument("--sample-seed", type=int, default=0, metavar="N",
                   help="seed of the sampling (default 0; the samples of one call follow from it)")
    p.add_argument("--num-samples", type=int, default=1, metavar="N", help="independent samples (default 1)")
    p.add_argument("--tokenizer", metavar="FILE", help="tokenizer.json to use instead of the one saved with the model")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    add_renamed_flag(p, "--seed", "--sample-seed", "it seeds the sampling, not training")


def _check_sampling(args: argparse.Namespace) -> None:
    """Settings that would fail mid-generation, or be ignored without a word, are refused or named first."""
    if args.num_samples < 1:
        raise ConfigError(f"--num-samples must be at least 1, got {args.num_samples}")
    if args.max_new_tokens < 0:
        raise ConfigError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if not 0 <= args.temperature < float("inf"):
        raise ConfigError(f"--temperature must be a number >= 0 (0 is greedy), got {args.temperature}")
    if args.top_k is not None and args.top_k < 1:
        raise ConfigError(f"--top-k must be a positive integer, got {args.top_k}")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise ConfigError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.temperature == 0 and (args.top_k is not None or args.top_p is not None):
        print("(--temperature 0 is greedy: --top-k/--top-p have no effect)", file=sys.stderr)
    if args.temperature == 0 and args.num_samples > 1:
        print(f"(--temperature 0 is greedy: the {args.num_samples} samples will be identical)", file=sys.stderr)
    check_device(args.device)
    if not 0 <= args.sample_seed < 2**63:
        raise ConfigError(f"--sample-seed must be in [0, 2**63), got {args.sample_seed}")


def _check_printable(text: str) -> None:
    """Refuse text that standard output cannot encode (PYTHONIOENCODING=ascii and a prompt 'ünï'), naming
    the encoding and the fix, where Python's own codec error names neither. The prompt is checked before
    the model loads, so the refusal comes at once rather than after generating; each sample is checked
    again, as the model may write what the prompt did not."""
    encoding = getattr(sys.stdout, "encoding", None) or "utf-8"
    try:
        text.encode(encoding, getattr(sys.stdout, "errors", None) or "strict")
    except UnicodeEncodeError as e:
        raise ConfigError(f"standard output's encoding ({encoding}) cannot print {e.object[e.start:e.end]!r}; set "
                          f"PYTHONIOENCODING=utf-8 and run again") from None


def run(args: argparse.Namespace) -> int:
    if args.prompt is not None and args.prompt_pos is not None:
        raise ConfigError("give the prompt either as an argument or with --prompt, not both")
    prompt = args.prompt if args.prompt is not None else (args.prompt_pos or "")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError:  # bytes that were not UTF-8 on the command line arrive as surrogates
        raise ConfigError("the prompt is not valid UTF-8 text; pass it as UTF-8") from None
    _check_printable(prompt)
    _check_sampling(args)
    loaded = load_trained(args.model, args.device)
    model, tok = loaded.model, model_tokenizer(args.model, args.tokenizer, loaded)
    if loaded.checkpoint_step is not None:
        print(f"(no final/ model; using {loaded.source})", file=sys.stderr)
    n = new_token_budget(model, encode_prompt(tok, prompt), args.max_new_tokens)
    if n < args.max_new_tokens:
        print(f"(generating {n} tokens: the model's context is {model.config.max_position_embeddings})",
              file=sys.stderr)
    gen = torch.Generator(device=args.device).manual_seed(args.sample_seed)
    for i in range(args.num_samples):
        out = generate_text(model, tok, prompt, n, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            generator=gen, device=args.device)
        if args.num_samples > 1:
            print(f"--- sample {i + 1} ---")
        _check_printable(prompt + out.text)
        print(prompt + out.text)
    return 0
