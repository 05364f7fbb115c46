"""Arms of a study: (name, attention kind, overrides), and the paper's ablation rows by name.

An arm is what one column of the paper's ablation table (Table 6) varies: the attention kind, and
model fields that are changed on top of it. Every arm of a study is derived from ONE size spec (the
[model] section, or a size of the grid), so arms differ only where their definition says:

    spec.matched(arm.attention)         # same width, depth, FFN and head_dim; heads in the kind's units
    ... then `heads = "diff"`           # the Transformer with DIFF's head count (heads of 2d)
    ... then `overrides`                # any model field, e.g. lambda_init = 0.8

Named arms (`ABLATIONS`) cover every row of Table 6, DIFF V2, and the control the paper lacks: the
Transformer with a head-wise sigmoid gate on its attention output (Gated Attention, Qiu et al. 2025),
which asks whether DIFF's gain is only a nonlinearity before the output projection. A bare attention
kind is an arm named after it. A study config may also define its own arms as tables:

    arms = ["diff", "transformer", {name = "diff_l0.3", attention = "diff", overrides = {lambda_init = 0.3}}]

Overrides may change what the model is (lambda_init, heads, widths) but not the size spec's runtime
fields (attn_backend, attn_deterministic: those are the [model] section's), nor `attention` (use
`attention`). A mistyped field is an error naming the nearest valid one, found before anything trains.

Every arm trains on the study's recipe ([train]) unless its table has its own `train` overrides, for an arm
that does not learn the task under the shared recipe (a study whose arms must all reach an accuracy bar says
so, and trains that arm longer): {name = "diff_no_headnorm", attention = "diff_no_headnorm",
train = {max_steps = 6000}}. They may change the optimisation (max_steps, lr, schedule, warmup, decay,
clipping), not what a step sees (seq_len, batch_size, seed: the arms' batches stay paired) nor where it runs;
the report names every arm trained on its own recipe.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import Any

from difftransformer.model import DiffTransformerConfig, attention_kind
from difftransformer.model.config import RUNTIME_FIELDS
from difftransformer.train.config import RESUME_MUST_MATCH, TrainConfig

HEAD_UNITS = ("own", "diff")  # an arm's heads: its kind's matched count, or DIFF's count (heads of 2d)
_ARM_KEYS = ("name", "attention", "overrides", "heads", "description", "train")
# Recipe fields an arm may not change: what each step sees (paired batches), how validation loss is measured
# (the same windows for every arm), the I/O and the device.
_SHARED_TRAIN = frozenset(RESUME_MUST_MATCH) | {"data_dir", "out_dir", "device", "fsdp", "init_from", "eval_batches"}


@dataclass(frozen=True)
class Arm:
    """One arm: a name (its folder and column), an attention kind, and what is changed on top of it."""

    name: str
    attention: str
    overrides: dict[str, Any] = field(default_factory=dict)
    heads: str = "own"  # "diff": the kind keeps DIFF's head count (h heads of 2d instead of 2h of d)
    description: str = ""
    train: dict[str, Any] = field(default_factory=dict)  # this arm's own recipe changes (see the module doc)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or "/" in self.name or self.name.startswith("."):
            raise ValueError(f"arm name {self.name!r} must be a non-empty folder name (no '/', not starting "
                             f"with '.'), e.g. 'diff_lambda_0.8'")
        attention_kind(self.attention, what=f"attention kind of arm {self.name!r}")
        if self.heads not in HEAD_UNITS:
            raise ValueError(f"arm {self.name!r}: heads={self.heads!r} is not one of {HEAD_UNITS} ('own': the "
                             f"kind's matched head count; 'diff': DIFF's head count, heads of 2d)")
        if not isinstance(self.overrides, dict):
            raise ValueError(f"arm {self.name!r}: overrides must be a table of model fields like "
                             f"{{lambda_init = 0.8}}, got {self.overrides!r}")
        known = {f.name for f in dataclasses.fields(DiffTransformerConfig)} - set(RUNTIME_FIELDS) - {"attention"}
        for key in self.overrides:
            if key not in known:
                close = difflib.get_close_matches(str(key), sorted(known), n=1, cutoff=0.6)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                rule = ("it is set by the arm's `attention`" if key == "attention" else
                        "it is the size spec's ([model] section's)" if key in RUNTIME_FIELDS else "not a model field")
                raise ValueError(f"arm {self.name!r}: cannot override {key!r}{hint}: {rule}; overridable fields "
                                 f"are {', '.join(sorted(known))}")

        self._check_train()

    def _check_train(self) -> None:
        if not isinstance(self.train, dict):
            raise ValueError(f"arm {self.name!r}: train must be a table of training fields like "
                             f"{{max_steps = 6000}}, got {self.train!r}")
        known = {f.name for f in dataclasses.fields(TrainConfig)} - _SHARED_TRAIN
        for key in self.train:
            if key not in known:
                close = difflib.get_close_matches(str(key), sorted(known), n=1, cutoff=0.6)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                rule = ("every arm shares it (the [train] section's)" if key in _SHARED_TRAIN
                        else "not a training field")
                raise ValueError(f"arm {self.name!r}: cannot change train.{key}{hint}: {rule}; an arm may change "
                                 f"{', '.join(sorted(known))}")

    def train_config(self, recipe: TrainConfig) -> TrainConfig:
        """This arm's recipe: the study's `recipe` with the arm's own `train` changes (a ValueError naming the arm
        when the result is invalid)."""
        if not self.train:
            return recipe
        try:
            return dataclasses.replace(recipe, **self.train)
        except (ValueError, TypeError) as e:
            raise ValueError(f"arm {self.name!r}: its train overrides make an invalid recipe: {e}") from None

    def config(self, spec: DiffTransformerConfig) -> DiffTransformerConfig:
        """This arm's model at the size `spec` (a ValueError naming the arm when the result is invalid). A spec's
        lambda_init is for the arms with a scalar λ: the others are derived without it (an arm's own is refused)."""
        if spec.lambda_init is not None and not attention_kind(self.attention).scalar_lambda:
            spec = dataclasses.replace(spec, lambda_init=None)
        cfg = spec.matched(self.attention)
        changes = dict(self.overrides)
        if self.heads == "diff":
            diff = spec.matched("diff")
            changes = {"num_attention_heads": diff.num_attention_heads,
                       "num_key_value_heads": diff.num_key_value_heads, **changes}
        try:
            return dataclasses.replace(cfg, **changes) if changes else cfg
        except (ValueError, TypeError) as e:
            raise ValueError(f"arm {self.name!r} is not a valid model at this size: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _arm(name: str, attention: str, description: str, heads: str = "own", **overrides: Any) -> Arm:
    return Arm(name, attention, overrides, heads, description)


# The paper's Table 6 (1.4B, valid loss), DIFF V2, and the gated-attention control, by name.
ABLATIONS: dict[str, Arm] = {a.name: a for a in (
    _arm("diff", "diff", "DIFF Transformer V1 (Table 6: 'DIFF Transformer')"),
    _arm("transformer", "transformer", "the matched Transformer, 2h heads of d (Table 6: 'Transformer')"),
    _arm("transformer_diff_heads", "transformer", "the Transformer with DIFF's head count, h heads of 2d "
         "(Table 6: 'Transformer, 8 heads of 256')", heads="diff"),
    _arm("transformer_diff_heads_headnorm", "transformer_headnorm", "the Transformer with DIFF's head count "
         "and a head-wise RMSNorm (Table 6: 'Transformer + GroupNorm')", heads="diff"),
    _arm("transformer_headnorm", "transformer_headnorm", "the matched Transformer (2h heads of d) with a "
         "head-wise RMSNorm"),
    _arm("diff_no_headnorm", "diff_no_headnorm", "DIFF without the head-wise RMSNorm (Table 6: '- GroupNorm')"),
    _arm("diff_lambda_0.8", "diff", "DIFF with a constant λ_init = 0.8 (Table 6)", lambda_init=0.8),
    _arm("diff_lambda_0.5", "diff", "DIFF with a constant λ_init = 0.5 (Table 6)", lambda_init=0.5),
    _arm("diff_v2", "diff_v2", "DIFF V2 (2H query heads paired in-group, per-token sigmoid λ, no head norm)"),
    _arm("transformer_gated", "transformer_gated", "control (not in the paper): the matched Transformer with "
         "a head-wise sigmoid gate on the attention output (Gated Attention, Qiu et al. 2025)"),
)}


def parse_arm(entry: Any) -> Arm:
    """An arm from a config entry: a named ablation, a bare attention kind, or a table."""
    if isinstance(entry, Arm):
        return entry
    if isinstance(entry, str):
        name = entry.strip()
        if name in ABLATIONS:
            return ABLATIONS[name]
        try:
            kind = attention_kind(name, what="arm")
        except ValueError:
            choices = sorted(set(ABLATIONS) | set(_kinds()))
            close = difflib.get_close_matches(name, choices, n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"unknown arm {name!r}{hint}; name an ablation ({', '.join(ABLATIONS)}), an attention "
                             f"kind, or give a table {{name, attention, overrides}}") from None
        return Arm(name, kind.name, description=kind.description)
    if isinstance(entry, dict):
        unknown = sorted(set(entry) - set(_ARM_KEYS))
        if unknown or "name" not in entry or "attention" not in entry:
            raise ValueError(f"an arm table needs `name` and `attention` (and may have overrides, heads, "
                             f"description, train); got keys {sorted(entry)}")
        arm = Arm(entry["name"], entry["attention"], dict(entry.get("overrides") or {}), entry.get("heads", "own"),
                  entry.get("description", ""), _copy(entry.get("train") or {}))
        named = ABLATIONS.get(arm.name)  # a named arm on its own recipe keeps the name's description
        if not arm.description and named and (named.attention, named.overrides, named.heads) == (
                arm.attention, arm.overrides, arm.heads):
            arm = dataclasses.replace(arm, description=named.description)
        return arm
    raise ValueError(f"an arm is a name (e.g. 'diff') or a table {{name, attention, overrides}}, got {entry!r}")


def _copy(table: Any) -> Any:
    """A dict's own copy (the arm keeps no reference into a config); anything else as is, for Arm to refuse."""
    return dict(table) if isinstance(table, dict) else table


def _kinds() -> list[str]:
    from difftransformer.model import ATTENTION_KINDS

    return list(ATTENTION_KINDS)
