"""A comparison study's typed config: the [compare] section of a run config.

The size spec, training recipe and data come from the [model], [train] and [data] sections; this
adds what makes it a study: the arms (attention kinds at that size), the training seeds, and the
settings of the report's sample generations.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from difftransformer.model import attention_kind


def parse_int_list(text: str, what: str) -> list[int]:
    """'0,1,2' -> [0, 1, 2]; anything else is a ValueError naming `what`."""
    try:
        return [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"{what} must be comma-separated integers like 0,1,2; got {text!r}") from None


@dataclass
class CompareConfig:
    """What `difftransformer compare` runs: arms (attention kinds) x training seeds, and the report's samples."""

    arms: list[str] = field(default_factory=lambda: ["diff", "transformer"])
    seeds: list[int] | None = None  # training seeds; None: the single seed train.seed
    out_dir: str = "runs/compare"
    prompts: list[str] = field(default_factory=lambda: [
        "The state of the Union is", "My fellow citizens,", "Congress must"])
    sample_tokens: int = 48
    temperature: float = 0.8  # for the one sampled continuation per prompt (greedy is always shown)
    top_k: int | None = 50
    sample_seed: int = 0  # seeds the report's sampled continuations (not training)

    def __post_init__(self) -> None:
        if isinstance(self.arms, str):
            self.arms = [a.strip() for a in self.arms.split(",") if a.strip()]
        if isinstance(self.seeds, int) and not isinstance(self.seeds, bool):
            self.seeds = [self.seeds]
        elif isinstance(self.seeds, str):
            self.seeds = parse_int_list(self.seeds, "compare.seeds")
        if not self.arms:
            raise ValueError("compare.arms is empty; give at least one attention kind, e.g. ['diff', 'transformer']")
        for arm in self.arms:
            attention_kind(arm, what="arm")  # arms are attention kinds
        if len(set(self.arms)) != len(self.arms):
            raise ValueError(f"compare.arms lists an arm twice: {self.arms}")
        if self.seeds is not None and len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"compare.seeds lists a seed twice: {self.seeds}")

    @property
    def baseline(self) -> str:
        """The arm differences are taken against: `transformer` when it is run, else the last arm."""
        return "transformer" if "transformer" in self.arms else self.arms[-1]

    def samples(self) -> dict[str, Any]:
        """The report's sample-generation settings, as recorded in the study manifest."""
        return {k: getattr(self, k) for k in ("prompts", "sample_tokens", "temperature", "top_k", "sample_seed")}

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
