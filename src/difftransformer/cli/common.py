"""What every subcommand shares: help formatting, the run-config options, and printing report sections."""

from __future__ import annotations

import argparse
import os
import textwrap
from pathlib import Path

import torch

from difftransformer.data import Tokenizer
from difftransformer.dist import is_device_name
from difftransformer.experiments import StudyDir
from difftransformer.model import ATTENTION_KINDS, PRESETS
from difftransformer.model.serialization import folder_model_type
from difftransformer.run_config import ConfigError
from difftransformer.train import LoadedModel, load_model


class Formatter(argparse.RawDescriptionHelpFormatter):
    """Wrap one-paragraph descriptions to the terminal; keep the hand-laid-out epilogs as written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" in text:
            return super()._fill_text(text, width, indent)
        return textwrap.fill(text, width, initial_indent=indent, subsequent_indent=indent)


def epilog(text: str) -> str:
    return textwrap.dedent(text).strip("\n")


def add_config_args(p: argparse.ArgumentParser, attention_help: str, sections: str) -> None:
    """--config/--preset/--attention/--set/--out-dir/--no-resume, shared by train and compare."""
    g = p.add_argument_group("configuration (later wins: file < --preset/--attention < --set)")
    g.add_argument("--config", metavar="FILE", help=f"TOML or YAML run config with {sections} sections (see configs/)")
    g.add_argument("--preset", metavar="NAME", choices=list(PRESETS),
                   help=f"model size preset: {', '.join(PRESETS)}")
    g.add_argument("--attention", metavar="KIND", choices=list(ATTENTION_KINDS), help=attention_help)
    g.add_argument("--set", dest="overrides", metavar="SECTION.KEY=VALUE", action="append", default=[],
                   help="override one setting, e.g. train.lr=3e-4, model.hidden_size=192, data.corpus=notes/ "
                        "(values are TOML scalars: 3e-4, true, \"text\", [1, 2]; null for None); repeatable")
    g.add_argument("--out-dir", metavar="DIR", help="where to write the run(s)")
    g.add_argument("--no-resume", action="store_true",
                   help="start over instead of continuing from the newest checkpoint in the out dir")


class _Renamed(argparse.Action):
    """A flag that was renamed: using it is a one-line error naming the new flag (never silently ignored)."""

    def __init__(self, option_strings, dest, new: str, why: str, **kwargs):
        self.new, self.why = new, why
        super().__init__(option_strings, dest, nargs="?", help=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        parser.exit(2, f"{parser.prog}: error: {option_string} was renamed {self.new} ({self.why}); "
                       f"use {self.new}\n")


def add_renamed_flag(p: argparse.ArgumentParser, old: str, new: str, why: str) -> None:
    p.add_argument(old, action=_Renamed, new=new, why=why)


def out_dir(args: argparse.Namespace) -> str | None:
    """--out-dir as given (None when left out); an empty one is an error, not the default folder."""
    if args.out_dir is not None and not args.out_dir.strip():
        raise ValueError("--out-dir is empty; name the folder to write into")
    return args.out_dir


def check_device(device: str) -> None:
    """--device of generate and eval: cpu, cuda or cuda:N, and CUDA only where there is a GPU (torch's own
    error for 'tpu' is a traceback listing twenty device types)."""
    if not is_device_name(device):
        raise ConfigError(f"--device must be cpu, cuda or cuda:N, got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--device {device}: CUDA is not available here; use --device cpu")


def print_section(markdown: Path, heading: str) -> None:
    """Print one `## heading` section of a Markdown file (the verdict of a report)."""
    lines = markdown.read_text(encoding="utf-8").splitlines()
    if heading in lines:
        start = lines.index(heading) + 1
        end = next((i for i in range(start, len(lines)) if lines[i].startswith("## ")), len(lines))
        print("\n".join(lines[start:end]).strip())


def load_trained(path: str, device: str) -> LoadedModel:
    """A trained model from a final/, run or checkpoint folder (a comparison folder, or a transformers
    folder such as an exported DiffLlama, is refused by name)."""
    _refuse_study_folder(Path(path))
    if is_transformers_folder(path):
        raise ConfigError(f"{path} holds a transformers model ({model_type(path)}), not one of this package's "
                          f"checkpoints; convert it first (`difftransformer convert {path} OUT --to difftransformer`), "
                          f"or use `difftransformer eval` (its black-box tasks read transformers folders)")
    return load_model(path, device)


def is_transformers_folder(path: str) -> bool:
    """Whether PATH holds another transformers model (its config.json names a foreign model_type)."""
    try:
        from difftransformer.hf.causal_lm import is_transformers_folder as foreign
    except ImportError:  # without transformers every folder is read as one of ours (and fails as such)
        return False
    return foreign(path)


def model_type(path: str) -> str:
    """The model_type a transformers folder's config.json names (for messages)."""
    return folder_model_type(path) or "unknown model_type"


def refuse_inside_study(out: str) -> None:
    """A folder inside a study (an arm, a seed or a cell of a grid) is `compare`'s to write: a run trained
    there replaces the arm's weights while the study keeps the results of the old ones.
    os.path.realpath, not Path.resolve (which raises on a symlink loop): a path that is no folder
    is left to the out-dir checks that follow, which name it in one line."""
    for parent in list(Path(os.path.realpath(out)).parents)[:3]:  # STUDY/arm, STUDY/seedN/arm, STUDY/cell/seedN/arm
        if StudyDir(parent).is_study():
            raise ConfigError(f"{out} is inside the study {parent}: a run trained there would not match the study's "
                              f"results; continue the study with `difftransformer compare --out-dir {parent} ...`, "
                              f"or choose another --out-dir")


def _refuse_study_folder(path: Path) -> None:
    """A study folder holds several models; name them instead of failing on a missing checkpoint."""
    study = StudyDir(path)
    if study.is_study():
        arms = [str(r.path.relative_to(path)) for r in study.run_dirs()]
        raise ConfigError(f"{path} is a comparison folder; pick one arm, e.g. {path / (arms[0] if arms else 'diff')}"
                          f" (arms: {', '.join(arms) or 'none yet'})")


def model_tokenizer(model_path: str, tokenizer_arg: str | None, loaded: LoadedModel) -> Tokenizer:
    """The tokenizer the model was trained with, or `tokenizer_arg` (--tokenizer) if it is that one
    (or the model records none)."""
    tok_path = Path(tokenizer_arg) if tokenizer_arg else loaded.tokenizer_path
    if tok_path is None:
        raise ConfigError(f"no tokenizer found next to {model_path}; pass --tokenizer path/to/tokenizer.json")
    tok = Tokenizer.from_file(tok_path)
    if tok.vocab_size > loaded.model.config.vocab_size:
        raise ConfigError(f"tokenizer {tok_path} has {tok.vocab_size} tokens but the model only "
                          f"{loaded.model.config.vocab_size}; pass the tokenizer the model was trained with")
    own = loaded.tokenizer_hash or (Tokenizer.from_file(loaded.tokenizer_path).hash if loaded.tokenizer_path else None)
    if own is not None and tok.hash != own:
        raise ConfigError(f"{tok_path} is not the tokenizer {model_path} was trained with (hash {own[:12]}, this one "
                          f"{tok.hash[:12]}); its text would be garbage. Leave --tokenizer out to use that one")
    return tok
