"""A study's typed config: the [compare] section of a run config.

The size spec, training recipe and data come from the [model], [train] and [data] sections; this
adds what makes it a study: arms (ablations.py: name, attention kind, overrides) x training seeds x
sizes x token budgets, the evaluation tasks run on every finished unit, where each unit's small
result file goes (results_dir, committable), and the settings of the report's sample generations.

    arms = ["diff", "transformer", "diff_lambda_0.8"]    # named ablations or attention kinds, or tables
    seeds = [0, 1, 2]
    sizes = ["cpu-small-h8", {name = "w192", hidden_size = 192, num_hidden_layers = 4, diff_heads = 6}]
    tokens = [500_000, 1_000_000]                        # training tokens per run (max_steps derived)

No sizes: the [model] section is the one size. No tokens: train.max_steps is the one budget.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from difftransformer.experiments.ablations import Arm, parse_arm
from difftransformer.model import PRESETS, DiffTransformerConfig, Preset


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


_SIZE_KEYS = ("name", "preset", "hidden_size", "num_hidden_layers", "diff_heads", "diff_kv_heads",
              "intermediate_size")


@dataclass(frozen=True)
class Size:
    """One model size of a scaling grid: a preset's shape, or a table of the shape fields (DIFF heads).

    Only the shape changes; vocabulary, context, λ schedule and backend stay the [model] section's."""

    name: str
    hidden_size: int
    num_hidden_layers: int
    diff_heads: int
    diff_kv_heads: int | None = None
    intermediate_size: int | None = None  # None: round(8/3 * hidden_size)

    def spec(self, base: DiffTransformerConfig) -> DiffTransformerConfig:
        """`base` (any kind) with this shape, as a DIFF-unit spec that arms are derived from."""
        diff = base.matched("diff")
        try:
            return dataclasses.replace(diff, hidden_size=self.hidden_size, num_hidden_layers=self.num_hidden_layers,
                                       num_attention_heads=self.diff_heads,
                                       num_key_value_heads=self.diff_kv_heads or self.diff_heads,
                                       intermediate_size=self.intermediate_size)
        except ValueError as e:
            raise ValueError(f"size {self.name!r} is not a valid model: {e}") from None


def parse_size(entry: Any) -> Size:
    """A size from a config entry: a preset name or a table of shape fields (with a name)."""
    if isinstance(entry, Size):
        return entry
    if isinstance(entry, str):
        if entry not in PRESETS:
            import difflib

            close = difflib.get_close_matches(entry, list(PRESETS), n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"compare.sizes: unknown preset {entry!r}{hint}; name a preset ({', '.join(PRESETS)}) "
                             f"or give a table {{name, hidden_size, num_hidden_layers, diff_heads}}")
        return _from_preset(entry, PRESETS[entry])
    if isinstance(entry, dict):
        unknown = sorted(set(entry) - set(_SIZE_KEYS))
        if unknown or "name" not in entry:
            raise ValueError(f"compare.sizes: a size table needs `name` and either `preset` or hidden_size, "
                             f"num_hidden_layers, diff_heads (optional diff_kv_heads, intermediate_size); "
                             f"unknown keys {unknown}" if unknown else f"compare.sizes: a size table needs a "
                             f"`name`, got {entry!r}")
        fields = {k: v for k, v in entry.items() if k not in ("name", "preset")}
        if "preset" in entry:
            base = parse_size(entry["preset"])
            fields = {**{k: getattr(base, k) for k in _SIZE_KEYS[2:]}, **fields}
        missing = [k for k in ("hidden_size", "num_hidden_layers", "diff_heads") if k not in fields]
        if missing:
            raise ValueError(f"compare.sizes: size {entry['name']!r} lacks {', '.join(missing)}")
        for k, v in fields.items():
            if v is not None and (not _natural(v) or v == 0):
                raise ValueError(f"compare.sizes: size {entry['name']!r} has {k} = {v!r}; it must be a positive "
                                 f"integer")
        return Size(_folder_name(entry["name"]), **fields)
    raise ValueError(f"compare.sizes: a size is a preset name or a table, got {entry!r}")


def _folder_name(name: Any) -> str:
    """A size's name, which names its folder under the study (and under results_dir): one plain folder
    name, so that no unit is written outside the study or into another unit's place."""
    text = str(name)
    if isinstance(name, bool) or not text.strip() or "/" in text or "\\" in text or text.startswith("."):
        raise ValueError(f"compare.sizes: size name {name!r} must be a non-empty folder name (no '/' or '\\', not "
                         f"starting with '.'), e.g. 'w192'")
    return text


def _from_preset(name: str, p: Preset) -> Size:
    return Size(name, p.hidden_size, p.num_hidden_layers, p.diff_heads, p.diff_kv_heads, p.intermediate_size)


@dataclass
class StudyConfig:
    """What `difftransformer compare` runs: arms (attention kinds) x training seeds, and the report's samples."""

    arms: list[Any] = field(default_factory=lambda: ["diff", "transformer"])  # -> list[Arm] (ablations.py)
    seeds: list[int] | None = None  # training seeds; None: the single seed train.seed
    sizes: list[Any] = field(default_factory=list)  # -> list[Size]; empty: the [model] section's size only
    tokens: list[int] = field(default_factory=list)  # training tokens per run; empty: train.max_steps
    out_dir: str = "runs/compare"
    results_dir: str | None = None  # each unit's result JSON (committable); None: <out_dir>/results
    prompts: list[str] = field(default_factory=lambda: [
        "The state of the Union is", "My fellow citizens,", "Congress must"])
    sample_tokens: int = 48
    temperature: float = 0.8  # for the one sampled continuation per prompt (greedy is always shown)
    top_k: int | None = 50
    sample_seed: int = 0  # seeds the report's sampled continuations (not training)
    eval_tasks: list[str] = field(default_factory=list)  # evaluation tasks run on every finished arm
    # options of those tasks, by task name ([compare.eval_options.ood] lengths = [1, 2, 4, 8]); a task not named
    # here runs with its defaults
    eval_options: dict[str, Any] = field(default_factory=dict)
    # results folders of other studies whose units may stand in for this study's: a unit with the same
    # (size, tokens, seed, arm), the same identity (model, recipe, data) and every task of eval_tasks
    # evaluated is copied instead of trained again (ablations-cpu takes paper-cpu's three shared arms)
    reuse: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.arms, str):
            self.arms = [a.strip() for a in self.arms.split(",") if a.strip()]
        if not isinstance(self.arms, list):
            raise ValueError(f"compare.arms must be a list of arms like [\"diff\", \"transformer\"], got {self.arms!r}")
        self.arms = [parse_arm(a) for a in self.arms]
        if isinstance(self.seeds, int) and not isinstance(self.seeds, bool):
            self.seeds = [self.seeds]
        elif isinstance(self.seeds, str):
            self.seeds = parse_int_list(self.seeds, "compare.seeds")
        if not self.arms:
            raise ValueError("compare.arms is empty; give at least one attention kind, e.g. ['diff', 'transformer']")
        names = self.arm_names
        if len(set(names)) != len(names):
            raise ValueError(f"compare.arms lists an arm twice: {names}")
        if self.seeds is not None:
            if self.seeds == []:  # not "no seeds given": that is leaving the key out
                raise ValueError("compare.seeds is empty; give training seeds like [0, 1, 2], or leave seeds out "
                                 "to train with the single seed train.seed")
            if not isinstance(self.seeds, list) or not all(_natural(s) and s < 2**32 for s in self.seeds):
                raise ValueError(f"compare.seeds must be a list of integers in [0, 2**32) like [0, 1, 2], "
                                 f"got {self.seeds!r}")
            if len(set(self.seeds)) != len(self.seeds):
                raise ValueError(f"compare.seeds lists a seed twice: {self.seeds}")
        self._check_grid()
        self._check_samples()
        self._check_eval_tasks()

    @property
    def arm_names(self) -> list[str]:
        return [a.name for a in self.arms]

    def arm(self, name: str) -> Arm:
        return next(a for a in self.arms if a.name == name)

    def _check_grid(self) -> None:
        if not isinstance(self.sizes, list):
            raise ValueError(f"compare.sizes must be a list of presets or size tables, got {self.sizes!r}")
        self.sizes = [parse_size(s) for s in self.sizes]
        names = [s.name for s in self.sizes]
        if len(set(names)) != len(names):
            raise ValueError(f"compare.sizes lists a size name twice: {names}")
        if isinstance(self.tokens, str):
            self.tokens = parse_int_list(self.tokens.replace("_", ""), "compare.tokens")
        if not isinstance(self.tokens, list) or not all(_natural(t) and t > 0 for t in self.tokens):
            raise ValueError(f"compare.tokens must be a list of positive token budgets like [500_000, 1_000_000], "
                             f"got {self.tokens!r}")
        if len(set(self.tokens)) != len(self.tokens):
            raise ValueError(f"compare.tokens lists a budget twice: {self.tokens}")
        self.tokens = sorted(self.tokens)
        if self.results_dir is not None and (not isinstance(self.results_dir, str) or not self.results_dir):
            raise ValueError(f"compare.results_dir must be a folder path or null, got {self.results_dir!r}")
        if not isinstance(self.reuse, list) or not all(isinstance(r, str) and r for r in self.reuse):
            raise ValueError(f"compare.reuse must be a list of other studies' results folders like "
                             f"[\"results/paper-cpu\"], got {self.reuse!r}")

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
        if self.eval_options is None:  # `--set compare.eval_options=null`: every task on its defaults
            self.eval_options = {}
        if not isinstance(self.eval_options, dict) or not all(isinstance(v, dict) for v in self.eval_options.values()):
            raise ValueError(f"compare.eval_options must be a table of tables, one per task ([compare.eval_options."
                             f"ood] lengths = [1, 2]), got {self.eval_options!r}")
        for name, options in self.eval_options.items():
            if name not in self.eval_tasks:
                raise ValueError(f"compare.eval_options.{name}: {name!r} is not in compare.eval_tasks "
                                 f"{self.eval_tasks}; add it there or remove its options (on the command line: "
                                 f"--set compare.eval_options=null)")
            try:
                get_task(name, **options)
            except (TypeError, ValueError) as e:
                raise ValueError(f"compare.eval_options.{name}: {e}") from None

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
