"""`hallucination`: contextual hallucination, the paper's §3.6, on tasks whose answer the context fixes.

The paper asks a GPT-4o judge whether each summary / answer is supported by its document (Lookback
Lens protocol) and reports the fraction judged faithful, 100 samples per data set. Offline there is
neither the data sets nor the judge, so every sample here is built so that its answer is fully
determined by the context and checkable by matching (eval/judge.py), and the judge is pluggable for
users who have an LLM judge: `judge="python:package.module:function"`, `"command:<shell command>"`,
or from Python any callable, `get_task("hallucination", judge=fn)`. Such a judge runs after every
output is generated; one that fails does not lose them: its error names the JSON-lines file that
keeps its input (`Hallucination._verdicts`).

Sub-tasks (50 samples each by default; the paper used 100), all on real held-out text:
  qa              a fact about a made-up person, from a seeded generator ("Maria Lopez was born in
                  Lyon.", "... was born in the year 1874.", "... works as a tailor.", "Maria Lopez's
                  favourite colour is amber.", "... paid 12,500 dollars for the farm."), then a
                  question whose answer is that fact's value.
  counterfactual  a statement that contradicts world knowledge ("The capital of France is Lisbon.",
                  "A week has 9 days.") asked back: a model that answers from memory (Paris, 7)
                  instead of from the context is unfaithful.
  summary         the same kind of fact as qa; the instruction asks to restate the key fact of the
                  passage and the prompt ends "In summary, Maria Lopez": the model must restate the
                  predicate and its value ("was born in Lyon.").

Prompt (QA and counterfactual; the summary puts its instruction after the passage, no question):

    Answer the question using only the passage.

    Passage: <held-out text> Maria Lopez was born in Lyon. <held-out text>

    Question: Where was Maria Lopez born?
    Answer: Maria Lopez was born in

Completion-style, as in the paper's needle prompts, so that small base models can answer. Every
prompt is scored as a new document (EOS first, eval/lm.py).

Metrics per sub-task:
  faithful_<sub>  the paper's metric: the fraction of greedy outputs the judge calls faithful.
  choice_<sub>    forced choice: the fraction of samples whose in-context value has the highest
                  log-probability as the continuation, among `choices` candidate values (the others:
                  values of the same kind that the passage does not contain, of the in-context value's
                  token count where the pool allows, and, for counterfactuals, always the world-knowledge
                  value). It separates tiny models long before greedy decoding states anything right.
  memory_counterfactual, choice_memory_counterfactual  how often the output states the
                  world-knowledge value / the forced choice picks it: answering from memory.
  faithful, choice  the means over the sub-tasks run.

Choices made where the paper is silent (it used real data sets and an LLM judge):
  - Held-out text: a window of `cfg.split` tokens (test by default, never train) at a seeded random
    offset, decoded with the prepared data's tokenizer (documents joined by a blank line), cut to
    whole words at both ends, and sized so that the whole prompt is `context_length` tokens of the
    model's tokenizer (default: the model's context less max_new_tokens; EvalConfig.seq_len is not
    used), or as close below as the re-tokenisation allows, and short enough that the prompt and its
    longest forced-choice continuation fit in the model's context. The fact goes at the sentence boundary
    nearest to a uniform random
    depth. A fact whose value (or, for counterfactuals, whose world-knowledge value) already occurs
    in the window is drawn again, so the answer is recoverable from the fact alone.
  - Counterfactual value: another value of the same kind (another capital, planet, number, ...),
    uniform; facts are uniform over the table below (capitals are most of it).
  - Greedy decoding, max_new_tokens (12) new tokens; the judged output is the continuation's first
    sentence (up to the first newline or sentence-final . ! ? not followed by a digit), because a
    small model runs on after its answer and the matching judge checks every number it states; the
    full continuation is kept in the examples and handed to external judges as "full_output".
  - Judge records: context = the passage, question (or instruction), answer_prefix = the cue the
    answer continues ("Maria Lopez was born in", "In summary, Maria Lopez"), output, reference = the in-context
    value, candidates =
    values of the same kind (the judge's contradicting candidates). See eval/judge.py.
  - Forced-choice score: log P(" value" | prompt), summed over the value's tokens (for the summary,
    the whole restated predicate with each value). A sample counts 1 when the in-context value scores
    highest, 1/k when it ties with k - 1 others for the top (eval/lm.py `first_place_share`).
  - A sum over tokens charges each extra token a whole token's log-probability, so candidates of unequal
    token counts are chosen by length more than by preference. The distractors are therefore drawn from
    the pool values whose continuation (counted after the cue) has the in-context value's token count;
    where fewer than `choices` - 1 such values are absent from the passage, the rest are the values
    nearest in token count. The world value of a counterfactual is always a candidate, and the value the
    passage states instead is drawn with the world value's token count where the pool has one.
  - Chance (`settings.forced_choice_chance`, per sub-task and for `memory_counterfactual`) is what a
    model with equal logits scores on these very samples, from each choice's token count: the fewest
    tokens win, a k-way tie earning 1/k. It is 1/`choices` only where every sample's candidates have
    equal token counts.
  - Each sub-task draws its samples from its own seeded stream (eval_seed and the sub-task's name),
    so the samples of one sub-task do not depend on which others run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from difftransformer.data import PreparedData
from difftransformer.data.templates import Fact, held_out_text, insert_at_depth, person_fact  # shared with training
from difftransformer.data.templates import fact_prompt as build_prompt
from difftransformer.eval.heldout import heldout_split
from difftransformer.eval.judge import (
    DEFAULT_TIMEOUT_S,
    CallableJudge,
    find_phrase,
    judge_name,
    make_judge,
    normalize,
    occurs,
)
from difftransformer.eval.lm import continuation_token_logprobs, first_place_share, generate_text, split_continuation
from difftransformer.eval.task import EvalConfig, Task, TaskResult, register_task

SUBTASKS = ("qa", "counterfactual", "summary")
MAX_ATTEMPTS = 200  # draws of (fact, window) per sample before giving up
MIN_HELD_OUT_TOKENS = 8  # a prompt with less held-out text than this is refused as too short
EXCERPT_CHARS = 160  # held-out text kept on each side of the fact in the examples

# ---------------------------------------------------------------- the facts

CAPITALS = {"France": "Paris", "Italy": "Rome", "Japan": "Tokyo", "Spain": "Madrid", "Germany": "Berlin",
            "England": "London", "Russia": "Moscow", "Egypt": "Cairo", "China": "Beijing", "Greece": "Athens",
            "Ireland": "Dublin", "Portugal": "Lisbon", "Canada": "Ottawa", "Austria": "Vienna", "Sweden": "Stockholm",
            "Norway": "Oslo", "Poland": "Warsaw", "Turkey": "Ankara", "Kenya": "Nairobi", "Peru": "Lima",
            "Cuba": "Havana", "Argentina": "Buenos Aires"}
# (subject, relation, world-knowledge value, value pool, tail, question)
WORLD_FACTS = tuple(
    (f"The capital of {country}", "is", capital, tuple(CAPITALS.values()), "", f"What is the capital of {country}?")
    for country, capital in CAPITALS.items()
) + (
    ("The largest planet in the solar system", "is", "Jupiter", ("Jupiter", "Saturn", "Mars", "Venus", "Neptune",
     "Mercury"), "", "Which planet is the largest in the solar system?"),
    ("The first president of the United States", "was", "George Washington", ("George Washington", "John Adams",
     "Thomas Jefferson", "Abraham Lincoln", "James Madison", "Andrew Jackson"), "",
     "Who was the first president of the United States?"),
    ("The author of Hamlet", "was", "William Shakespeare", ("William Shakespeare", "Charles Dickens", "Jane Austen",
     "Mark Twain", "Leo Tolstoy"), "", "Who was the author of Hamlet?"),
    ("The Sun", "rises in the", "east", ("east", "west", "north", "south"), "", "Where does the Sun rise?"),
    ("A week", "has", "7", ("7", "5", "6", "8", "9", "10"), " days", "How many days does a week have?"),
    ("Water", "freezes at", "0", ("0", "10", "25", "50", "100"), " degrees Celsius",
     "At what temperature does water freeze?"),
    ("The largest ocean on Earth", "is the", "Pacific", ("Pacific", "Atlantic", "Indian", "Arctic"), "",
     "Which ocean is the largest on Earth?"),
    ("The tallest mountain on Earth", "is", "Mount Everest", ("Mount Everest", "Mont Blanc", "Mount Fuji",
     "Mount Kilimanjaro", "Mount Elbrus"), "", "What is the tallest mountain on Earth?"),
    ("The Declaration of Independence", "was signed in", "1776", ("1776", "1801", "1812", "1848", "1865"), "",
     "In which year was the Declaration of Independence signed?"),
    ("The Great Wall", "is in", "China", ("China", "India", "Brazil", "Egypt", "Mexico"), "",
     "In which country is the Great Wall?"),
)


def counterfactual_fact(rng: random.Random, size: Callable[[Fact, str], int] | None = None) -> Fact:
    """A world fact stated with another value of its kind. size: None, or a value's size as forced choice scores it
    (`value_size`): the value then has the world value's size where the pool has one, so that the forced choice
    between the two (context against memory) compares equally long continuations."""
    subject, relation, world, pool, tail, question = rng.choice(WORLD_FACTS)
    fact = Fact(subject, relation, world, tail, question, pool, world)
    others = [v for v in pool if v != world]
    if size is not None:
        others = [v for v in others if size(fact, v) == size(fact, world)] or others
    return dataclasses.replace(fact, value=rng.choice(others))


# ---------------------------------------------------------------- prompts


_SENTENCE_END = re.compile(r"\n|[.!?](?!\d)")


def first_sentence(text: str) -> str:
    """`text` up to and including its first sentence end (a newline, or . ! ? not followed by a digit)."""
    text = text.lstrip()
    m = _SENTENCE_END.search(text)
    return text if m is None else text[:m.end()].rstrip()


# ---------------------------------------------------------------- samples


@dataclass
class Sample:
    subtask: str
    fact: Fact
    prompt: str
    passage: str  # the context: held-out text with the fact inserted
    question: str  # the question, or the summary's instruction
    cue: str  # the prompt's last words, which the answer continues
    before: str  # held-out text before the fact, exactly as in the passage
    after: str  # and after it
    offset: int  # where the held-out window starts in the split (tokens)
    window: int  # its length in tokens
    depth: float
    prompt_tokens: int  # EOS + prompt, in the model's tokenizer
    choices: list[str] = field(default_factory=list)  # forced-choice values; choices[0] is the in-context one
    choice_tokens: list[int] = field(default_factory=list)  # tokens of each choice's continuation after the prompt

    @property
    def reference(self) -> str:
        return self.fact.value

    def continuations(self) -> list[str]:
        return [self.fact.continuation(v, self.subtask == "summary") for v in self.choices]

    def chance(self, value: str) -> float:
        """What a model with equal logits scores for choosing `value`: every token costs it log(vocabulary), so
        the choices with the fewest tokens tie for first and share its credit (`first_place_share`'s 1/k)."""
        return first_place_share([-n for n in self.choice_tokens], self.choices.index(value))


def _prompt_length(tokenizer, prompt: str) -> int:
    return 1 + len(tokenizer.encode(prompt))


def _fit_sample(subtask: str, fact: Fact, tokens: np.ndarray, start: int, target: int, depth: float,
                text_tokenizer, tokenizer, eos_id: int) -> Sample:
    """The sample with the most held-out text from `start` whose prompt is at most `target` tokens."""
    overhead = _prompt_length(tokenizer, build_prompt(subtask, fact.sentence, fact)[0])
    if target - overhead < MIN_HELD_OUT_TOKENS:
        raise ValueError(f"context_length {target} leaves {target - overhead} tokens for held-out text (the "
                         f"instructions, fact and question take {overhead}); use context_length >= "
                         f"{overhead + 4 * MIN_HELD_OUT_TOKENS}")
    count = min(target - overhead + 4, len(tokens) - start)
    for _ in range(64):
        text = held_out_text(tokens, start, count, text_tokenizer, eos_id)
        passage, before, after = insert_at_depth(text, fact.sentence, depth)
        prompt, question, cue = build_prompt(subtask, passage, fact)
        n = _prompt_length(tokenizer, prompt)
        if n <= target:
            return Sample(subtask, fact, prompt, passage, question, cue, before, after, start, count, depth, n)
        count -= max(1, n - target)
        if count < MIN_HELD_OUT_TOKENS:
            break
    raise ValueError(f"cannot fit held-out text into a {target}-token prompt (the fact, question and instructions "
                     f"take {overhead}); raise context_length")


def _conflicts(sample: Sample) -> bool:
    """Whether the held-out text already states the answer (or the world value it contradicts)."""
    text = normalize(f"{sample.before}\n{sample.after}")
    values = [sample.fact.value] + ([sample.fact.world] if sample.fact.world else [])
    return any(find_phrase(text, normalize(v)) >= 0 for v in values)


def value_size(tokenizer, subtask: str, fact: Fact, value: str) -> int:
    """Tokens of the continuation that states `value` after the fact's cue, as forced choice scores it (the cue
    depends on the fact and subtask only, not on the passage)."""
    cue = build_prompt(subtask, "", fact)[2]
    return len(split_continuation(tokenizer, cue, fact.continuation(value, subtask == "summary"))[1])


def _choose_values(sample: Sample, n: int, rng: random.Random, tokenizer) -> list[str]:
    """The in-context value, the world value (counterfactuals), then others of the pool absent from the text:
    values whose continuation after the cue has as many tokens as the in-context value's, drawn at random, and
    where the pool has too few of them, the values nearest to it in token count (so that a sum of log-probs
    compares equally long continuations wherever the pool allows)."""
    fixed = [sample.fact.value] + ([sample.fact.world] if sample.fact.world else [])
    text = normalize(f"{sample.before}\n{sample.after}")
    rest = [v for v in sample.fact.pool if v not in fixed and find_phrase(text, normalize(v)) < 0]
    size = {v: value_size(tokenizer, sample.subtask, sample.fact, v) for v in [sample.fact.value, *rest]}
    rng.shuffle(rest)
    rest.sort(key=lambda v: abs(size[v] - size[sample.fact.value]))  # stable: random among equally near
    return (fixed + rest[:max(0, n - len(fixed))])[:max(n, len(fixed))]


def _choice_tokens(tokenizer, sample: Sample) -> list[int]:
    """Tokens of each choice's continuation as scored: after the whole prompt (`score_continuations`)."""
    return [len(split_continuation(tokenizer, sample.prompt, c)[1]) for c in sample.continuations()]


def build_samples(subtask: str, count: int, tokens: np.ndarray, target: int, rng: random.Random, text_tokenizer,
                  tokenizer, eos_id: int, choices: int = 4, limit: int | None = None) -> list[Sample]:
    """`count` samples of `subtask` over the held-out `tokens`, each prompt at most `target` tokens and short
    enough that the prompt and its longest forced-choice continuation fit in `limit` tokens (the model's
    context; None: no such bound)."""
    if subtask == "counterfactual":
        make = lambda r: counterfactual_fact(r, size=lambda f, v: value_size(tokenizer, subtask, f, v))  # noqa: E731
    else:
        make = person_fact
    samples = []
    for _ in range(count):
        for _attempt in range(MAX_ATTEMPTS):
            fact, start, depth = make(rng), rng.randrange(0, max(1, len(tokens) - target)), rng.random()
            sample = _fit_sample(subtask, fact, tokens, start, target, depth, text_tokenizer, tokenizer, eos_id)
            if not _conflicts(sample):
                break
        else:
            raise ValueError(f"the held-out text states the answer of every {subtask} fact drawn in {MAX_ATTEMPTS} "
                             f"tries; use another split or corpus")
        sample.choices = _choose_values(sample, choices, rng, tokenizer)
        sample.choice_tokens = _choice_tokens(tokenizer, sample)
        longest = max(sample.choice_tokens)
        if limit is not None and sample.prompt_tokens + longest > limit:  # less held-out text: the values stay absent
            shorter = _fit_sample(subtask, fact, tokens, start, limit - longest, depth, text_tokenizer, tokenizer,
                                  eos_id)
            shorter.choices, sample = sample.choices, shorter
            sample.choice_tokens = _choice_tokens(tokenizer, sample)
        samples.append(sample)
    return samples


# ---------------------------------------------------------------- scoring


@torch.no_grad()
def score_continuations(model, tokenizer, prompt: str, continuations: list[str], device: str = "cpu",
                        batch_size: int = 8) -> list[float]:
    """log P(continuation | EOS + prompt) for each continuation, in batches (right-padded: the model is
    causal, so padding after a sequence cannot change its scores). Equals lm.continuation_logprob."""
    rows = []
    for c in continuations:
        context_ids, cont_ids = split_continuation(tokenizer, prompt, c)
        if not cont_ids:
            raise ValueError(f"the continuation {c!r} encodes to no tokens; nothing to score")
        rows.append(([tokenizer.eos_id, *context_ids], cont_ids))
    limit = model.config.max_position_embeddings
    longest = max(len(ctx) + len(cont) for ctx, cont in rows)
    if longest > limit:
        raise ValueError(f"a forced-choice sequence is {longest} tokens; the model's context is {limit}. "
                         f"Lower context_length")
    picked = continuation_token_logprobs(model, rows, batch_size=batch_size, pad_id=tokenizer.eos_id, device=device)
    return [float(lp.sum()) for lp in picked]  # fp32 sums, as lm.continuation_logprob


def _excerpt(sample: Sample) -> str:
    """The fact with up to EXCERPT_CHARS of held-out text on each side."""
    before = sample.before[-EXCERPT_CHARS:]
    after = sample.after[:EXCERPT_CHARS]
    lead = "..." if len(sample.before) > EXCERPT_CHARS else ""
    trail = "..." if len(sample.after) > EXCERPT_CHARS else ""
    return " ".join(p for p in (lead + before, sample.fact.sentence, after + trail) if p.strip(". "))


def judge_record(sample: Sample, output: str, full_output: str, index: int) -> dict[str, Any]:
    """What the judge sees for one sample (eval/judge.py documents the keys)."""
    key = "instruction" if sample.subtask == "summary" else "question"
    candidates = list(dict.fromkeys([*sample.fact.pool[:50], *sample.choices]))
    return {"id": f"{sample.subtask}-{index}", "subtask": sample.subtask, "context": sample.passage,
            key: sample.question, "answer_prefix": sample.cue, "output": output, "full_output": full_output,
            "reference": sample.reference, "candidates": candidates}


# ---------------------------------------------------------------- the task


@dataclass
class HallucinationOptions:
    samples: int = field(default=50, metadata={"help": "samples per sub-task (the paper: 100)"})
    context_length: int = field(default=0, metadata={
        "help": "prompt length in tokens, EOS included; it and max_new_tokens must fit the model's context "
                "(0: the model's context less max_new_tokens)"})
    subtasks: tuple[str, ...] = field(default=SUBTASKS, metadata={"help": f"which of {', '.join(SUBTASKS)}"})
    judge: str = field(default="match", metadata={
        "help": "'match' (offline string/number matching), 'python:package.module:function' or "
                "'command:<shell command>' (JSON lines in, one JSON object with a boolean 'faithful' per line out)"})
    judge_timeout: float = field(default=DEFAULT_TIMEOUT_S,
                                 metadata={"help": "seconds an external judge command may run"})
    max_new_tokens: int = field(default=12, metadata={"help": "greedy tokens generated per sample"})
    choices: int = field(default=4, metadata={"help": "values per forced choice, the in-context one included"})
    forced_choice: bool = field(default=True, metadata={"help": "also score the forced choice between values"})
    examples: int = field(default=10, metadata={"help": "per-sample records kept in the result per sub-task"})


@register_task
class Hallucination(Task):
    name = "hallucination"
    reads_seq_len = False  # prompt lengths come from its own options and the model's context
    # 2: a k-way tie at the top of a forced choice earns 1/k (version 1 counted it as wrong); 3: distractors have the
    # in-context value's token count where the pool allows, and the chance is an equal-logits model's score on the
    # samples (version 2: random distractors, chance 1/k); 4: a counterfactual states a value of the world value's
    # token count where the pool has one
    version = 4
    description = ("contextual hallucination: fraction of greedy answers judged faithful to facts inserted in "
                   "held-out text (QA, counterfactual, summary), plus a forced choice")
    Options = HallucinationOptions

    def __init__(self, options: HallucinationOptions | None = None, **overrides: Any):
        """As Task; `judge` may also be a Python callable fn(records) -> [verdict, ...] (eval/judge.py), which
        the result records as 'python:<module>:<name>'."""
        self._judge: CallableJudge | None = None
        if callable(overrides.get("judge")):
            self._judge = CallableJudge(overrides["judge"])
            overrides["judge"] = self._judge.name
        super().__init__(options, **overrides)

    def judge(self):
        """The judge the options name (or the callable given)."""
        return self._judge or make_judge(self.options.judge, self.options.judge_timeout)

    def _builtin_judge(self) -> bool:
        """Whether the judge is the built-in matching one (fixed by its name, run in this process, quick)."""
        return self._judge is None and self.options.judge == "match"

    def reusable(self) -> str | None:
        """Only the built-in matching judge is fixed by its name: a Python function or a command may give other
        verdicts tomorrow under the same name, so their results are judged again, never reused."""
        if self._builtin_judge():
            return None
        return f"the judge {self.options.judge!r} may give other verdicts under the same name"

    def check_options(self) -> None:
        o = self.options
        for key in ("samples", "max_new_tokens"):
            if getattr(o, key) < 1:
                raise ValueError(f"hallucination {key} must be at least 1, got {getattr(o, key)}")
        if o.context_length < 0:
            raise ValueError(f"hallucination context_length must be >= 0 (0: automatic), got {o.context_length}")
        if o.choices < 2:
            raise ValueError(f"hallucination choices must be at least 2 (the in-context value and a distractor), "
                             f"got {o.choices}")
        if o.examples < 0:
            raise ValueError(f"hallucination examples must be >= 0, got {o.examples}")
        if not o.subtasks:
            raise ValueError(f"hallucination subtasks is empty; name some of {', '.join(SUBTASKS)}")
        for sub in o.subtasks:
            if sub not in SUBTASKS:
                raise ValueError(f"unknown hallucination sub-task {sub!r}; choose from {', '.join(SUBTASKS)}")
        if len(set(o.subtasks)) != len(o.subtasks):
            raise ValueError(f"hallucination subtasks names one twice: {', '.join(o.subtasks)}")
        if not o.judge_timeout > 0:
            raise ValueError(f"hallucination judge_timeout must be positive seconds, got {o.judge_timeout}")
        self.judge()  # a bad judge spec fails now, before any model runs

    def prompt_length(self, model) -> int:
        """The prompt length asked for, checked against the model's context."""
        context, new = model.config.max_position_embeddings, self.options.max_new_tokens
        length = self.options.context_length or context - new
        if length + new > context or length < 1:
            raise ValueError(f"context_length {length} + max_new_tokens {new} is beyond the model's context of "
                             f"{context} tokens; use context_length <= {context - new}")
        return length

    def make_samples(self, model, tokenizer, cfg: EvalConfig) -> tuple[dict[str, list[Sample]], PreparedData, int]:
        """The prompts of every sub-task asked for (deterministic given cfg.eval_seed), the data and the length."""
        held = heldout_split(cfg, None, self.name)  # the data's own tokens: windows are decoded with its tokenizer
        length = self.prompt_length(model)
        data, tokens = held.data, held.tokens
        text_tokenizer = data.tokenizer()
        tokenizer = tokenizer or text_tokenizer
        if len(tokens) < 4 * MIN_HELD_OUT_TOKENS:
            raise ValueError(f"the {cfg.split} split of {cfg.data_dir} has only {len(tokens)} tokens; "
                             f"the facts need held-out text around them")
        out = {}
        for sub in self.options.subtasks:
            rng = random.Random(f"hallucination:{sub}:{cfg.eval_seed}")
            out[sub] = build_samples(sub, self.options.samples, tokens, length, rng, text_tokenizer, tokenizer,
                                     held.eos_id, self.options.choices, model.config.max_position_embeddings)
        return out, data, length

    def run(self, model: torch.nn.Module, tokenizer, cfg: EvalConfig) -> TaskResult:
        o = self.options
        judge = self.judge()
        samples, data, length = self.make_samples(model, tokenizer, cfg)
        tokenizer = tokenizer or data.tokenizer()
        outputs: dict[str, list[tuple[str, str]]] = {}
        records = []
        for sub, items in samples.items():
            outputs[sub] = []
            for i, s in enumerate(items):
                full = generate_text(model, tokenizer, s.prompt, o.max_new_tokens, temperature=0.0,
                                     device=cfg.device).text
                outputs[sub].append((first_sentence(full), full))
                records.append(judge_record(s, *outputs[sub][-1], i))
        verdicts = iter(self._verdicts(judge, records))
        metrics: dict[str, float] = {}
        details: dict[str, Any] = {"subtasks": {}}
        chance = {}
        for sub, items in samples.items():
            cell = self._score(sub, items, outputs[sub], [next(verdicts) for _ in items], model, tokenizer, cfg)
            details["subtasks"][sub] = cell
            metrics[f"faithful_{sub}"] = float(np.mean(cell["faithful"]))
            if o.forced_choice:
                metrics[f"choice_{sub}"] = float(np.mean(cell["choice_correct"]))
                chance[sub] = float(np.mean([s.chance(s.fact.value) for s in items]))
            if sub == "counterfactual":
                metrics["memory_counterfactual"] = float(np.mean(cell["states_world"]))
                if o.forced_choice:
                    metrics["choice_memory_counterfactual"] = float(np.mean(cell["choice_world"]))
                    chance["memory_counterfactual"] = float(np.mean([s.chance(s.fact.world) for s in items]))
        metrics["faithful"] = float(np.mean([metrics[f"faithful_{s}"] for s in samples]))
        if o.forced_choice:
            metrics["choice"] = float(np.mean([metrics[f"choice_{s}"] for s in samples]))
        lengths = [s.prompt_tokens for items in samples.values() for s in items]
        return TaskResult(
            task=self.name, metrics=metrics,
            settings={"data_dir": str(cfg.data_dir), "split": cfg.split, "context_length": length,
                      "model_context": model.config.max_position_embeddings, "judge": judge_name(judge),
                      "judged_output": "first sentence of the greedy continuation", "forced_choice_chance": chance,
                      "prompt_tokens": {"min": min(lengths), "mean": float(np.mean(lengths)), "max": max(lengths)},
                      "corpus_hash": data.corpus_hash, "tokenizer_hash": data.tokenizer_hash},
            details=details,
        )

    def _verdicts(self, judge, records: list[dict[str, Any]]) -> list[dict]:
        """The judge's verdicts on `records`. An external judge (a Python function or a command) gets them only after
        they are written as JSON lines (its input, one record per line: generation's work) to a file in the system's
        temporary folder, removed once the judge has answered; a judge that fails is a one-line ValueError naming
        the file (a run stopped while the judge works leaves it too), so the outputs are not lost and the judge can
        be run on them by hand."""
        if self._builtin_judge():
            return judge(records)
        fd, path = tempfile.mkstemp(prefix=f"{self.name}-outputs-", suffix=".jsonl")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
        try:
            verdicts = judge(records)
        except ValueError as e:
            raise ValueError(f"{e}; the {len(records)} generated outputs are kept in {path} (the judge's input, one "
                             f"JSON record per line)") from e
        os.unlink(path)
        return verdicts

    def _score(self, sub: str, items: list[Sample], outputs: list[tuple[str, str]], verdicts: list[dict],
               model, tokenizer, cfg: EvalConfig) -> dict[str, Any]:
        """One sub-task's per-sample numbers and its first `examples` records."""
        cell: dict[str, Any] = {"faithful": [int(v["faithful"]) for v in verdicts],
                                "prompt_tokens": [s.prompt_tokens for s in items],
                                "depth": [round(s.depth, 4) for s in items], "examples": []}
        scores = []
        if self.options.forced_choice:
            scores = [score_continuations(model, tokenizer, s.prompt, s.continuations(), cfg.device, cfg.batch_size)
                      for s in items]
            cell["choice_correct"] = [first_place_share(sc, s.choices.index(s.fact.value))
                                      for s, sc in zip(items, scores)]
        if sub == "counterfactual":
            cell["states_world"] = [int(occurs(s.fact.world, out)) for s, (out, _) in zip(items, outputs)]
            if scores:
                cell["choice_world"] = [first_place_share(sc, s.choices.index(s.fact.world))
                                        for s, sc in zip(items, scores)]
        for i, (s, (out, full), v) in enumerate(zip(items, outputs, verdicts)):
            if i >= self.options.examples:
                break
            example = {"context": _excerpt(s), "question": s.question, "answer_prefix": s.cue, "output": out,
                       "full_output": full, "reference": s.reference, "faithful": bool(v["faithful"]),
                       "reason": str(v.get("reason", ""))[:200], "spans": [str(x)[:80] for x in v.get("spans", [])][:5],
                       "offset": s.offset, "depth": round(s.depth, 4), "prompt_tokens": s.prompt_tokens}
            if s.fact.world:
                example["world_value"] = s.fact.world
            if scores:
                example["choices"] = {c: round(x, 4) for c, x in zip(s.choices, scores[i])}
            cell["examples"].append(example)
        return cell

    def plot(self, result: TaskResult, path: Path) -> bool:
        from matplotlib.figure import Figure

        subs = list(result.details["subtasks"])
        fig = Figure(figsize=(6, 4))
        ax = fig.add_subplot()
        x = np.arange(len(subs))
        ax.bar(x - 0.2, [result.metrics[f"faithful_{s}"] for s in subs], 0.4, label="judged faithful (greedy)")
        if f"choice_{subs[0]}" in result.metrics:
            ax.bar(x + 0.2, [result.metrics[f"choice_{s}"] for s in subs], 0.4, label="forced choice")
            chance = result.settings.get("forced_choice_chance", {})
            for i, s in enumerate(subs):
                if s in chance:
                    ax.hlines(chance[s], i + 0.0, i + 0.4, colors="grey", linestyles="--")
        ax.set_xticks(x, subs)
        ax.set_ylim(0, 1)
        ax.set_ylabel("fraction of samples")
        ax.set_title(f"contextual hallucination ({result.settings['judge']} judge, dashed: chance)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        return True
