"""Run configs: one TOML or YAML file (plus `--set` overrides) -> model, train, data and compare settings.

    [model]                 # either a preset + overrides ...
    preset = "cpu-small"
    attention = "diff"      # the kind this model (or a comparison's first arm) uses
    hidden_size = 192       # any DiffTransformerConfig field overrides the preset
    # ... or, without `preset`, DiffTransformerConfig fields in full (missing ones take defaults)

    [train]                 # TrainConfig fields
    max_steps = 300

    [data]                  # how the token shards are made (DataSpec)
    corpus = "sotu"
    vocab_size = 8192

    [compare]               # only read by `difftransformer compare` (CompareSpec)
    arms = ["diff", "transformer"]

Every key is checked: a typo is an error that names the key, suggests the nearest valid one and
lists them all, because a silently ignored setting wastes a training run.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tomllib
import yaml

from difftransformer.model import ATTENTION_KINDS, PRESETS, DiffTransformerConfig, Preset

if TYPE_CHECKING:  # the train package is imported lazily: `prepare`/`generate` do not need it
    from difftransformer.train import TrainConfig

SECTIONS = ("model", "train", "data", "compare")
# Head counts are given in the configured attention kind's units, so they apply after `matched`.
_HEAD_KEYS = ("num_attention_heads", "num_key_value_heads")


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the key and the fix."""


@dataclass
class DataSpec:
    """Where the training text comes from and how it is tokenised (arguments of `prepare_data`)."""

    corpus: str = "sotu"
    data_dir: str | None = None  # None: cache/data/<corpus name>-<vocab_size>[-<split settings>]
    vocab_size: int = 8192
    tokenizer_path: str | None = None  # an existing tokenizer.json instead of training a BPE
    val_fraction: float = 0.05
    test_fraction: float = 0.05
    seed: int = 0  # the document split's seed (not the training seed)

    def resolved_dir(self) -> str:
        if self.data_dir:
            return self.data_dir
        name = re.sub(r"[^A-Za-z0-9._-]+", "_", self.corpus.split("#")[0]).strip("._") or "corpus"
        split = (self.val_fraction, self.test_fraction, self.seed)
        tag = "" if split == (0.05, 0.05, 0) else "-val{:g}-test{:g}-seed{}".format(*split)
        vocab = Path(self.tokenizer_path).stem if self.tokenizer_path else str(self.vocab_size)
        return f"cache/data/{name}-{vocab}{tag}"


@dataclass
class CompareSpec:
    """What `difftransformer compare` runs: arms (attention kinds) x seeds, and the report's samples."""

    arms: list[str] = field(default_factory=lambda: ["diff", "transformer"])
    seeds: list[int] | None = None  # None: the single seed [train].seed
    out_dir: str = "runs/compare"
    prompts: list[str] = field(default_factory=lambda: [
        "The state of the Union is", "My fellow citizens,", "Congress must"])
    sample_tokens: int = 48
    temperature: float = 0.8  # for the one sampled continuation per prompt (greedy is always shown)
    top_k: int | None = 50

    def __post_init__(self) -> None:
        if isinstance(self.arms, str):
            self.arms = [a.strip() for a in self.arms.split(",") if a.strip()]
        if isinstance(self.seeds, int):
            self.seeds = [self.seeds]
        elif isinstance(self.seeds, str):
            self.seeds = parse_int_list(self.seeds, "compare.seeds")
        if not self.arms:
            raise ConfigError("compare.arms is empty; give at least one attention kind, e.g. ['diff', 'transformer']")
        for arm in self.arms:
            if arm not in ATTENTION_KINDS:
                raise ConfigError(f"unknown arm {arm!r} in compare.arms{_suggest(arm, ATTENTION_KINDS)}; "
                                  f"arms are attention kinds: {', '.join(ATTENTION_KINDS)}")
        if len(set(self.arms)) != len(self.arms):
            raise ConfigError(f"compare.arms lists an arm twice: {self.arms}")
        if self.seeds is not None and len(set(self.seeds)) != len(self.seeds):
            raise ConfigError(f"compare.seeds lists a seed twice: {self.seeds}")


@dataclass
class RunConfig:
    """Everything one run needs; `model` has the vocab of the prepared data filled in by `resolve_vocab`."""

    model: DiffTransformerConfig
    train: TrainConfig
    data: DataSpec
    compare: CompareSpec
    model_section: dict[str, Any]  # the [model] section as written (after overrides), for the record
    source: str | None = None  # the config file, if any

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model.to_dict(), "train": self.train.to_dict(),
                "data": dataclasses.asdict(self.data), "compare": dataclasses.asdict(self.compare)}


# ----------------------------------------------------------------------------------------------
# parsing helpers


def _suggest(key: str, valid) -> str:
    close = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _unknown_key_error(section: str, key: str, valid) -> ConfigError:
    return ConfigError(f"unknown key {key!r} in [{section}]{_suggest(key, valid)}; "
                       f"valid keys: {', '.join(sorted(valid))}")


def parse_int_list(text: str, what: str) -> list[int]:
    try:
        return [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ConfigError(f"{what} must be comma-separated integers like 0,1,2; got {text!r}") from None


def parse_scalar(text: str) -> Any:
    """A `--set` value: a TOML value (3e-4, true, "x", [1, 2]), null/none, or else the bare string."""
    if text.strip().lower() in ("null", "none", "~"):
        return None
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


_FLOAT_RE = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")


def _yaml12_floats(node: Any) -> Any:
    """PyYAML follows YAML 1.1, where 3e-4 is a string; read it as the float everyone means (YAML 1.2)."""
    if isinstance(node, dict):
        return {k: _yaml12_floats(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_yaml12_floats(v) for v in node]
    return float(node) if isinstance(node, str) and _FLOAT_RE.match(node) else node


def load_file(path: str | Path) -> dict[str, dict[str, Any]]:
    """Read a .toml or .yaml/.yml config into {section: {key: value}}; sections are checked here."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix == ".toml":
            raw = tomllib.loads(text)
        elif path.suffix in (".yaml", ".yml"):
            raw = _yaml12_floats(yaml.safe_load(text) or {})
        else:
            raise ConfigError(f"config file {path} must end in .toml, .yaml or .yml")
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as e:
        raise ConfigError(f"cannot parse {path}: {e}") from e
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
        sections[section][name] = parse_scalar(value)


def _train_config_cls():
    from difftransformer.train import TrainConfig

    return TrainConfig


def _valid_keys() -> dict[str, set[str]]:
    model = {f.name for f in dataclasses.fields(DiffTransformerConfig)} | {"preset"}
    train = {f.name for f in dataclasses.fields(_train_config_cls())}
    return {"model": model, "train": train, "data": {f.name for f in dataclasses.fields(DataSpec)},
            "compare": {f.name for f in dataclasses.fields(CompareSpec)}}


def _check_keys(section: str, values: dict[str, Any], valid: set[str]) -> None:
    for key in values:
        if key not in valid:
            raise _unknown_key_error(section, key, valid)


# ----------------------------------------------------------------------------------------------
# building typed configs


def build_model_config(section: dict[str, Any]) -> DiffTransformerConfig:
    """[model] -> DiffTransformerConfig: `preset` + overrides, or DiffTransformerConfig fields in full."""
    section = dict(section)
    _check_keys("model", section, _valid_keys()["model"])
    preset_name = section.pop("preset", None)
    try:
        if preset_name is None:
            return DiffTransformerConfig(**section)
        if preset_name not in PRESETS:
            raise ConfigError(f"unknown preset {preset_name!r}{_suggest(str(preset_name), PRESETS)}; "
                              f"available presets: {', '.join(PRESETS)}")
        return _from_preset(PRESETS[preset_name], section)
    except (TypeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"invalid [model] settings: {e}") from e


def _from_preset(preset: Preset, overrides: dict[str, Any]) -> DiffTransformerConfig:
    """Size overrides apply to the DIFF-head spec (so a changed hidden_size re-derives the FFN width);
    head counts apply after conversion to the chosen kind, in that kind's units."""
    attention = overrides.pop("attention", "diff")
    heads = {k: overrides.pop(k) for k in _HEAD_KEYS if k in overrides}
    base = preset.fields()
    base.update(overrides)
    # Build the DIFF-unit spec with the requested heads already in place (halved when given in baseline
    # units), so a width that only divides by the new head count is accepted.
    factor = 1 if attention in ("diff", "diff_no_headnorm") else 2
    for k, v in heads.items():
        if isinstance(v, int) and v % factor == 0:
            base[k] = v // factor
    if "num_attention_heads" in heads and "num_key_value_heads" not in heads and \
            preset.diff_kv_heads is None:
        base["num_key_value_heads"] = None
    cfg = DiffTransformerConfig(**base).matched(attention)
    if heads:
        if "num_key_value_heads" not in heads and cfg.num_key_value_heads == cfg.num_attention_heads:
            heads["num_key_value_heads"] = heads["num_attention_heads"]  # no GQA stays no GQA
        cfg = dataclasses.replace(cfg, **heads)
    return cfg


def build_train_config(section: dict[str, Any]) -> TrainConfig:
    TrainConfig = _train_config_cls()
    _check_keys("train", section, {f.name for f in dataclasses.fields(TrainConfig)})
    try:
        return TrainConfig(**section)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"invalid [train] settings: {e}") from e


def build_data_spec(section: dict[str, Any]) -> DataSpec:
    _check_keys("data", section, {f.name for f in dataclasses.fields(DataSpec)})
    return DataSpec(**section)


def load_run_config(path: str | Path | None = None, *, preset: str | None = None, attention: str | None = None,
                    overrides: list[str] | None = None) -> RunConfig:
    """The CLI's view of a run: file (optional) < --preset/--attention < --set overrides."""
    sections = load_file(path) if path else {s: {} for s in SECTIONS}
    if preset is not None:
        sections["model"]["preset"] = preset
    if attention is not None:
        sections["model"]["attention"] = attention
    apply_overrides(sections, overrides or [])
    if not set(sections["model"]) - {"attention"}:
        sections["model"]["preset"] = "cpu-small"  # a bare `train --attention X` still does something sensible
    try:
        model = build_model_config(sections["model"])
        train = build_train_config(sections["train"])
        data = build_data_spec(sections["data"])
        _check_keys("compare", sections["compare"], _valid_keys()["compare"])
        compare = CompareSpec(**sections["compare"])
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}" if path else str(e)) from None
    # One source of truth for the shard folder: [data] decides, [train].data_dir must agree.
    if "data_dir" in sections["train"] and data.data_dir and sections["train"]["data_dir"] != data.data_dir:
        raise ConfigError(f"train.data_dir ({sections['train']['data_dir']!r}) and data.data_dir "
                          f"({data.data_dir!r}) disagree; set only data.data_dir")
    if "data_dir" in sections["train"] and not data.data_dir:
        data.data_dir = sections["train"]["data_dir"]
    train.data_dir = data.resolved_dir()
    check_seq_len(model, train)
    return RunConfig(model=model, train=train, data=data, compare=compare, model_section=sections["model"],
                     source=str(path) if path else None)


def check_seq_len(model: DiffTransformerConfig, train: TrainConfig) -> None:
    if train.seq_len > model.max_position_embeddings:
        raise ConfigError(f"train.seq_len ({train.seq_len}) is above the model's max_position_embeddings "
                          f"({model.max_position_embeddings}); lower train.seq_len or raise "
                          f"model.max_position_embeddings")


def resolve_vocab(cfg: RunConfig, data_vocab_size: int) -> None:
    """Size the embedding to the tokenizer actually trained (a small corpus may give fewer than asked)."""
    if "vocab_size" not in cfg.model_section:
        cfg.model = dataclasses.replace(cfg.model, vocab_size=data_vocab_size)
    elif cfg.model.vocab_size < data_vocab_size:
        raise ConfigError(f"model.vocab_size ({cfg.model.vocab_size}) is smaller than the tokenizer's vocabulary "
                          f"({data_vocab_size}); remove model.vocab_size to size it from the data")
