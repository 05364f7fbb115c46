"""lm-evaluation-harness (`lm_eval`) on our checkpoints, through its own `hf` model, offline.

    HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 python -m difftransformer.hf.lm_eval run --model hf \\
        --model_args pretrained=runs/x/final --tasks my_task --include_path tasks/ --device cpu

`python -m difftransformer.hf.lm_eval ARGS` is `lm_eval ARGS` (lm-eval's own CLI, arguments unchanged)
in a process that has first registered our classes with transformers' auto classes. lm-eval's `hf`
model loads a folder with AutoConfig, AutoModelForCausalLM and AutoTokenizer, and two things stand
between it and a folder of ours (a run's final/: config.json, model.safetensors, tokenizer.json):

- the model type "difftransformer" is unknown to transformers until `difftransformer.hf` is imported
  (`import difftransformer.hf` registers the config and the model);
- final/tokenizer.json is a raw `tokenizers` file with no tokenizer_config.json, so nothing says which
  token is EOS, nor that a text starts with it. Importing this module registers
  `DiffTransformerTokenizerFast` as the AutoTokenizer class of our config, so
  `AutoTokenizer.from_pretrained(final_dir)` reads that tokenizer.json as it is: no file is written
  into the folder, and tokenizer.json is never rewritten (its sha256 is the tokenizer's identity in
  prepared data and checkpoints).

The tokenizer (contract):
- EOS, BOS and padding are all our end-of-text token "<|endoftext|>" (data/tokenizer.py EOS_TOKEN);
- `add_bos_token=True`: every text encoded with special tokens (transformers' default, and lm-eval's)
  starts with EOS. In training EOS separates documents, so the token before a document's first token
  is always EOS; difftransformer's own scoring (eval/lm.py: `encode_prompt`, `continuation_logprob`)
  therefore puts EOS before every text, and lm-eval then computes exactly what we compute:
  log p(continuation | EOS + context), the split between context and continuation made the same way
  where the context ends in spaces or none (docs/interop.md names the two splits that differ: other
  whitespace ending a context, a token spanning the boundary);
- a literal "<|endoftext|>" inside a text is ordinary text (split_special_tokens), as in our
  `Tokenizer`: data cannot forge a document boundary;
- decoding is exact (no clean-up of spaces).

`loglikelihood_rolling` tasks (perplexity: wikitext-style) prepend lm-eval's own prefix token (our
EOS) to the encoded text, so with the default they would see EOS twice and score the second EOS;
run them with `--model_args pretrained=DIR,add_bos_token=False`, which gives EOS + text, the
convention of our `token_nll`. loglikelihood, multiple_choice and generate_until tasks use the default.

`save_tokenizer_for_transformers(tokenizer_json, out_dir)` exports the same tokenizer as a plain
transformers folder (the generic `PreTrainedTokenizerFast`; its tokenizer.json carries the EOS
prefix as a post-processor), which AutoTokenizer loads without importing difftransformer.

Needs transformers >= 5 (its generic fast tokenizer honours add_bos_token; 4.x's ignores it, which
would silently drop the EOS before each text) and lm_eval >= 0.4.13 for the CLI:
`pip install 'difftransformer[lmeval]'` (tested with transformers 5.23 and lm_eval 0.4.13). Importing
this module refuses transformers 4.x.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import transformers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import processors
from transformers import AutoTokenizer, PreTrainedTokenizerFast

import difftransformer.hf  # noqa: F401  registers the config and the model with the auto classes
from difftransformer._config import debugging
from difftransformer.data.tokenizer import EOS_TOKEN, TOKENIZER_FILE, Tokenizer
from difftransformer.hf.configuration import DiffTransformerHFConfig

if int(transformers.__version__.split(".")[0]) < 5:  # pragma: no cover - the message is the point
    raise ImportError(f"difftransformer.hf.lm_eval needs transformers >= 5, found {transformers.__version__}: 4.x's "
                      f"generic fast tokenizer ignores add_bos_token, so texts would lose the EOS our models expect "
                      f"before them. pip install 'difftransformer[lmeval]'")

_PROBE = "The probe: a text, then <|endoftext|> as text."  # checks a transformers tokenizer against ours


def tokenizer_settings(eos_token: str = EOS_TOKEN) -> dict[str, Any]:
    """The transformers tokenizer settings of our tokenizer (see the module docstring)."""
    return dict(bos_token=eos_token, eos_token=eos_token, pad_token=eos_token, add_bos_token=True,
                add_eos_token=False, split_special_tokens=True, clean_up_tokenization_spaces=False)


class DiffTransformerTokenizerFast(PreTrainedTokenizerFast):
    """Our tokenizer.json as a transformers fast tokenizer: EOS is BOS, EOS and pad, and starts every text.

    `from_pretrained(dir)` reads dir/tokenizer.json as our `Tokenizer` would (it must hold the EOS token),
    with the settings of `tokenizer_settings()` unless given. AutoTokenizer uses this class for a folder
    whose config.json is ours and that has no tokenizer_config.json (a run's final/)."""

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs) -> "DiffTransformerTokenizerFast":
        source = Path(str(pretrained_model_name_or_path))
        ours = None
        if source.is_dir():
            if not (source / TOKENIZER_FILE).is_file():
                raise FileNotFoundError(
                    f"{source} has no {TOKENIZER_FILE}; a run's final/ folder holds the one the model was trained "
                    f"with. Copy that file (the run's prepared-data folder holds it too) into {source}")
            ours = Tokenizer.from_file(source / TOKENIZER_FILE)  # a file without the EOS token fails here, named
        for key, value in tokenizer_settings().items():
            kwargs.setdefault(key, value)
        tok = super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        if ours is not None:
            _check_same(tok, ours, str(source / TOKENIZER_FILE), bos=bool(kwargs["add_bos_token"]))
        return tok


def register_tokenizer() -> None:
    """Make AutoTokenizer load our folders with `DiffTransformerTokenizerFast` (idempotent; done on import)."""
    AutoTokenizer.register(DiffTransformerHFConfig, fast_tokenizer_class=DiffTransformerTokenizerFast, exist_ok=True)


def _check_same(tok, ours: Tokenizer, where: str, bos: bool = True) -> None:
    """Refuse a transformers tokenizer that does not encode as [EOS +] our ids (scores would differ from ours)."""
    got = tok(_PROBE)["input_ids"]
    want = [ours.eos_id] * bos + ours.encode(_PROBE)
    if got != want or tok.eos_token_id != ours.eos_id:
        raise ValueError(f"the transformers tokenizer read from {where} encodes {_PROBE!r} as {got[:8]}..., not as "
                         f"{'EOS + ' if bos else ''}our tokens {want[:8]}... (EOS id {ours.eos_id}); its settings "
                         f"differ from tokenizer_settings() (a tokenizer_config.json beside it?). Remove that file or "
                         f"rewrite it with save_tokenizer_for_transformers")


def save_tokenizer_for_transformers(tokenizer_json: str | Path, out_dir: str | Path,
                                    model_max_length: int | None = None) -> Path:
    """Export `tokenizer_json` as a plain transformers tokenizer folder that AutoTokenizer loads with no
    difftransformer import: the generic PreTrainedTokenizerFast with `tokenizer_settings()` (a way to
    use our tokenizer elsewhere; lm-eval on our folders needs no export).

    transformers 5 ignores add_bos_token in tokenizer_config.json when a tokenizer.json is present (the
    post-processor in tokenizer.json decides), so the exported out_dir/tokenizer.json is ours plus a
    post-processor that puts EOS first; its encodings without special tokens are unchanged, but its
    sha256 differs, so it is an export, not a replacement: out_dir may not be the folder of
    tokenizer_json (a run's final/ needs no export: importing this module lets AutoTokenizer read it as
    it is). The folder written is loaded back and checked to encode as EOS + our ids. `model_max_length` (the
    model's context), when given, is recorded in its tokenizer_config.json. Returns out_dir."""
    src, out = Path(tokenizer_json), Path(out_dir)
    ours = Tokenizer.from_file(src)  # names the file and the fix when it is not ours (no EOS token)
    if out.exists() and out.resolve() == src.parent.resolve():
        raise ValueError(f"out_dir {out} is the folder of {src}; the export rewrites tokenizer.json, whose sha256 "
                         f"identifies our tokenizer. Choose another out_dir (a final/ folder needs no export: "
                         f"import difftransformer.hf.lm_eval and load it with AutoTokenizer as it is)")
    inner = HFTokenizer.from_file(str(src))
    eos = ours.eos_token
    inner.post_processor = processors.TemplateProcessing(
        single=f"{eos}:0 $A:0", pair=f"{eos}:0 $A:0 {eos}:1 $B:1", special_tokens=[(eos, ours.eos_id)])
    extra = {} if model_max_length is None else {"model_max_length": int(model_max_length)}
    PreTrainedTokenizerFast(tokenizer_object=inner, **tokenizer_settings(eos), **extra).save_pretrained(out)
    _check_same(AutoTokenizer.from_pretrained(out), ours, str(out))
    return out


def main(argv: Sequence[str] | None = None) -> None:
    """lm-eval's CLI (`lm_eval ARGS`), with our classes registered; argv defaults to sys.argv[1:]. An error
    this package raises (a folder without tokenizer.json...) is one line on stderr and exit 2 (_raised_here)."""
    try:
        from lm_eval.__main__ import cli_evaluate
    except ImportError as e:
        raise SystemExit(f"lm-eval is not installed ({e}); pip install 'difftransformer[lmeval]' "
                         f"(lm_eval >= 0.4.13)") from None
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]  # lm-eval's CLI reads sys.argv itself
    if not (os.environ.get("HF_HUB_OFFLINE") and os.environ.get("HF_DATASETS_OFFLINE")):
        print("note: HF_HUB_OFFLINE / HF_DATASETS_OFFLINE are not both set; lm-eval may reach the Hugging Face "
              "Hub (local tasks and folders need neither)", file=sys.stderr)
    try:
        cli_evaluate()
    except (OSError, ValueError) as e:
        if not _raised_here(e):
            raise  # lm-eval's and transformers' own errors keep their tracebacks
        if debugging():
            raise
        print(f"difftransformer.hf.lm_eval: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def _raised_here(e: BaseException) -> bool:
    """Whether `e` was raised by this package (a folder without tokenizer.json, a foreign tokenizer, a config
    our classes refuse): its message names the file and the fix, so, as in the `difftransformer` command, it
    is printed as one line (exit 2) instead of at the end of a 40-line traceback through lm-eval (hostile
    pass 8, LM02). DIFFTRANSFORMER_DEBUG=1 keeps the traceback."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    package = Path(__file__).resolve().parents[1]  # src/difftransformer
    return tb is not None and Path(tb.tb_frame.f_code.co_filename).resolve().is_relative_to(package)


register_tokenizer()

if __name__ == "__main__":
    main()
