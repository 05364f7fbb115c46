"""Run configs: one TOML or YAML file (plus `--set` overrides) -> each subsystem's own typed config.

    [model]                 # model.config: a preset + overrides ...
    preset = "cpu-small"
    attention = "diff"      # the kind this model (or a study's size spec) uses
    hidden_size = 192       # any DiffTransformerConfig field overrides the preset
    # ... or, without `preset`, DiffTransformerConfig fields in full (missing ones take defaults)

    [train]                 # train.TrainConfig
    max_steps = 300

    [data]                  # data.DataConfig: which corpus, tokenizer and document split
    corpus = "sotu"
    vocab_size = 8192

    [compare]               # experiments.StudyConfig: only read by `difftransformer compare`
    arms = ["diff", "transformer"]

Each subsystem owns and validates its config; this module only reads files, applies overrides,
checks that every key exists (a typo names the key, suggests the nearest valid one and lists them
all, because a silently ignored setting wastes a training run) and hands each section to its owner.
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from difftransformer._config import did_you_mean
from difftransformer.data import DataConfig
from difftransformer.data.config import CORPUS_ONLY_FIELDS
from difftransformer.data.tokenizer import Tokenizer
from difftransformer.experiments.config import StudyConfig
from difftransformer.model import DiffTransformerConfig
from difftransformer.model.config import MODEL_SECTION_KEYS, model_config_from_section
from difftransformer.train import TrainConfig
from difftransformer.train.init import check_init_overrides, folder_tokenizer, init_model_config

SECTIONS = ("model", "train", "data", "compare")
# Keys that were renamed: an old config gets the new name instead of a bare "unknown key".
RENAMED = {("data", "seed"): "split_seed"}


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the key and the fix."""


def _valid_keys() -> dict[str, frozenset[str]]:
    fields = lambda cls: frozenset(f.name for f in dataclasses.fields(cls))  # noqa: E731
    return {"model": MODEL_SECTION_KEYS, "train": fields(TrainConfig), "data": fields(DataConfig),
            "compare": fields(StudyConfig)}


@dataclass
class RunConfig:
    """Everything one run needs, each part typed and validated by its owner."""

    model: DiffTransformerConfig
    train: TrainConfig
    data: DataConfig
    compare: StudyConfig
    model_section: dict[str, Any]  # the [model] section as written (after overrides), for the record
    source: str | None = None  # the config file, if any

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model.to_dict(), "train": self.train.to_dict(), "data": self.data.to_dict(),
                "compare": self.compare.to_dict()}

    def resolve_vocab(self, data_vocab_size: int) -> None:
        """Size the embedding to the tokenizer actually trained (a small corpus may give fewer tokens than
        asked for), unless [model] sets vocab_size or the model comes from train.init_from; then it must
        hold the tokenizer's vocabulary."""
        if self.train.init_from is not None:
            if self.model.vocab_size < data_vocab_size:
                raise ConfigError(f"the model in init_from {self.train.init_from} has {self.model.vocab_size} token "
                                  f"embeddings but the data's tokenizer has {data_vocab_size}; prepare the data with "
                                  f"the model's own tokenizer (data.tokenizer_path)")
        elif "vocab_size" not in self.model_section:
            self.model = dataclasses.replace(self.model, vocab_size=data_vocab_size)
        elif self.model.vocab_size < data_vocab_size:
            raise ConfigError(f"model.vocab_size ({self.model.vocab_size}) is smaller than the tokenizer's vocabulary "
                              f"({data_vocab_size}); remove model.vocab_size to size it from the data")


# ----------------------------------------------------------------------------------------------
# reading and overriding


_suggest = did_you_mean


def parse_scalar(text: str) -> Any:
    """A `--set` value: a TOML value (3e-4, true, "x", [1, 2]), null/none, or else the bare string."""
    if text.strip().lower() in ("null", "none", "~"):
        return None
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


class _Yaml12Loader(yaml.SafeLoader):
    """PyYAML's safe loader with two YAML 1.2 rules that run configs need: 3e-4 is a float (YAML 1.1
    reads it as a string; a quoted "3e-4" stays a string), and a key given twice in one mapping is an
    error instead of a silent last-wins."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r} is given twice",
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_Yaml12Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$"),
                                    list("-+0123456789."))


def load_file(path: str | Path) -> dict[str, dict[str, Any]]:
    """Read a .toml or .yaml/.yml config into {section: {key: value}}; section names are checked here."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"config file {path} is a folder; give the .toml or .yaml file in it")
    if path.exists() and not path.is_file():
        raise ConfigError(f"config file {path} is not a regular file; give a .toml or .yaml file")
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:  # utf-8-sig: a byte-order mark (as some Windows editors write) is not the start of a statement
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {e.start}); save it as UTF-8") from None
    try:
        if path.suffix == ".toml":
            raw = tomllib.loads(text)
        elif path.suffix in (".yaml", ".yml"):
            raw = yaml.load(text, Loader=_Yaml12Loader) or {}
        else:
            raise ConfigError(f"config file {path} must end in .toml, .yaml or .yml")
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as e:
        raise ConfigError(f"cannot parse {path}: {e}") from e
    except RecursionError:
        raise ConfigError(f"cannot parse {path}: it nests too deeply to be a run config") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must be a mapping of sections ({', '.join(SECTIONS)}), got {type(raw).__name__}")
    for name, body in raw.items():
        if name not in SECTIONS:
            raise ConfigError(f"unknown section [{name}] in {path}{_suggest(str(name), SECTIONS)}; "
                              f"valid sections: {', '.join(SECTIONS)}")
        if not isinstance(body, dict):
            raise ConfigError(f"[{name}] in {path} must be a table of key = value pairs, got {body!r}")
    return {s: dict(raw.get(s) or {}) for s in SECTIONS}


def apply_overrides(sections: dict[str, dict[str, Any]], overrides: list[str]) -> None:
    """Apply `section.key=value` strings in place; the key is validated later with its section."""
    for item in overrides:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"--set expects section.key=value (e.g. train.lr=3e-4), got {item!r}")
        section, dot, name = key.partition(".")
        if not dot:
            owners = [s for s, fields_ in _valid_keys().items() if key in fields_]
            hint = f"; did you mean {owners[0]}.{key}?" if owners else ""
            raise ConfigError(f"--set key {key!r} needs a section prefix (model., train., data., compare.){hint}")
        if section not in SECTIONS:
            raise ConfigError(f"--set {item!r}: unknown section {section!r}{_suggest(section, SECTIONS)}; "
                              f"valid sections: {', '.join(SECTIONS)}")
        *tables, leaf = name.split(".")  # data.mixture.needle: a key of the nested table [data.mixture]
        target = sections[section]
        for i, table in enumerate(tables):
            target = target.setdefault(table, {})
            if not isinstance(target, dict):
                where = ".".join([section, *tables[:i + 1]])
                raise ConfigError(f"--set {item!r}: {where} is a single value, not a table of settings; "
                                  f"set {where}=... instead")
        target[leaf] = parse_scalar(value)


def _nested_tables(section: str) -> dict[str, type]:
    """Fields of [section] that are nested tables: a dataclass default ([data.mixture] -> MixtureConfig)."""
    owner = {"train": TrainConfig, "data": DataConfig, "compare": StudyConfig}.get(section)
    if owner is None:
        return {}
    return {f.name: f.default_factory for f in dataclasses.fields(owner)
            if dataclasses.is_dataclass(f.default_factory)}


def check_keys(section: str, values: dict[str, Any]) -> None:
    """Every key of [section] must be a field of its config (renamed keys name their new name), and
    every key of a nested table ([data.mixture]) a field of its config."""
    valid = _valid_keys()[section]
    nested = _nested_tables(section)
    for key in values:
        if key in nested and isinstance(values[key], dict):
            fields_ = sorted(f.name for f in dataclasses.fields(nested[key]))
            for sub in values[key]:
                if sub not in fields_:
                    raise ConfigError(f"unknown key {sub!r} in [{section}.{key}]{_suggest(str(sub), fields_)}; "
                                      f"valid keys: {', '.join(fields_)}")
        if key in valid:
            continue
        if (section, key) in RENAMED:
            raise ConfigError(f"[{section}] {key} was renamed {RENAMED[section, key]}; write "
                              f"{section}.{RENAMED[section, key]} instead")
        raise ConfigError(f"unknown key {key!r} in [{section}]{_suggest(key, valid)}; "
                          f"valid keys: {', '.join(sorted(valid))}")


# ----------------------------------------------------------------------------------------------
# building the typed configs


_BUILDERS = {"model": model_config_from_section, "train": lambda s: TrainConfig(**s),
             "data": lambda s: DataConfig(**s), "compare": lambda s: StudyConfig(**s)}


def build_section(section: str, values: dict[str, Any]) -> Any:
    """[section] -> its owner's typed config; the owner's validation errors become ConfigErrors."""
    check_keys(section, values)
    try:
        return _BUILDERS[section](dict(values))
    except (TypeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"invalid [{section}] settings: {e}") from e


def load_run_config(path: str | Path | None = None, *, preset: str | None = None, attention: str | None = None,
                    overrides: list[str] | None = None) -> RunConfig:
    """The CLI's view of a run: file (optional) < --preset/--attention < --set overrides."""
    sections = load_file(path) if path else {s: {} for s in SECTIONS}
    if preset is not None:
        sections["model"]["preset"] = preset
    if attention is not None:
        sections["model"]["attention"] = attention
    apply_overrides(sections, overrides or [])
    _task_or_corpus(sections["data"], path)
    init_from = sections["train"].get("init_from")
    if init_from is None and not set(sections["model"]) - {"attention"}:
        sections["model"]["preset"] = "cpu-small"  # a bare `train --attention X` still does something sensible
    try:  # mistakes of the file (and of --set) are named by the file
        built = {name: build_section(name, sections[name]) for name in SECTIONS if name != "model" or not init_from}
        if init_from:
            _check_model_beside_folder(built["train"].init_from, sections["model"])
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}" if path else str(e)) from None
    if init_from:  # the folder's own problems name the folder, not the run config
        built["model"] = _model_from_folder(built["train"].init_from, sections["model"], built["data"])
    _one_data_dir(sections, built["train"], built["data"])
    try:
        built["train"].check_model(built["model"])
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return RunConfig(model=built["model"], train=built["train"], data=built["data"], compare=built["compare"],
                     model_section=sections["model"], source=str(path) if path else None)


def _task_or_corpus(data_section: dict[str, Any], path: str | Path | None) -> None:
    """[data.task] replaces the corpus: a corpus setting beside it would be silently unused, so it is refused."""
    given = [key for key in CORPUS_ONLY_FIELDS if key in data_section]
    if "task" in data_section and given:
        where = f"{path}: " if path else ""
        raise ConfigError(f"{where}[data] sets {', '.join(given)} beside [data.task], which generates every sequence "
                          f"with its own tokenizer and uses no corpus; remove {', '.join(f'data.{k}' for k in given)} "
                          f"or the [data.task] table")


def _check_model_beside_folder(folder: str, model_section: dict[str, Any]) -> None:
    """With train.init_from, [model] may hold only known keys, and of those only MAY_CHANGE fields."""
    check_keys("model", model_section)
    try:
        check_init_overrides(folder, model_section)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _model_from_folder(folder: str, model_section: dict[str, Any], data: DataConfig) -> DiffTransformerConfig:
    """train.init_from: the model is the folder's (`[model]` checked by _check_model_beside_folder), and so
    is the tokenizer: the data are tokenized with the one saved beside the weights unless [data] names the same."""
    try:
        model = init_model_config(folder, model_section)
    except (OSError, ValueError) as e:
        raise ConfigError(str(e)) from None
    saved = folder_tokenizer(folder)
    if saved is not None and data.tokenizer_path is None:
        data.tokenizer_path = str(saved)
    elif saved is not None and not _same_tokenizer(saved, data.tokenizer_path):
        raise ConfigError(f"data.tokenizer_path ({data.tokenizer_path}) is not the tokenizer saved with the model in "
                          f"{folder} ({saved}); remove data.tokenizer_path to use the model's")
    return model


def _same_tokenizer(a: Path, b: str) -> bool:
    """Whether tokenizer file b is tokenizer a (compared as tokenizers, not as bytes)."""
    return Path(b).is_file() and Tokenizer.from_file(b).hash == Tokenizer.from_file(a).hash


def _one_data_dir(sections: dict[str, dict[str, Any]], train: TrainConfig, data: DataConfig) -> None:
    """One source of truth for the shard folder: [data] decides, [train].data_dir must agree."""
    if "data_dir" in sections["train"] and data.data_dir and sections["train"]["data_dir"] != data.data_dir:
        raise ConfigError(f"train.data_dir ({sections['train']['data_dir']!r}) and data.data_dir "
                          f"({data.data_dir!r}) disagree; set only data.data_dir")
    if "data_dir" in sections["train"] and not data.data_dir:
        data.data_dir = sections["train"]["data_dir"]
    train.data_dir = data.resolved_dir()
