"""The sections of report.md, each a function from the study (`Context`) to Markdown lines.

Every number in a section is read from disk (the study manifest and each run's logs); nothing is
recomputed from configs. The verdict never claims more than the paired differences support.
"""

from __future__ import annotations

import datetime as dt
import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from difftransformer.eval import TASKS
from difftransformer.eval.paper import paper_number
from difftransformer.experiments.evaluate import outdated_evaluations
from difftransformer.experiments.report.fmt import (
    Lines,
    code_span,
    direction,
    fmt_ci,
    fmt_ms,
    fmt_num,
    holm_readings,
    md_name,
    metric_values,
    table,
)
from difftransformer.experiments.report.ood_view import TASK as OOD_TASK
from difftransformer.experiments.report.recipes import (
    NOT_RECORDED,
    OTHER_RECIPE,
    arm_kind,
    matched_arm,
    recipe_mark,
    same_recipe,
)
from difftransformer.experiments.report.runs import Run, finished_val
from difftransformer.experiments.stats import compare_paired, format_p, number_format, paired_differences, verdict_text
from difftransformer.experiments.study_dir import LAMBDA_PLOT_FILE, LOSS_PLOT_FILE, StudyDir
from difftransformer.experiments.units import cell_label
from difftransformer.model import ATTENTION_KINDS
from difftransformer.train.run_dir import CHECKPOINTS_DIR, FINAL_DIR, METRICS_FILE, TENSORBOARD_DIR


@dataclass
class Context:
    """What every section reads: the study folder, its manifest, arms, seeds and runs."""

    study: StudyDir
    manifest: dict[str, Any]
    arms: list[str]
    seeds: list[int]
    baseline: str
    runs: dict[tuple[str, int], Run]  # the headline cell's runs (the largest size and budget of a grid)
    cells: dict[tuple[str | None, int | None], dict[tuple[str, int], Run]] = None  # every cell of the grid
    headline: tuple[str | None, int | None] = (None, None)
    memo: dict[Any, Any] = field(default_factory=dict)  # results computed once per report (scaling fits)

    def __post_init__(self) -> None:
        if self.cells is None:
            self.cells = {self.headline: self.runs}

    @property
    def grid(self) -> bool:
        return len(self.cells) > 1

    def every_run(self) -> dict[tuple[Any, tuple[str, int]], Run]:
        """Every run of every cell of the grid, keyed by (cell, (arm, seed)); one cell's outside a grid."""
        return {(cell, key): run for cell, runs in self.cells.items() for key, run in runs.items()}

    def spec(self, arm: str) -> dict[str, Any]:
        """The arm's definition (name, attention, overrides, heads, description, train) from the manifest."""
        return (self.manifest.get("arm_specs") or {}).get(arm) or {"name": arm, "attention": arm}

    @property
    def task_study(self) -> bool:
        """Whether the study trains on a synthetic task (its loss is on answer tokens, not language modelling)."""
        return bool((self.manifest.get("data") or {}).get("task"))

    @property
    def others(self) -> list[str]:
        return [a for a in self.arms if a != self.baseline]

    def arm_runs(self, arm: str) -> list[Run]:
        return [self.runs[arm, s] for s in self.seeds if (arm, s) in self.runs]

    def comparison(self, arm: str):
        """The paired comparison of `arm`'s final val loss with the baseline's (stats.PairedComparison)."""
        return compare_paired(finished_val(self.runs, arm, self.seeds), finished_val(self.runs, self.baseline,
                              self.seeds), arm=arm, baseline=self.baseline)

    def paired(self, arm: str) -> list[float]:
        """arm − baseline final val loss per seed, over the seeds where both have finished."""
        return paired_differences(finished_val(self.runs, arm, self.seeds),
                                  finished_val(self.runs, self.baseline, self.seeds))


# ----------------------------------------------------------------------------------------------
# formatting


def _code(text: str) -> str:
    return "```text\n" + text.replace("```", "'''").strip("\n") + "\n```"


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


# ----------------------------------------------------------------------------------------------
# sections


def header(ctx: Context) -> Lines:
    title = " vs ".join(map(md_name, ctx.arms)) if len(ctx.arms) <= 3 else f"{len(ctx.arms)} arms"
    L = [f"# {'Study' if ctx.grid or len(ctx.arms) > 2 else 'Side-by-side comparison'}: {title}", ""]
    L += [f"Report written {dt.datetime.now().astimezone().isoformat(timespec='seconds')} from `{ctx.study.path}`. "
          f"Seeds: {', '.join(map(str, ctx.seeds))}; the baseline for differences is {code_span(ctx.baseline)}.", ""]
    if ctx.grid:
        L += [f"The grid has {len(ctx.cells)} cells (sizes × token budgets); the sections up to \"Scaling\" are "
              f"for the largest one, {cell_label(ctx.headline)}.", ""]
    unfinished, missing = _incomplete(ctx)
    if unfinished or missing:
        L += ["> **Incomplete:** " + "; ".join(
            ([f"not finished: {', '.join(unfinished)}"] if unfinished else [])
            + ([f"not started: {', '.join(missing)}"] if missing else []))
            + ". Final-loss statistics below use finished runs only; re-run the same command to continue.", ""]
    return L


def _incomplete(ctx: Context) -> tuple[list[str], list[str]]:
    """The runs not finished and the (arm, seed) units not started, over EVERY cell of a grid (R21: a unit
    missing from a smaller size or budget changes the scaling fits as much as one of the headline cell);
    a grid's entries name their cell."""
    unfinished, missing = [], []
    for cell, runs in ctx.cells.items():
        where = f"{cell_label(cell)}: " if ctx.grid else ""
        unfinished += [f"{where}{md_name(r.arm)} (seed {r.seed}): step {r.last_step} of {r.max_steps}"
                       for r in runs.values() if not r.finished]
        missing += [f"{where}{md_name(a)} (seed {s})" for a in ctx.arms for s in ctx.seeds if (a, s) not in runs]
    return unfinished, missing


def verdicts(ctx: Context) -> Lines:
    L = ["## Verdict", ""]
    if not ctx.others:
        L += [f"Only one arm ({code_span(ctx.baseline)}) was run, so there is nothing to compare.", ""]
    for arm in ctx.others:
        L += [_verdict(ctx, arm), ""]
    if ctx.task_study:
        return L  # the paper's language-modelling numbers below say nothing about a synthetic task's loss
    L += ["For context (not a prediction for this run): the paper's 1.4B-parameter ablation reports a validation "
          "loss of 3.062 for DIFF against 3.087 for the matched Transformer (a gap of about 0.025 nats), and an "
          "independent small-scale reproduction (30M parameters, 5 seeds, paired initialisation) measured DIFF − "
          "Transformer = −0.016 ± 0.023, inside seed noise, with DIFF behind early in training. Differences at this "
          "project's CPU scale are expected to be inside seed noise too.", ""]
    return L


def _verdict(ctx: Context, arm: str) -> str:
    """The verdict on `arm` against the baseline when both trained on one recipe (`recipes.same_recipe`). An arm on
    another recipe is set against the arm of the baseline's architecture on its own recipe when the study has one
    (as the ood section's headline does: `recipes.matched_arm`); otherwise the sentence says what the difference
    mixes: the recipe alone (the same attention), recipe and architecture, or an unknown recipe with either. An
    arm (or baseline) with no run yet has nothing to compare, and no recipe to say anything of."""
    base = ctx.baseline
    same = same_recipe(ctx, arm, base)
    if same or not (ctx.arm_runs(arm) and ctx.arm_runs(base)):
        return _loss_verdict(ctx, arm, base)
    kind = arm_kind(ctx, base)
    matched = None if same is None or arm_kind(ctx, arm) == kind else matched_arm(ctx, arm, kind, ctx.arms)
    if matched:
        return (_loss_verdict(ctx, arm, matched) + f" ({md_name(matched)} has the baseline's "
                f"architecture on {md_name(arm)}'s recipe; {md_name(base)} trained on another, so a difference "
                f"from it would mix recipe and architecture.)")
    if same is None:
        why = (f" The recipe of {md_name(arm)} or {md_name(base)} is not recorded (no result file or run folder "
               f"gives it), so the difference may mix recipe and architecture.")
    elif arm_kind(ctx, arm) == kind:
        why = (f" {md_name(arm)} has {md_name(base)}'s attention on another recipe (training settings or position "
               f"encoding): the difference is the recipe's, not the architecture's.")
    else:
        why = (f" {md_name(arm)} trained on another recipe than {md_name(base)} (training settings or position "
               f"encoding), and the study has no arm of the baseline's architecture on its recipe: the difference "
               f"mixes recipe and architecture.")
    return _loss_verdict(ctx, arm, base) + why


def _loss_verdict(ctx: Context, arm: str, base: str) -> str:
    """The verdict sentence on arm − base final validation loss, from the losses themselves (`compare_paired`: what
    spread is float rounding depends on their magnitude, not the differences')."""
    cmp = compare_paired(finished_val(ctx.runs, arm, ctx.seeds), finished_val(ctx.runs, base, ctx.seeds),
                         arm=md_name(arm), baseline=md_name(base))
    return verdict_text(cmp, unit="nats")


def final_losses(ctx: Context) -> Lines:
    baseline, seeds = ctx.baseline, ctx.seeds
    params = ctx.manifest.get("parameters", {})
    base_tps = [r.tokens_per_s for r in ctx.arm_runs(baseline) if r.tokens_per_s]
    many = len(seeds) > 1
    head = ["arm", "parameters", "final val loss" + (" (mean [95% interval])" if many else ""),
            f"paired Δ vs {md_name(baseline)}" + (" [95% interval]" if many else ""), "paired t-test p",
            "train tokens/s", f"tokens/s ÷ {md_name(baseline)}"]
    rows, marks = [], set()
    for arm in ctx.arms:
        finals = list(finished_val(ctx.runs, arm, seeds).values())
        compared = arm != baseline and ctx.arm_runs(arm) and ctx.arm_runs(baseline)
        mark = recipe_mark(ctx, arm, baseline) if compared else ""
        marks.add(mark)
        tps = [r.tokens_per_s for r in ctx.arm_runs(arm) if r.tokens_per_s]
        ratio = f"{statistics.fmean(tps) / statistics.fmean(base_tps):.3f}" if tps and base_tps else "–"
        if ratio != "–" and arm != baseline and _machines(ctx, arm, baseline) > 1:
            ratio += OTHER_MACHINES
            marks.add(OTHER_MACHINES)
        count = params.get(arm) or next((r.parameters for r in ctx.arm_runs(arm) if r.parameters), None)
        p = None if arm == baseline else ctx.comparison(arm).p
        rows.append([code_span(arm) + mark, f"{count:,}" if count else "–", fmt_ci(finals),
                     "(baseline)" if arm == baseline else fmt_ci(ctx.paired(arm), 4, signed=True), format_p(p),
                     fmt_ms(tps, 0) if tps else "–", ratio])
    L = ["## Final validation loss and throughput", "", *table(head, rows), ""]
    if OTHER_RECIPE in marks:
        L += [f"\"{OTHER_RECIPE.strip()}\": trained on other settings than {code_span(baseline)} (steps, learning "
              "rate or position encoding), so its Δ is not the architecture's alone (for an arm with the baseline's "
              "attention it is the recipe's); the Verdict sets each other architecture against the baseline's on its "
              "recipe where the study has one.", ""]
    if NOT_RECORDED in marks:
        L += [f"\"{NOT_RECORDED.strip()}\": no result file or run folder records its recipe or "
              f"{code_span(baseline)}'s, so its Δ may mix recipe and architecture.", ""]
    if OTHER_MACHINES in marks:
        L += [f"\"{OTHER_MACHINES.strip()}\": the runs of the arm and of {code_span(baseline)} trained on more than "
              "one machine or world size (CPU, GPU, processes, as their result files record them), so the ratio "
              "compares machines as much as arms.", ""]
    if len(seeds) > 1:
        L += ["Per seed (final validation loss):", ""]
        L += table(["seed", *[code_span(a) for a in ctx.arms]],
                   [[str(s), *[_loss(ctx.runs.get((a, s))) for a in ctx.arms]] for s in seeds]) + [""]
    L += ["Δ is the per-seed difference arm − baseline (both arms share the initial weights and the batches of "
          "that seed), averaged over seeds; the bracket is its 95% Student-t interval over seeds and p the two-sided "
          "paired t-test; tokens/s is mean ± std over seeds. Tokens/s is the median over logged "
          "windows of training (forward, backward, optimizer step; evaluation excluded), arms run one after the "
          "other on the same machine (other processes running at the same time distort it). It depends on "
          "the attention backend of the run (config `attn_backend`; on CPU 'auto' runs both arms through this "
          "project's fused C++ kernels); the paper reports DIFF about 5-10% slower than the Transformer on H100 "
          "with its fused GPU kernels.", ""]
    return L


OTHER_MACHINES = " (other machines)"  # a tokens/s ratio over runs of more than one machine or world size


def _machines(ctx: Context, arm: str, base: str) -> int:
    """How many machines (CPU, GPU, world size) the recorded runs of `arm` and `base` whose tokens/s the ratio
    averages trained on."""
    return len({r.machine for a in (arm, base) for r in ctx.arm_runs(a) if r.tokens_per_s} - {None})


def _loss(run) -> str:
    """A run's final validation loss, small losses (a learned synthetic task's 1e-6 nats) in scientific form; an
    unfinished run's latest one says at which step (it is no final loss, and no comparison uses it)."""
    if run is None or run.final_val is None:
        return "–"
    text = number_format([run.final_val])(run.final_val)
    if not run.finished:
        text += f" (step {run.last_step:,} of {run.max_steps:,})" if run.max_steps else f" (step {run.last_step:,})"
    return text


def loss_curves(ctx: Context) -> Lines:
    return ["## Loss curves", "", f"![validation and training loss]({LOSS_PLOT_FILE})", ""]


def lambdas(ctx: Context, has_plot: bool) -> Lines:
    """λ and λ_init per layer at the end of training, as the trainer logged them (finished runs only)."""
    lam_arms = [a for a in ctx.arms if any(r.lambdas and r.finished for r in ctx.arm_runs(a))]
    if not lam_arms:
        return []
    lam_runs = [r for a in lam_arms for r in ctx.arm_runs(a) if r.lambdas and r.finished]
    n_layers = max(len(r.lambdas) for r in lam_runs)
    inits = next((r.lambda_inits for r in lam_runs if r.lambda_inits), None)
    rows = []
    for layer in range(n_layers):
        init = inits[layer] if inits and layer < len(inits) and inits[layer] is not None else None
        row = [str(layer), "–" if init is None else f"{init:.3f}"]
        for a in lam_arms:
            vals = [r.lambdas[layer] for r in ctx.arm_runs(a)
                    if r.finished and r.lambdas and layer < len(r.lambdas) and r.lambdas[layer] is not None]
            row.append(fmt_ms(vals, 3))
        rows.append(row)
    many = " (mean ± std)" if len(ctx.seeds) > 1 else ""
    L = ["## λ per layer at the end of training", ""]
    L += table(["layer", "λ_init", *[f"λ {code_span(a)}{many}" for a in lam_arms]], rows) + [""]
    L += ["λ scales the second softmax map that is subtracted from the first; it starts at λ_init "
          "(0.8 − 0.6·exp(−0.3·layer) unless a constant is configured) and is learned.", ""]
    if has_plot:
        L += [f"![lambda over training]({LAMBDA_PLOT_FILE})", ""]
    return L


def samples(ctx: Context) -> Lines:
    from difftransformer.experiments.report.samples import sample_texts

    rep = ctx.manifest.get("report", {})
    prompts = rep["prompts"] if "prompts" in rep else ["The state of the Union is", "My fellow citizens,",
                                                       "Congress must"]
    if not prompts:
        return ["## Samples", "", "(none: compare.prompts is empty)", ""]
    first_seed = ctx.seeds[0]
    sample_seed = int(rep.get("sample_seed", 0))
    L = ["## Samples", "",
         f"From each arm's final model (seed {first_seed}): greedy, and one sample at temperature "
         f"{rep.get('temperature', 0.8)} with top-k {rep.get('top_k', 50)} (generator seed {sample_seed}), up to "
         f"{rep.get('sample_tokens', 48)} new tokens. Expect repetitive, speech-flavoured text from "
         f"a model this small: the samples are a sanity check, not a quality measure.", ""]
    for arm in ctx.arms:
        run = ctx.runs.get((arm, first_seed))
        got = run and run.samples
        if run and run.dir is not None:
            got = sample_texts(run.dir, prompts, int(rep.get("sample_tokens", 48)),
                               float(rep.get("temperature", 0.8)), rep.get("top_k", 50), sample_seed) or got
        L += [f"### {code_span(arm)}", ""]
        if not got:
            L += ["(no final model yet)", ""]
            continue
        for row in got:
            L += [f"**Prompt:** {code_span(repr(row['prompt']))}", "", "greedy:", "",
                  _code(row["prompt"] + row["greedy"]), "",
                  "sampled:", "", _code(row["prompt"] + row["sampled"]), ""]
    return L


_MODEL_COLUMNS = {"attention": "attention", "num_hidden_layers": "layers", "hidden_size": "hidden",
                  "num_attention_heads": "heads", "num_key_value_heads": "kv heads", "intermediate_size": "FFN",
                  "vocab_size": "vocab", "max_position_embeddings": "context", "lambda_init": "λ_init",
                  "attn_backend": "backend", "attn_deterministic": "deterministic backward"}


def _model_cell(model: dict[str, Any], key: str) -> str:
    value = model.get(key, "–")
    kind = ATTENTION_KINDS.get(model.get("attention", ""))
    if key == "lambda_init":  # only kinds with a scalar λ have a λ_init
        if kind is None or not kind.scalar_lambda:
            return "–"
        return "0.8 − 0.6·exp(−0.3·layer)" if value is None else str(value)
    if key == "attn_deterministic":  # only the fused DIFF V1 kernel has a nondeterministic option
        if kind is None or not kind.fused_kernel or value == "–":
            return "–"
        return "yes" if value else "no (atomic dQ)"
    return str(value)


def evaluation(ctx: Context) -> Lines:
    """Each arm's evaluation results beside the baseline's and the paper's: one seed as a side-by-side
    table, several seeds as mean [95% interval] with the paired difference and its test."""
    if len(ctx.seeds) == 1 or sum((ctx.baseline, s) in ctx.runs for s in ctx.seeds) < 2:
        return _evaluation_one_seed(ctx)
    metrics = _eval_metrics(ctx)
    if not metrics:
        return []
    L = ["## Evaluation", "",
         "The paper's measurements on each arm's final model (`difftransformer eval`; protocols in "
         "docs/evaluation.md) over seeds: mean [95% interval]; Δ is the paired difference arm − baseline over the "
         "seeds both have, with its interval and the paired t-test. Holm p adjusts an arm's p-values over its rows: "
         "a separation marked \"not after Holm\" may be one of the chance results expected among that many tests; "
         "a metric that is a function of another one of its task (perplexity of the loss) is that one measurement, "
         "tested once, under its source, and one equal to an earlier one on every run (the same numbers, whatever "
         "they measure) is tested once, there. "
         "The paper's values (3B-13B models, long "
         "contexts) are a reference for direction, not a target at this scale.", "", *_outdated(ctx)]
    for arm in ctx.others:
        found = []
        for task, metric in metrics:
            base, own = metric_values(ctx, ctx.baseline, task, metric), metric_values(ctx, arm, task, metric)
            if own or base:
                found.append((task, metric, base, own,
                              compare_paired(own, base, arm=arm, baseline=ctx.baseline, metric=f"{task} {metric}")))
        tested = [f for f in found if not _source_metric(*f[:2], found)]
        readings = dict(zip(((t, m) for t, m, *_ in tested), holm_readings([f[-1] for f in tested], arm)))
        rows = []
        for task, metric, base, own, cmp in found:
            source = _source_metric(task, metric, found)
            derived = getattr(TASKS.get(task), "derived_metrics", {}).get(metric) == source
            adjusted, reading = (("–", f"tested as `{source}`" if derived else f"same values as `{source}`, tested "
                                  f"there") if source else readings[task, metric])
            paper = paper_number(task, metric)
            rows.append([f"{task}", f"`{metric}`", fmt_ci(list(base.values()), 3), fmt_ci(list(own.values()), 3),
                         fmt_ci(list(cmp.diffs), 3, signed=True) if cmp.diffs else "–",
                         "–" if source else format_p(cmp.p), adjusted,
                         reading, "–" if paper is None else f"{fmt_num(paper.transformer)} / {fmt_num(paper.diff)}"])
        L += [f"### {code_span(arm)} vs {code_span(ctx.baseline)}", ""]
        counts = {a: max((len(f[i]) for f in found), default=0) for a, i in ((ctx.baseline, 2), (arm, 3))}
        if len(set(counts.values())) > 1:  # the two mean columns average over different seeds
            L += ["The arms have different seeds so far (" + ", ".join(f"{code_span(a)} {n}" for a, n in counts.items())
                  + "): each mean is over its own seeds; Δ and its test use the seeds both arms have.", ""]
        L += table(["task", "metric", code_span(ctx.baseline), code_span(arm), "Δ [95% interval]", "p", "Holm p",
                    "reading", "paper T / DIFF"], rows) + [""]
    return L


def _source_metric(task: str, metric: str, found) -> str | None:
    """The metric of `task` that `metric` is a function of (Task.derived_metrics), when the table has it, or an
    earlier one of `task` equal to it on every run, where the runs differ (long-context's NLL within the training
    length is its final NLL when the context is the training length; two metrics at 0 everywhere are no such
    pair): one measurement, tested once."""
    source = getattr(TASKS.get(task), "derived_metrics", {}).get(metric)
    if any(t == task and m == source for t, m, *_ in found):
        return source
    mine = next(f for f in found if f[:2] == (task, metric))
    for t, m, base, own, _ in found:
        if (t, m) == (task, metric):
            return None
        varies = len({*base.values(), *own.values()}) > 1
        if t == task and varies and _same_values(base, mine[2]) and _same_values(own, mine[3]):
            return m
    return None


def _same_values(a: dict[int, float], b: dict[int, float]) -> bool:
    return a.keys() == b.keys() and all(math.isclose(a[k], b[k], rel_tol=1e-9, abs_tol=1e-12) for k in a)


def _evaluation_one_seed(ctx: Context) -> Lines:
    from difftransformer.eval.comparison import compare_table

    seed = ctx.seeds[0]
    found = {a: ctx.runs[a, seed].evals for a in ctx.arms if (a, seed) in ctx.runs}
    if (ctx.baseline, seed) not in ctx.runs or not any(found.values()):
        return []
    L = ["## Evaluation", "",
         f"The paper's measurements on each arm's final model (seed {seed}; `difftransformer eval`, results in each "
         f"run's eval/ folder and its result file, protocols in docs/evaluation.md), beside the paper's numbers for "
         f"its 3B models. One model per arm: these are observations, not verdicts.", "", *_outdated(ctx)]
    for arm in ctx.others:
        names = (f"{ctx.study.path.name}/{ctx.baseline}", f"{ctx.study.path.name}/{arm}")
        L += [compare_table(found.get(ctx.baseline, {}), found.get(arm, {}), names, (ctx.baseline, arm)), ""]
    return L


def _outdated(ctx: Context) -> Lines:
    """A note per task whose stored results some units got from another version of the task (Task.version) than
    this package's: an older one's numbers may differ from what the task measures now; a newer one's come from
    code this package does not have."""
    lines = []
    for newer, what, advice in (
            (False, "an older version of the task", "docs/evaluation.md (task versions) says what changed and which "
             "results it cannot change; `compare` evaluates them again where their models are"),
            (True, "a newer version of the task than this package's", "update the package to read them with the "
             "code that measured them (`compare` never replaces them with an older one)")):
        found: dict[str, list[str]] = {}
        every = ctx.every_run()
        for (cell, (arm, seed)), run in sorted(every.items(), key=lambda kv: (str(kv[0][0]), kv[0][1])):
            where = f"{cell_label(cell)} " if ctx.grid else ""
            for task, versions in outdated_evaluations(run.evals, list(run.evals), newer=newer).items():
                found.setdefault(f"{task} ({versions})", []).append(f"{where}{arm} seed {seed}")
        lines += [f"- **{task}** was computed by {what} for {len(units)} of {len(every)} units "
                  f"({', '.join(units[:4])}{', ...' if len(units) > 4 else ''}): {advice}."
                  for task, units in found.items()]
    return [*lines, ""] if lines else []


def _eval_metrics(ctx: Context) -> list[tuple[str, str]]:
    """(task, metric) of every numeric headline metric any run has, in a stable order; `ood`'s are left to
    their own section, which holds out the runs below its in-distribution bar (ood_view)."""
    seen: dict[tuple[str, str], None] = {}
    for run in ctx.runs.values():
        for task, result in sorted(run.evals.items()):
            if task == OOD_TASK:
                continue
            for metric, value in (result.get("metrics") or {}).items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    seen[task, metric] = None
    return list(seen)


def ablations(ctx: Context) -> Lines:
    """The paper's Table 6 at our scale: every arm's final val loss and its paired difference, beside the paper."""
    if len(ctx.arms) < 3:
        return []
    paper = None if ctx.task_study else paper_number("lm", "final_val_loss")  # Table 6 is language modelling
    rows = []
    for arm in ctx.arms:
        spec = ctx.spec(arm)
        finals = list(finished_val(ctx.runs, arm, ctx.seeds).values())
        cmp = None if arm == ctx.baseline else ctx.comparison(arm)
        pv = (paper.arms or {}).get(arm) if paper else None
        rows.append([code_span(arm), spec.get("description") or spec.get("attention", ""), fmt_ci(finals),
                     "(baseline)" if cmp is None else fmt_ci(list(cmp.diffs), 4, signed=True),
                     "–" if cmp is None else format_p(cmp.p), "–" if cmp is None else direction(cmp.outcome, arm),
                     *([] if paper is None else ["–" if pv is None else f"{pv:.3f}"])])
    own = [md_name(a) for a in ctx.arms if ctx.spec(a).get("train")]
    recipe = "recipe" if not own else f"recipe (but {', '.join(own)}, trained on its own: see Training)"
    L = ["## Ablations", "", f"Every arm at the same size and {recipe}, paired by seed with {code_span(ctx.baseline)} "
         f"(final validation loss; mean [95% interval] over seeds)."
         + ("" if paper is None else " The paper's column is its Table 6 (1.4B parameters, 10B tokens): its "
            "differences are 0.001-0.06 nats, far below what seed noise lets a small study resolve unless the "
            "interval says otherwise."), ""]
    return L + table(["arm", "what it is", "final val loss", f"Δ vs {code_span(ctx.baseline)}", "p", "reading",
                      *([] if paper is None else ["paper (Table 6)"])], rows) + [""]


def scaling(ctx: Context, has_plot: bool) -> Lines:
    """Final val loss over the grid, the power-law fits and the paper's headline read off them."""
    from difftransformer.experiments.report.scaling_view import scaling_lines

    return scaling_lines(ctx, has_plot) if ctx.grid else []


def claims(ctx: Context) -> Lines:
    """Each of the paper's claims this study measured, our interval beside the paper's direction, a verdict."""
    from difftransformer.experiments.report.claims import claim_lines

    return claim_lines(ctx)


def what_was_run(ctx: Context) -> Lines:
    m = ctx.manifest
    L = ["## What was run", ""]
    if m.get("command"):
        L += [f"Command: `{m['command']}`" + (f" (config `{m['config_file']}`)" if m.get("config_file") else ""), ""]
    key = (lambda a: f"{ctx.headline[0]}/{a}") if ctx.headline[0] else (lambda a: a)
    models = m.get("models") or {}
    models = {a: models.get(key(a)) or next((r.model for r in ctx.arm_runs(a)), {}) for a in ctx.arms}
    params = m.get("parameters", {})
    rows = [[code_span(a), *[_model_cell(models.get(a, {}), k) for k in _MODEL_COLUMNS],
             f"{params[key(a)]:,}" if key(a) in params else "–"] for a in ctx.arms]
    L += table(["arm", *_MODEL_COLUMNS.values(), "parameters"], rows) + [""]
    L += ["Heads count the arm's own kind: a DIFF head holds two softmax maps, so DIFF has half the heads of its "
          "matched Transformer at the same head_dim; parameter counts differ only by the λ vectors and the "
          "head-wise norm.", ""]
    return L + _recipe(ctx) + _provenance(ctx)


def _recipe(ctx: Context) -> Lines:
    """The training recipe and the data, as recorded in the manifest; an arm's own recipe as its runs record it."""
    L: Lines = []
    tr = ctx.manifest.get("train") or {}
    own = {arm: changes for arm in ctx.arms if (changes := _own_recipe(ctx, arm, tr))}
    if tr:
        shared = "every arm but " + ", ".join(md_name(a) for a in own) if own else "identical for every arm"
        L += [f"Training ({shared}): {_steps_text(tr, ctx.manifest.get('tokens') or [])}; "
              f"AdamW (β1 {tr.get('beta1')}, β2 "
              f"{tr.get('beta2')}, weight decay {tr.get('weight_decay')}), lr {tr.get('lr')} → {tr.get('min_lr')} "
              f"({tr.get('lr_schedule')}, {tr.get('warmup_steps')} warmup steps), grad clip {tr.get('grad_clip')}, "
              f"precision {tr.get('precision')}; validation every {tr.get('eval_interval')} steps on "
              f"{tr.get('eval_batches')} batches.", ""]
    if own:
        changed = "; ".join(f"{md_name(a)}: " + ", ".join(f"{k} {v}" for k, v in changes.items())
                            for a, changes in own.items())
        L += [f"Arms on their own recipe (the study's with these changes): {changed}.", ""]
    data = ctx.manifest.get("data") or {}
    if data:
        nt, nd = data.get("num_tokens", {}), data.get("num_documents", {})
        split_seed = data.get("split_seed", data.get("seed"))  # manifests before the rename said "seed"
        L += [f"Data: corpus `{data.get('corpus')}` prepared in `{data.get('data_dir')}`; byte-level BPE with "
              f"{data.get('vocab_size')} tokens trained on the train split; split by document "
              f"(val {data.get('val_fraction')}, test {data.get('test_fraction')}, split seed {split_seed}): "
              + ", ".join(f"{s} {nd.get(s, '?')} documents / {nt.get(s, 0):,} tokens" for s in ("train", "val", "test"))
              + ".", ""]
        if tr and nt.get("val"):
            windows = min(max(nt["val"] - 1, 0) // tr["seq_len"], tr["eval_batches"] * tr["batch_size"])
            L += [f"Validation loss: token-weighted mean over the first {windows:,} non-overlapping windows of the "
                  f"val split ({windows * tr['seq_len']:,} of its {nt['val']:,} tokens), the same windows for every "
                  f"arm and every evaluation.", ""]
    return L


def _own_recipe(ctx: Context, arm: str, shared: dict[str, Any]) -> dict[str, Any]:
    """The arm's training settings that differ from the study's: as its result files or run folders record them
    (`Run.identity`: what was run, whatever the manifest says), else the manifest's arm spec. With token budgets
    max_steps follows the budget."""
    recorded = [(run.seed, train) for run in ctx.arm_runs(arm) if (train := (run.identity or {}).get("train"))]
    if not recorded:
        return dict(ctx.spec(arm).get("train") or {})
    skip = {"seed"} | ({"max_steps"} if ctx.manifest.get("tokens") else set())
    changes = [(seed, {k: v for k, v in r.items() if k in shared and k not in skip and shared[k] != v})
               for seed, r in recorded]
    if all(c == changes[0][1] for _, c in changes):
        return changes[0][1]
    return {"per seed": "; ".join(f"seed {seed} " + (", ".join(f"{k} {v}" for k, v in c.items()) or "the study's")
                                  for seed, c in changes)}


def _steps_text(tr: dict, budgets: list[int]) -> str:
    """Steps and tokens per run of the shared recipe (arms on their own recipe are listed apart): its max_steps,
    or with token budgets the steps of each budget (ceil(tokens / tokens per step), as `Study.train_for` sets
    them)."""
    per_step = (tr.get("batch_size") or 0) * (tr.get("seq_len") or 0)
    head = f"{tr.get('batch_size')} sequences × {tr.get('seq_len')} tokens per step"
    if budgets and per_step:
        return head + ", " + ", ".join(f"{-(-b // per_step)} steps for the {b:,}-token budget" for b in budgets)
    return f"{tr.get('max_steps')} steps × {head} = {per_step * (tr.get('max_steps') or 0):,} training tokens per run"


def _rel(path, root) -> str:
    try:
        return str(path.relative_to(root))
    except ValueError:
        return str(path)


def _provenance(ctx: Context) -> Lines:
    """Hardware, wall times, dates and where the run folders are."""
    m, L = ctx.manifest, []
    hw = m.get("hardware") or {}
    if hw:
        dev = f"GPU {hw['gpu']} × {hw.get('gpu_count', 1)}" if hw.get("gpu") else "CPU only"
        subnormals = f", subnormal floats {hw['denormals']}" if "denormals" in hw else ""  # recorded since 2026-11-29
        L += [f"Hardware: {dev}; CPU {hw.get('cpu')} ({hw.get('cpu_count')} logical cores, {hw.get('torch_threads')} "
              f"torch threads{subnormals}); world size {hw.get('world_size', 1)}; torch {hw.get('torch')}, Python "
              f"{hw.get('python')}; {hw.get('platform')}.", ""]
    walls = m.get("wall_s") or {}
    if walls:
        L += ["Training wall time per run (its train calls: set-up, training, validation passes, checkpoints and "
              "final weights, a call killed before it finished up to the checkpoint the next one resumed from; not "
              "the evaluations): "
              + ", ".join(f"{md_name(k)} {_duration(v)}" for k, v in walls.items()) + ".", ""]
    if m.get("started"):
        L += [f"Started {m['started']}" + (f", finished {m['finished']}" if m.get("finished") else "") + ".", ""]
    every = list(ctx.every_run().values())  # every cell of a grid, not the headline's
    folders = [r.dir.path for r in every if r.dir is not None]
    if folders:
        L += ["Run folders: " + ", ".join(f"`{_rel(p, ctx.study.path)}`" for p in folders)
              + f" (each has {METRICS_FILE}, TensorBoard logs in {TENSORBOARD_DIR}/, {CHECKPOINTS_DIR}/ and "
              f"{FINAL_DIR}/).", ""]
    if len(folders) < len(every):
        L += [f"{len(every) - len(folders)} of the {len(every)} runs were read from their result files alone (no run "
              f"folder on this machine).", ""]
    return L
