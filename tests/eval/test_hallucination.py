"""The contextual-hallucination task on known answers: a model that copies from its context is faithful,
one that answers from world knowledge is not, prompts hold their fact in held-out text, and bad inputs
are refused in one line."""

from __future__ import annotations

import json
import random
import re
import shlex
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import difftransformer.eval.tasks.hallucination as hal
from difftransformer.data import PreparedData
from difftransformer.eval import EvalConfig, get_task, run_task
from difftransformer.eval.lm import continuation_logprob, split_continuation
from difftransformer.model import DiffTransformerLM
from tests.helpers import tiny

CONTEXT = 320  # the fake models' context: room for char-level prompts of the vocab-300 test tokenizer
NEW = 40  # tokens generated: the summary restates a whole predicate, about one token per character here


class FakeLM(torch.nn.Module):
    """A causal LM over token ids whose greedy next token at each position is `predict(prefix)`
    (logit 0 there, -20 elsewhere; None: EOS). Black box: `.config`, `forward(ids).logits`, `generate`."""

    def __init__(self, vocab: int, eos_id: int):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.vocab, self.eos_id = vocab, eos_id
        self.config = SimpleNamespace(max_position_embeddings=CONTEXT)

    def predict(self, ids: list[int]) -> int | None:
        raise NotImplementedError

    def forward(self, ids: torch.Tensor):
        logits = torch.full((*ids.shape, self.vocab), -20.0)
        for b, row in enumerate(ids.tolist()):
            for t in range(len(row)):
                nxt = self.predict(row[:t + 1])
                logits[b, t, self.eos_id if nxt is None else nxt] = 0.0
        return SimpleNamespace(logits=logits + 0 * self.w)

    def generate(self, ids, max_new_tokens, *, eos_token_id=None, **_):
        assert ids.shape[1] + max_new_tokens <= CONTEXT
        row = ids[0].tolist()
        for _ in range(max_new_tokens):
            nxt = self.predict(row)
            row.append(self.eos_id if nxt is None else nxt)
            if row[-1] == eos_token_id:
                break
        return torch.tensor([row])


class CopyLM(FakeLM):
    """An induction head: predicts the token that followed the longest earlier match of the current suffix
    (ties: the latest). It answers every question from the context."""

    def predict(self, ids):
        t, best, best_len = len(ids) - 1, None, 0
        for s in range(t - 1, -1, -1):
            n = 0
            while n <= s and n < 64 and ids[s - n] == ids[t - n]:
                n += 1
            if n > best_len:
                best, best_len = ids[s + 1], n
        return best


class ScriptedLM(FakeLM):
    """Answers each scripted prompt with its scripted continuation (matched on the prompt's last tokens)."""

    def __init__(self, vocab, tokenizer, script: list[tuple[str, str]]):
        super().__init__(vocab, tokenizer.eos_id)
        self.script = []
        for prompt, continuation in script:
            ctx, cont = split_continuation(tokenizer, prompt, continuation)
            self.script.append((ctx[-24:], cont))

    def predict(self, ids):
        for key, cont in self.script:
            for j in range(len(cont)):
                pattern = key + cont[:j]
                if ids[-len(pattern):] == pattern:
                    return cont[j]
        return None


@pytest.fixture(scope="module")
def data(data_dir):
    return PreparedData.load(data_dir)


def task(**options):
    return get_task("hallucination", **{"samples": 4, "max_new_tokens": NEW, **options})


def cfg(data_dir, **kw):
    return EvalConfig(data_dir=data_dir, **kw)


def held_out_texts(data, split):
    """The whole split as text, documents joined by a blank line (as the task decodes them)."""
    tokens = np.asarray(data.dataset(split).tokens).tolist()
    tok = data.tokenizer()
    docs, current = [], []
    for t in tokens:
        if t == tok.eos_id:
            docs.append(tok.decode(current))
            current = []
        else:
            current.append(t)
    return "\n\n".join(docs)


def test_prompts_hold_their_fact_in_held_out_text_with_a_recoverable_answer(data, data_dir):
    model = CopyLM(data.vocab_size, data.tokenizer().eos_id)
    samples, _, length = task(choices=3).make_samples(model, data.tokenizer(), cfg(data_dir))
    assert length == CONTEXT - NEW and set(samples) == {"qa", "counterfactual", "summary"}
    test_text, train_text = held_out_texts(data, "test"), held_out_texts(data, "train")
    n_test = data.num_tokens["test"]
    for sub, items in samples.items():
        assert len(items) == 4
        for s in items:
            fact = s.fact
            assert fact.sentence in s.prompt and s.passage in s.prompt and s.prompt.endswith(s.cue)
            assert s.passage == " ".join(p for p in (s.before, fact.sentence, s.after) if p)
            assert s.before or s.after
            for piece in (s.before, s.after):  # test-split text only, never training text
                assert piece in test_text
                if len(piece) > 40:
                    assert piece not in train_text
            assert 0 <= s.offset and s.offset + s.window <= n_test
            assert s.prompt_tokens == 1 + len(data.tokenizer().encode(s.prompt)) <= length
            # the answer is recoverable: the only value of its kind after the cue's words in the prompt
            lead = f"{fact.subject} {fact.relation}"
            found = re.findall(re.escape(lead) + r" ([^.]+?)" + re.escape(fact.tail) + r"\.", s.prompt)
            assert found == [s.reference]
            assert s.choices[0] == s.reference and len(s.choices) == len(set(s.choices)) == 3
            if sub == "counterfactual":
                assert fact.world and fact.world != s.reference and s.choices[1] == fact.world
                assert not hal.occurs(fact.world, s.prompt)  # the world value is only in the model's memory
            else:
                assert fact.world is None
            for v in s.choices[1:]:
                assert not hal.occurs(v, s.passage)  # distractors are values the context does not hold


def test_a_model_copying_from_the_context_is_faithful_everywhere(data, data_dir):
    model = CopyLM(data.vocab_size, data.tokenizer().eos_id)
    result = run_task(task(), model, data.tokenizer(), cfg(data_dir))
    m = result.metrics
    for sub in ("qa", "counterfactual", "summary"):
        assert m[f"faithful_{sub}"] == 1.0 and m[f"choice_{sub}"] == 1.0, (sub, result.details["subtasks"][sub])
    assert m["memory_counterfactual"] == 0.0 and m["choice_memory_counterfactual"] == 0.0
    assert m["faithful"] == m["choice"] == 1.0
    ex = result.details["subtasks"]["summary"]["examples"][0]
    assert ex["reference"] in ex["output"] and ex["reference"] in ex["context"] and ex["faithful"]
    chance = result.settings["forced_choice_chance"]
    assert set(chance) == {"qa", "counterfactual", "summary", "memory_counterfactual"}
    assert all(0 <= v <= 1 for v in chance.values())
    json.dumps(result.to_dict())


def test_a_model_answering_from_world_knowledge_fails_every_counterfactual(data, data_dir):
    tok = data.tokenizer()
    t = task(subtasks=("counterfactual",))
    samples, _, _ = t.make_samples(CopyLM(data.vocab_size, tok.eos_id), tok, cfg(data_dir))
    script = [(s.prompt, f" {s.fact.world}") for s in samples["counterfactual"]]
    result = run_task(t, ScriptedLM(data.vocab_size, tok, script), tok, cfg(data_dir))
    m = result.metrics
    assert m["faithful_counterfactual"] == 0.0 and m["choice_counterfactual"] == 0.0
    assert m["memory_counterfactual"] == 1.0 and m["choice_memory_counterfactual"] == 1.0
    ex = result.details["subtasks"]["counterfactual"]["examples"][0]
    assert ex["output"] == ex["world_value"] != ex["reference"] and not ex["faithful"]
    assert set(result.details["subtasks"]) == {"counterfactual"}


def test_the_faithful_fraction_counts_samples(data, data_dir):
    """A model right on a random subset of the samples scores exactly that subset's share."""
    seed = random.randrange(10**6)
    rng = random.Random(seed)
    tok = data.tokenizer()
    t = task(subtasks=("qa",), samples=6, examples=2)
    items = t.make_samples(CopyLM(data.vocab_size, tok.eos_id), tok, cfg(data_dir))[0]["qa"]
    right = [rng.random() < 0.5 for _ in items]
    script = [(s.prompt, f" {s.reference if ok else s.choices[1]}.") for s, ok in zip(items, right)]
    result = run_task(t, ScriptedLM(data.vocab_size, tok, script), tok, cfg(data_dir))
    cell = result.details["subtasks"]["qa"]
    assert cell["faithful"] == [int(ok) for ok in right], seed
    assert cell["choice_correct"] == [int(ok) for ok in right], seed
    assert result.metrics["faithful_qa"] == pytest.approx(sum(right) / 6) == result.metrics["choice_qa"], seed
    assert len(cell["examples"]) == 2 and len(cell["prompt_tokens"]) == 6


def test_runs_are_deterministic_and_a_seed_changes_the_samples(data, data_dir):
    tok = data.tokenizer()
    model = CopyLM(data.vocab_size, tok.eos_id)
    t = task(subtasks=("qa", "summary"), samples=3)
    a, b = t.make_samples(model, tok, cfg(data_dir))[0], t.make_samples(model, tok, cfg(data_dir))[0]
    assert [s.prompt for s in a["qa"]] == [s.prompt for s in b["qa"]]
    only_qa = task(subtasks=("qa",), samples=3).make_samples(model, tok, cfg(data_dir))[0]
    assert [s.prompt for s in only_qa["qa"]] == [s.prompt for s in a["qa"]]  # independent of other sub-tasks
    other = t.make_samples(model, tok, cfg(data_dir, eval_seed=1))[0]
    assert [s.prompt for s in other["qa"]] != [s.prompt for s in a["qa"]]


class UniformLM(FakeLM):
    """Equal logits everywhere: every token costs log(vocab) nats; greedy decoding emits EOS at once."""

    def forward(self, ids):
        return SimpleNamespace(logits=torch.zeros(*ids.shape, self.vocab) + 0 * self.w)

    def predict(self, ids):
        return None


def cue_tokens(tok, s, value):
    return len(split_continuation(tok, s.cue, s.fact.continuation(value, s.subtask == "summary"))[1])


def test_distractors_have_the_in_context_values_token_count_where_the_pool_allows(data, data_dir):
    """With the vocab-300 tokenizer values of one kind differ in token count, and a sum of log-probs then picks
    by length. The distractors have the in-context value's count where enough absent values have it, else the
    nearest counts; the world value of a counterfactual stays."""
    tok = data.tokenizer()
    samples = task(samples=8).make_samples(CopyLM(data.vocab_size, tok.eos_id), tok, cfg(data_dir))[0]
    unequal_pools = matched = 0
    for items in samples.values():
        for s in items:
            fixed = [s.fact.value] + ([s.fact.world] if s.fact.world else [])
            target = cue_tokens(tok, s, s.fact.value)
            absent = [v for v in s.fact.pool if v not in fixed and not hal.occurs(v, f"{s.before}\n{s.after}")]
            distance = {v: abs(cue_tokens(tok, s, v) - target) for v in absent}
            unequal_pools += len(set(distance.values())) > 1
            chosen = s.choices[len(fixed):]
            assert s.choices[:len(fixed)] == fixed and len(s.choices) == 4
            if sum(d == 0 for d in distance.values()) >= len(chosen):
                assert all(distance[v] == 0 for v in chosen), (s.fact, s.choices)
                matched += 1
            else:  # too few of the same count: the nearest counts
                assert max(distance[v] for v in chosen) <= min(d for v, d in distance.items() if v not in chosen)
            assert s.choice_tokens == [len(split_continuation(tok, s.prompt, c)[1]) for c in s.continuations()]
    assert unequal_pools > 12 and matched > 12  # the rule had something to do, and the pools allowed it mostly


def test_a_uniform_model_scores_exactly_the_reported_chance(data, data_dir):
    """Chance is what equal logits score on the very samples (from token counts, a k-way tie earning 1/k), not
    1/choices: where a sample's candidates differ in token count the fewest tokens win outright."""
    tok = data.tokenizer()
    result = run_task(task(samples=8), UniformLM(data.vocab_size, tok.eos_id), tok, cfg(data_dir))
    chance, m = result.settings["forced_choice_chance"], result.metrics
    for key in ("qa", "counterfactual", "summary", "memory_counterfactual"):
        assert m[f"choice_{key}"] == chance[key], key
    assert any(v != 0.25 for v in chance.values())  # not 1/choices: counts differ where the pool or world value do
    assert m["faithful"] == 0.0


def test_a_failing_external_judge_keeps_the_generated_outputs(data, data_dir, tmp_path, monkeypatch):
    """The judge runs after every generation; when it fails, its input (the records with every output) is kept
    in a JSON-lines file that the one-line error names. A judge that answers leaves no file behind."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    model, tok = CopyLM(data.vocab_size, data.tokenizer().eos_id), data.tokenizer()
    judge = f"command:{shlex.quote(sys.executable)} -c 'import sys; sys.stdin.read(); sys.exit(3)'"
    with pytest.raises(ValueError, match=r"exited with status 3; .* the 6 generated outputs are kept in (\S+) "
                                         r"\(the judge's input, one JSON record per line\)") as e:
        run_task(task(samples=2, judge=judge, forced_choice=False), model, tok, cfg(data_dir))
    assert "\n" not in str(e.value)
    kept = re.search(r"kept in (\S+) ", str(e.value)).group(1)
    records = [json.loads(line) for line in open(kept, encoding="utf-8")]
    assert [r["id"] for r in records] == [f"{sub}-{i}" for sub in ("qa", "counterfactual", "summary") for i in (0, 1)]
    assert all(r["reference"] in r["output"] for r in records)  # the copying model's outputs, as generated
    run_task(task(samples=2, judge=lambda records: [True] * len(records), forced_choice=False), model, tok,
             cfg(data_dir))
    assert sorted(p.name for p in tmp_path.iterdir()) == [kept.split("/")[-1]]


def test_batched_forced_choice_scores_equal_the_one_at_a_time_scores(data):
    torch.manual_seed(0)
    model = DiffTransformerLM(tiny("diff", vocab_size=data.vocab_size, max_position_embeddings=128)).eval()
    tok = data.tokenizer()
    prompt, conts = "Answer: Maria Lopez was born in", [" Lyon", " Porto", " Buenos Aires", " was born in Cork."]
    got = hal.score_continuations(model, tok, prompt, conts, batch_size=3)
    want = [continuation_logprob(model, tok, prompt, c).logprob for c in conts]
    assert got == pytest.approx(want, abs=1e-4)


def test_a_real_model_runs_end_to_end_with_a_command_judge_and_a_plot(data, data_dir, tmp_path):
    torch.manual_seed(0)
    model = DiffTransformerLM(tiny("diff", vocab_size=data.vocab_size, max_position_embeddings=256))
    seen = tmp_path / "records.jsonl"
    code = ("import json, sys\nrows = sys.stdin.read()\nopen(sys.argv[1], 'w').write(rows)\n"
            "for r in rows.splitlines():\n    print(json.dumps({'faithful': True, 'reason': 'ok'}))")
    judge = f"command:{shlex.quote(sys.executable)} -c {shlex.quote(code)} {shlex.quote(str(seen))}"
    t = get_task("hallucination", samples=2, max_new_tokens=4, judge=judge, examples=1)
    result = run_task(t, model, data.tokenizer(), cfg(data_dir))
    assert result.metrics["faithful"] == 1.0 and result.settings["judge"] == judge
    assert result.settings["context_length"] == 252 and result.settings["prompt_tokens"]["max"] <= 252
    records = [json.loads(line) for line in seen.read_text().splitlines()]
    assert [r["subtask"] for r in records] == ["qa"] * 2 + ["counterfactual"] * 2 + ["summary"] * 2
    for r in records:
        assert r["reference"] in r["context"] and r["answer_prefix"] and ("question" in r or "instruction" in r)
    assert t.plot(result, tmp_path / "h.png") and (tmp_path / "h.png").stat().st_size > 1000


def test_a_python_callable_judge_is_used_and_recorded(data, data_dir):
    def picky(records):
        return [{"faithful": r["subtask"] == "qa", "reason": "picky"} for r in records]

    model = CopyLM(data.vocab_size, data.tokenizer().eos_id)
    t = task(samples=2, judge=picky, forced_choice=False)
    result = run_task(t, model, data.tokenizer(), cfg(data_dir))
    assert result.metrics == {"faithful_qa": 1.0, "faithful_counterfactual": 0.0, "memory_counterfactual": 0.0,
                              "faithful_summary": 0.0, "faithful": pytest.approx(1 / 3)}
    assert result.settings["judge"].startswith("python:") and result.settings["judge"].endswith("picky")
    assert result.details["subtasks"]["qa"]["examples"][0]["reason"] == "picky"


def test_a_result_of_an_external_judge_is_judged_again_not_reused(data, data_dir, tmp_path):
    """Two callables of one name (or an edited judge command) give other verdicts under the same settings: the
    second must not reuse the first's result."""
    from difftransformer.eval.results import ResultsDir, evaluate_cached

    model, tok, results = CopyLM(data.vocab_size, data.tokenizer().eos_id), data.tokenizer(), ResultsDir(tmp_path)
    verdicts = [True, False]
    def judge(records):  # noqa: E306  (one name, two behaviours)
        return [verdicts[0]] * len(records)

    first, _ = evaluate_cached(task(samples=2, judge=judge, forced_choice=False), model, tok, cfg(data_dir), results)
    verdicts.pop(0)
    second, reused = evaluate_cached(task(samples=2, judge=judge, forced_choice=False), model, tok, cfg(data_dir),
                                     results)
    assert first["metrics"]["faithful"] == 1.0 and not reused and second["metrics"]["faithful"] == 0.0
    assert task(samples=2).reusable() is None  # the built-in matching judge is fixed by its name


def test_first_sentence_and_insertion_rules():
    assert hal.first_sentence(" Lyon. Then more") == "Lyon."
    assert hal.first_sentence(" 12,500.50 dollars. And") == "12,500.50 dollars."
    assert hal.first_sentence("\nLyon\nmore") == "Lyon" and hal.first_sentence("") == ""
    text = "One two. Three four. Five six."
    assert hal.insert_at_depth(text, "X.", 0.0)[0] == "X. One two. Three four. Five six."
    assert hal.insert_at_depth(text, "X.", 0.5)[0] == "One two. Three four. X. Five six."
    assert hal.insert_at_depth(text, "X.", 1.0) == ("One two. Three four. Five six. X.", text, "")


BAD = {  # options / config -> the start of the one-line error
    "too long a context": (dict(context_length=300), {},
                           "context_length 300 \\+ max_new_tokens 40 is beyond the model's context of 320 tokens; "
                           "use context_length <= 280"),
    "too short a context": (dict(context_length=40), {}, "context_length 40 leaves .* tokens for held-out text"),
    "no data": (dict(), {"data_dir": None}, "set EvalConfig.data_dir \\(--data-dir\\)"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_runs_are_one_line_errors(case, data, data_dir):
    options, cfg_over, message = BAD[case]
    model = CopyLM(data.vocab_size, data.tokenizer().eos_id)
    config = EvalConfig(**{"data_dir": data_dir, **cfg_over})
    with pytest.raises(ValueError, match=message) as e:
        run_task(task(**options), model, data.tokenizer(), config)
    assert "\n" not in str(e.value)


def test_a_missing_data_folder_is_named(data, tmp_path):
    model = CopyLM(data.vocab_size, data.tokenizer().eos_id)
    with pytest.raises(FileNotFoundError, match="no prepared data in .*nowhere"):
        run_task(task(), model, data.tokenizer(), EvalConfig(data_dir=str(tmp_path / "nowhere")))


@pytest.mark.parametrize("options, message", [
    (dict(subtasks=("qa", "trivia")), "unknown hallucination sub-task 'trivia'; choose from qa, counterfactual"),
    (dict(subtasks=()), "subtasks is empty"),
    (dict(subtasks=("qa", "qa")), "names one twice"),
    (dict(judge="gpt-4o"), "unknown judge 'gpt-4o'"),
    (dict(judge="python:no_such_module_xyz:judge"), "cannot import 'no_such_module_xyz'"),
    (dict(samples=0), "samples must be at least 1"),
    (dict(choices=1), "choices must be at least 2"),
    (dict(judge_timeout=0.0), "judge_timeout must be positive"),
    (dict(context_length=-1), "context_length must be >= 0"),
])
def test_bad_options_are_refused_before_running(options, message):
    with pytest.raises(ValueError, match=message):
        get_task("hallucination", **options)


def test_forced_choice_splits_a_tie_at_the_top_so_no_preference_scores_chance():
    from difftransformer.eval.lm import first_place_share

    assert [first_place_share([-1.0, -2.0, -3.0, -4.0], i) for i in range(4)] == [1.0, 0.0, 0.0, 0.0]
    assert [first_place_share([-28.52] * 4, i) for i in range(4)] == [0.25] * 4  # flat logits: chance, 1/4
    assert [first_place_share([-1.0, -1.0 - 1e-12, -5.0], i) for i in range(3)] == [0.5, 0.5, 0.0]  # rounding ties


def test_a_counterfactual_states_a_value_as_long_as_the_world_value_where_the_pool_has_one(data, data_dir):
    """The forced choice between the context's value and memory's (choice_memory_counterfactual) compares equally
    long continuations wherever the pool allows: the stated value is drawn with the world value's token count."""
    tok = data.tokenizer()
    items = task(samples=12, subtasks=("counterfactual",)).make_samples(
        CopyLM(data.vocab_size, tok.eos_id), tok, cfg(data_dir))[0]["counterfactual"]
    size = {}
    for s in items:
        for v in s.fact.pool:
            size[v] = cue_tokens(tok, s, v)
        same = [v for v in s.fact.pool if v != s.fact.world and size[v] == size[s.fact.world]]
        if same:
            assert size[s.fact.value] == size[s.fact.world], (s.fact.world, s.fact.value)
    assert len({size[s.fact.world] for s in items}) > 1  # world values differ in count: the rule had work to do
    assert all(s.chance(s.fact.value) == s.chance(s.fact.world) for s in items if size[s.fact.value]
               == size[s.fact.world])
