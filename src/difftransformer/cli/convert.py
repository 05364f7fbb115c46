"""`difftransformer convert`: convert a checkpoint folder between our format, transformers' DiffLlama and
Llama, and the authors' reference layout, exactly (difftransformer.convert; docs/interop.md).

The source format is detected from the folder (config.json's model_type, or the authors'-layout
settings); a run folder stands for its final/. The result is written into a new folder, complete or
not at all: it is assembled beside DST and renamed into place at the end, so a failed conversion
leaves no half-written DST, and an existing non-empty DST is refused rather than overwritten (so is a DST
that is a symbolic link, before any work).
Weights are read from safetensors only (a pickle is never opened) and written as safetensors:
transformers folders by the transformers classes' own save_pretrained (so they load with
`from_pretrained`), ours ("difftransformer") by our save_pretrained, the authors' layout as one safetensors file plus
its settings JSON. The tokenizer.json saved with the source (a run's final/) is copied along, and so are the
source's special-token ids (config.json), generation settings and chat template (SIDE_FILES): a model that stopped
at its EOS before the conversion stops there after it.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from difftransformer._io import atomic_write_text, broken_link, writing
from difftransformer.convert import FORMAT_ALIASES, FORMATS, ConversionError, from_ours, read_checkpoint, to_ours
from difftransformer.convert.unilm import SETTINGS_NAME
from difftransformer.data.tokenizer import Tokenizer
from difftransformer.model import DiffTransformerConfig, DiffTransformerLM
from difftransformer.model.serialization import CONFIG_NAME, WEIGHTS_NAME, check_weight_dtypes
from difftransformer.train.run_dir import TOKENIZER_FILE, RunDir

TOKENIZER_CONFIG = "tokenizer_config.json"  # transformers' tokenizer settings (special tokens)
# The files of a model folder beside its config and weights that say how the model is used, not what it computes:
# the tokenizer's transformers settings, the generation settings (EOS ids, penalties), a chat template. Every
# conversion carries them over as they are (the tokenizer's two only with its tokenizer.json), and the special-token
# ids of the source's config.json into every target with a config.json (ours, DiffLlama, Llama; not the authors').
TOKENIZER_SIDE_FILES = (TOKENIZER_CONFIG, "special_tokens_map.json")
SIDE_FILES = (*TOKENIZER_SIDE_FILES, "generation_config.json", "chat_template.jinja", "chat_template.json")
SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")

HELP = "convert weights between our format, transformers' DiffLlama/Llama and the authors' layout"
DESCRIPTION = ("Convert a model folder exactly (the converted model computes the same logits): difftransformer "
               "(this package's format) <-> transformers' DiffLlamaForCausalLM (kind 'diff'), <-> LlamaForCausalLM "
               "(kind 'transformer'), <-> the authors' reference layout (unilm Diff-Transformer, kind 'diff'). The "
               "source format is detected; a model the target cannot express is refused with the reason. "
               "Safetensors only.")
EXAMPLES = """
    examples:
      difftransformer convert runs/demo/diff exported/diffllama --to diffllama
      difftransformer convert hf/diffllama-folder imported/diff --to difftransformer
      difftransformer convert runs/demo/transformer/final exported/llama --to llama
      difftransformer convert runs/demo/diff exported/unilm --to unilm

    --to ours, the name difftransformer had before, still works and will be removed in the next release."""

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", metavar="SRC", help="checkpoint folder: ours (a final/ or run folder), a transformers "
                                              "diffllama/llama folder, or the authors' layout")
    p.add_argument("dst", metavar="DST", help="new folder to write (must not exist, or be empty)")
    p.add_argument("--to", required=True, type=_format_arg, choices=FORMATS, metavar="FORMAT",
                   help=f"target format: {', '.join(FORMATS)}")


def _format_arg(value: str) -> str:
    """--to's value as a format name: an alias becomes its format, with a note on stderr."""
    if value in FORMAT_ALIASES:
        print(f"note: --to {value} is now --to {FORMAT_ALIASES[value]}; {value!r} will be removed in the next "
              f"release", file=sys.stderr)
    return FORMAT_ALIASES.get(value, value)


def run(args: argparse.Namespace) -> int:
    src, dst = _source_folder(Path(args.src)), Path(args.dst)
    _check_destination(src, dst)
    for weights in sorted(src.glob("*.safetensors")) if src.is_dir() else []:
        check_weight_dtypes(weights)  # bool or integer "weights" would be cast into a model computing garbage
    with _claim(dst):  # a second conversion into DST fails now, not after all the work
        ckpt = read_checkpoint(src)
        if ckpt.format == args.to:
            raise ConversionError(f"{src} is already in format {args.to!r}; pick another --to")
        state, config = to_ours(ckpt.format, ckpt.state, ckpt.config)
        params = sum(t.numel() for n, t in state.items() if not (config.tie_word_embeddings and n == "lm_head.weight"))
        state, out_config = from_ours(args.to, state, config)
        ids = special_ids(src)
        if args.to in ("diffllama", "llama"):  # our tokenizer's EOS, unless the source's config names its own ids
            out_config = {**out_config, **_eos_token_id(src), **ids}
        _write_atomically(dst, lambda folder: _write(args.to, folder, state, out_config, src, ids))
    print(f"converted {src} ({ckpt.format}) to {dst} ({args.to}): attention {config.attention!r}, "
          f"{config.num_hidden_layers} layers, {params:,} parameters")
    return 0


def _source_folder(path: Path) -> Path:
    """`path`, or the final/ of the run folder `path` (a final/ holds the trained model)."""
    run = RunDir(path)
    if not path.is_dir() or any((path / n).is_file() for n in (CONFIG_NAME, SETTINGS_NAME)):
        return path
    if run.final.is_dir():
        return run.final
    if run.has_metrics():
        raise ConversionError(f"{path} is a run folder without a final model ({run.final} is missing); convert it "
                              f"once training has finished")
    return path


def _check_destination(src: Path, dst: Path) -> None:
    """Refuse, before any work, a DST that cannot become the new folder (convert and retrofit): a link
    (_refuse_links), a file or a non-empty folder, or the source itself. Paths are compared with
    os.path.realpath, never Path.resolve, which raises RuntimeError on a symlink loop (Python 3.11)."""
    _refuse_links(dst)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise ConversionError(f"{dst} already exists and is not an empty folder; convert writes a new folder "
                              f"(remove it or choose another DST)")
    if src.exists() and os.path.realpath(dst) == os.path.realpath(src):
        raise ConversionError(f"DST {dst} is the source folder; choose another DST")


def _refuse_links(dst: Path) -> None:
    """A DST that is a symbolic link is refused: the result is renamed into place, which cannot go through a
    link (it failed at the very end, "Not a directory", after the whole conversion), and writing into the
    link's target instead would put it where the user did not name. A link on the way to DST that leads
    nowhere (missing, a loop) is refused too; a link to a real folder on the way is fine."""
    if dst.is_symlink():
        raise ConversionError(f"DST {dst} is a symbolic link ({_link_target(dst)}); the result is written as a new "
                              f"folder, not through a link: give a real folder path, or remove the link")
    for part in dst.parents:
        if part.is_symlink() and not part.is_dir():
            raise ConversionError(f"{part}, on the way to DST {dst}, is a symbolic link ({_link_target(part)}), so "
                                  f"DST cannot be made; repair or remove the link, or choose another DST")


def _link_target(link: Path) -> str:
    """Where the symbolic link `link` points, for messages: its target, and whether that is missing or a loop."""
    target, broken = os.readlink(link), broken_link(link)
    if broken is not None:
        return f"to {target}, " + ("a symlink loop" if broken == "loop" else "which does not exist")
    return f"to {target}" + (", an empty folder" if link.is_dir() and not any(link.iterdir()) else "")


_claimed: dict[Path, Path] = {}  # DST -> the temporary folder this process claimed it with (_claim)


@contextlib.contextmanager
def _claim(dst: Path) -> Iterator[Path]:
    """Claim `dst` for this process: make its temporary folder `.DST.converting-PID` beside it and hold an
    flock on it, then refuse (ConversionError) when another conversion holds the flock of one of its own.
    Locking first and looking second, of two conversions started together at least one sees the other and
    stops before any work; the operating system drops a killed one's flock. Re-entrant; the folder is
    removed when the block ends."""
    if dst in _claimed:
        yield _claimed[dst]
        return
    dst.parent.mkdir(parents=True, exist_ok=True)
    _sweep_abandoned(dst)
    tmp = dst.parent / f".{dst.name}.converting-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    fd = os.open(tmp, os.O_RDONLY)
    try:
        if _flock(fd):
            for other in dst.parent.glob(f".{glob.escape(dst.name)}.converting-*"):
                if other != tmp and other.is_dir() and _held(other):
                    raise ConversionError(f"another conversion into {dst} is running ({other.name} is in use); "
                                          f"wait for it to finish, or choose another DST")
        _claimed[dst] = tmp
        yield tmp
    finally:
        _claimed.pop(dst, None)
        os.close(fd)
        shutil.rmtree(tmp, ignore_errors=True)


def _flock(fd: int) -> bool:
    """Take an exclusive flock on `fd` without waiting: True when taken, False when held elsewhere or where
    there is no flock (Windows)."""
    try:
        import fcntl

        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except (ImportError, OSError):
        return False
    return True


def _held(folder: Path) -> bool:
    """Whether another process holds the flock of `folder` (a conversion running into it)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return False
    try:
        return not _flock(fd)
    finally:
        os.close(fd)  # closing drops a flock taken just to look


def _write_atomically(dst: Path, write) -> None:
    """Call write(folder) on a fresh folder beside `dst`, then rename it to `dst` (nothing half-written is left)."""
    with _claim(dst) as tmp:
        _write_claimed(dst, tmp, write)


def _write_claimed(dst: Path, tmp: Path, write) -> None:
    """write(tmp), then `tmp` renamed to `dst`; a failure names DST's files, not the temporary folder's."""
    try:
        with writing(dst):  # an error without a file name (a full disk) names DST
            write(tmp)
    except OSError as e:  # and one naming a file of the temporary folder names that file in DST
        if e.filename is not None and os.fspath(e.filename).startswith(os.fspath(tmp)):
            e.filename = os.fspath(dst) + os.fspath(e.filename)[len(os.fspath(tmp)):]
        raise
    if dst.is_dir():
        dst.rmdir()  # empty (checked before)
    os.replace(tmp, dst)


def _sweep_abandoned(dst: Path) -> None:
    """Remove the `.DST.converting-PID` folders that killed conversions into `dst` left behind (their
    process is gone); a folder of a conversion still running is left alone."""
    for folder in dst.parent.glob(f".{glob.escape(dst.name)}.converting-*"):
        pid = folder.name.rpartition("-")[2]
        if pid.isdigit() and not _running(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: running
        pass
    return True


def _eos_token_id(src: Path) -> dict[str, int]:
    """{"eos_token_id": id} of the tokenizer saved with the source, for a transformers folder's config.json:
    transformers' generate() stops at the config's EOS (ours stops at the tokenizer's), so without it a
    converted model never ends a document there. (A transformers target always has one of our sources:
    llama and diffllama hold different attention kinds, so neither converts into the other.)"""
    tokenizer = src / TOKENIZER_FILE
    if not tokenizer.is_file():
        return {}
    try:
        eos = Tokenizer.from_file(tokenizer).eos_id
    except (OSError, ValueError):
        return {}
    return {"eos_token_id": eos}


def _write(fmt: str, folder: Path, state: dict[str, torch.Tensor], config: Any, src: Path,
           ids: dict[str, Any]) -> None:
    if fmt == "difftransformer":
        _save_ours(folder, state, config)
        add_special_ids(folder, ids)
    elif fmt == "unilm":
        _save_unilm(folder, state, config)
    else:
        _save_transformers(fmt, folder, state, config)
    _copy_tokenizer(fmt, src, folder, config)
    copy_side_files(src, folder)


def special_ids(src: Path) -> dict[str, Any]:
    """The special-token ids (SPECIAL_IDS) the source folder's config.json names, those that are set; {} for a
    folder without them (the authors' layout, a model trained here)."""
    try:
        data = json.loads((src / CONFIG_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return {k: data[k] for k in SPECIAL_IDS if isinstance(data, dict) and data.get(k) is not None}


def add_special_ids(folder: Path, ids: dict[str, Any]) -> None:
    """`ids` written into our config.json in `folder` (keys it accepts beside its own: transformers reads them)."""
    if ids:
        path = folder / CONFIG_NAME
        atomic_write_text(path, json.dumps({**json.loads(path.read_text(encoding="utf-8")), **ids}, indent=2,
                                           sort_keys=True) + "\n")


def copy_side_files(src: Path, folder: Path) -> None:
    """The source's SIDE_FILES into `folder`, replacing what the target's writer made of them (transformers writes a
    generation_config.json from the model config alone); a tokenizer's settings go only with the tokenizer.json they
    describe."""
    for name in SIDE_FILES:
        if (src / name).is_file() and (name not in TOKENIZER_SIDE_FILES or (src / TOKENIZER_FILE).is_file()):
            shutil.copyfile(src / name, folder / name)


def _copy_tokenizer(fmt: str, src: Path, folder: Path, config: Any) -> None:
    """The source's tokenizer.json goes along (its tokenizer_config.json too, one of the SIDE_FILES). A
    transformers folder gets our tokenizer as transformers' when the source has no tokenizer_config.json: EOS
    named (without it generation and evaluation cannot end a document) and first in every encoded text, as in
    training (difftransformer.hf.save.save_transformers_tokenizer)."""
    tokenizer = src / TOKENIZER_FILE
    if not tokenizer.is_file():
        return
    shutil.copyfile(tokenizer, folder / TOKENIZER_FILE)
    if fmt in ("diffllama", "llama") and not (src / TOKENIZER_CONFIG).is_file() and _has_eos(tokenizer):
        from difftransformer.hf.save import save_transformers_tokenizer  # transformers wrote the folder

        save_transformers_tokenizer(tokenizer, folder, config.get("max_position_embeddings"))


def _has_eos(tokenizer: Path) -> bool:
    """Whether the file is a tokenizer with our EOS token (`Tokenizer` refuses one without it)."""
    try:
        Tokenizer.from_file(tokenizer)
    except (OSError, ValueError):
        return False
    return True


def _save_ours(folder: Path, state: dict[str, torch.Tensor], config: DiffTransformerConfig) -> None:
    model = DiffTransformerLM(config, device="meta")
    model.load_state_dict(state, strict=True, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.save_pretrained(folder)


def _save_unilm(folder: Path, state: dict[str, torch.Tensor], settings: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / WEIGHTS_NAME), metadata={"format": "pt"})
    atomic_write_text(folder / SETTINGS_NAME, json.dumps(settings, indent=2) + "\n")


def _save_transformers(fmt: str, folder: Path, state: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    """Write a transformers folder through transformers' own classes (difftransformer.hf owns that import)."""
    try:
        from difftransformer.hf.save import save_transformers_folder
    except ImportError:
        raise ConversionError(f"--to {fmt} writes a transformers folder and needs transformers: "
                              f"pip install 'difftransformer[hf]'") from None
    save_transformers_folder(fmt, folder, state, config)
