"""A comparison study's typed config: the [compare] section of a run config.

The size spec, training recipe and data come from the [model], [train] and [data] sections; this
adds what makes it a study: the arms (attention kinds at that size), the training seeds, the
settings of the report's sample generations, and the evaluation tasks run on every finished arm.
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


def _natural(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def baseline_arm(arms: list[str]) -> str:
    """The arm that differences are taken against: `transformer` when it is run, else the last arm."""
    return "transformer" if "transformer" in arms else arms[-1]


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
    eval_tasks: list[str] = field(default_factory=list)  # evaluation tasks run on every finished arm (defaults)

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
        if self.seeds is not None:
            if not isinstance(self.seeds, list) or not all(_natural(s) and s < 2**32 for s in self.seeds):
                raise ValueError(f"compare.seeds must be a list of integers in [0, 2**32) like [0, 1, 2], "
                                 f"got {self.seeds!r}")
            if len(set(self.seeds)) != len(self.seeds):
                raise ValueError(f"compare.seeds lists a seed twice: {self.seeds}")
        self._check_samples()
        self._check_eval_tasks()

    def _check_eval_tasks(self) -> None:
        if isinstance(self.eval_tasks, str):
            self.eval_tasks = [t.strip() for t in self.eval_tasks.split(",") if t.strip()]
        if not isinstance(self.eval_tasks, list) or not all(isinstance(t, str) for t in self.eval_tasks):
            raise ValueError(f"compare.eval_tasks must be a list of task names like [\"needle\", \"outliers\"], "
                             f"got {self.eval_tasks!r}")
        from difftransformer.eval import get_task

        for name in self.eval_tasks:
            try:
                get_task(name)
            except ValueError as e:
                raise ValueError(f"compare.eval_tasks: {e}") from None

    def _check_samples(self) -> None:
        if isinstance(self.prompts, str) or not isinstance(self.prompts, list) or \
                not all(isinstance(p, str) for p in self.prompts):
            raise ValueError(f"compare.prompts must be a list of strings like [\"My fellow citizens,\"], "
                             f"got {self.prompts!r}")
        if not _natural(self.sample_tokens) or self.sample_tokens == 0:
            raise ValueError(f"compare.sample_tokens must be a positive integer, got {self.sample_tokens!r}")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not 0 <= self.temperature < float("inf"):
            raise ValueError(f"compare.temperature must be a number >= 0 (0 is greedy), got {self.temperature!r}")
        if self.top_k is not None and (not _natural(self.top_k) or self.top_k == 0):
            raise ValueError(f"compare.top_k must be a positive integer or null, got {self.top_k!r}")
        if not _natural(self.sample_seed):
            raise ValueError(f"compare.sample_seed must be an integer >= 0, got {self.sample_seed!r}")

    def samples(self) -> dict[str, Any]:
        """The report's sample-generation settings, as recorded in the study manifest."""
        return {k: getattr(self, k) for k in ("prompts", "sample_tokens", "temperature", "top_k", "sample_seed")}

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
