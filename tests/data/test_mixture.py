"""Training mixtures: corpus-only data unchanged, fractions honoured, documents in the evaluations' exact formats.

Documents are parsed back with regular expressions written from the evaluations' templates, and the
fractions are measured on the written train shard (split at EOS), not taken from the generator's counts.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from difftransformer.data import (
    DataConfig,
    DataMismatchError,
    MixtureConfig,
    PreparedData,
    ensure_data,
    load_corpus,
    prepare_data,
)
from difftransformer.data.mixture import ICL_GROUPS, ICL_LABELS, generate_mixture
from difftransformer.data.needle import CITIES, INSTRUCTION
from difftransformer.data.templates import ICL_SEPARATOR, QA_INSTRUCTION, SYNTHETIC_KINDS, icl_prompt
from difftransformer.run_config import ConfigError, load_run_config
from tests.helpers import write_corpus

LENGTH = 512  # a 300-token BPE spends about two tokens per word: the instruction alone takes ~80
MIX = dict(needle=0.2, needles_only=0.1, icl=0.1, qa=0.1, length=LENGTH, max_needles=4, seed=3)
NEEDLE = re.compile(r" The special magic (.+?) number is: (\d{7})\.")
ONE = re.compile(r"\nWhat is the special magic (.+?) number\? The special magic \1 number is (\d{7})\.$")
MANY = re.compile(r"\nWhat are the special magic numbers for (.+?)\?((?: The special magic .+? number is \d{7}\.)+)$")
CUE = re.compile(r" The special magic (.+?) number is (\d{7})\.")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return str(write_corpus(tmp_path_factory.mktemp("mix") / "corpus", n_docs=30, words=300))


@pytest.fixture(scope="module")
def plain(corpus, tmp_path_factory) -> PreparedData:
    return prepare_data(corpus, tmp_path_factory.mktemp("plain") / "data", vocab_size=300)


@pytest.fixture(scope="module")
def mixed(corpus, tmp_path_factory) -> PreparedData:
    return prepare_data(corpus, tmp_path_factory.mktemp("mixed") / "data", vocab_size=300,
                        mixture=MixtureConfig(**MIX))


def _files(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file() and p.name != ".lock"}


def _generated(data: PreparedData, plain: PreparedData) -> list[tuple[str, int]]:
    """(text, tokens with EOS) of every document after the corpus part of the train shard."""
    tokens = np.asarray(data.dataset("train").tokens)
    rest = tokens[plain.num_tokens["train"]:]
    ends = np.flatnonzero(rest == data.dataset("train").eos_id)
    tok, out, start = data.tokenizer(), [], 0
    for end in ends:
        out.append((tok.decode(rest[start:end].tolist()), int(end - start + 1)))
        start = end + 1
    assert start == len(rest)
    return out


def _kind(text: str) -> str:
    if text.startswith(QA_INSTRUCTION):
        return "qa"
    if text.startswith("Item: "):
        return "icl"
    assert text.startswith(INSTRUCTION), text[:80]
    return "needles_only" if text[len(INSTRUCTION):].startswith(" The special magic") and \
        not NEEDLE.sub("", text[len(INSTRUCTION):text.index("\nWhat")]) else "needle"


# ------------------------------------------------------------------------------------------- unchanged


def test_no_mixture_leaves_prepared_data_byte_identical(corpus, plain, tmp_path):
    for i, mix in enumerate([MixtureConfig(), MixtureConfig(length=64, max_needles=2, seed=9)]):  # inactive
        other = prepare_data(corpus, tmp_path / str(i), vocab_size=300, mixture=mix)
        assert _files(other.out_dir) == _files(plain.out_dir)
    manifest = (plain.out_dir / "prepared.json").read_text()
    assert "mixture" not in manifest
    assert DataConfig().resolved_dir() == "cache/data/sotu-8192" and "mixture" not in DataConfig().to_dict()


def test_mixture_touches_only_train_and_keeps_the_corpus_tokenizer(plain, mixed):
    a, b = _files(plain.out_dir), _files(mixed.out_dir)
    for name in ("val.bin", "test.bin", plain.tokenizer_path.name):
        assert a[name] == b[name]
    assert b["train.bin"][:len(a["train.bin"])] == a["train.bin"]  # the corpus part, then the generated documents
    assert mixed.num_tokens["train"] > plain.num_tokens["train"]
    assert mixed.mixture["config"] == MixtureConfig(**MIX).to_dict()
    assert mixed.mixture["corpus_tokens"] == plain.num_tokens["train"]
    assert PreparedData.load(mixed.out_dir).mixture == mixed.mixture


def test_fractions_are_honoured_on_the_written_shard(plain, mixed):
    docs = _generated(mixed, plain)
    total = mixed.num_tokens["train"]
    measured = {k: 0 for k in ("needle", "needles_only", "icl", "qa")}
    for text, n in docs:
        measured[_kind(text)] += n
    assert measured == mixed.mixture["num_tokens"]
    assert plain.num_tokens["train"] + sum(measured.values()) == total
    for kind, got in measured.items():
        assert abs(got / total - MIX[kind]) <= 0.75 * LENGTH / total, (kind, got / total)
    assert all(n <= LENGTH + 8 for _, n in docs)  # about `length` tokens each


# ------------------------------------------------------------------------------------------- formats


def _parse_needle_doc(text: str) -> tuple[dict[str, str], dict[str, str], str]:
    """(needle city -> number, queried city -> answered number, the haystack with needles removed)."""
    assert text.startswith(INSTRUCTION)
    q = text.index("\nWhat ")
    body, tail = text[len(INSTRUCTION):q], text[q:]
    needles = dict(NEEDLE.findall(body))
    assert len(needles) == len(NEEDLE.findall(body))  # distinct cities
    one, many = ONE.search(tail), MANY.search(tail)
    assert one or many, tail
    if one:
        answers = {one.group(1): one.group(2)}
        assert tail == one.group(0)
    else:
        answers = dict(CUE.findall(many.group(2)))
        asked = many.group(1).replace(", and ", ", ").split(", ")
        assert sorted(asked) == sorted(answers) and len(asked) == 2
    return needles, answers, NEEDLE.sub("", body)


def test_needle_documents_answer_with_the_needles_numbers(plain, mixed):
    docs = [t for t, _ in _generated(mixed, plain) if _kind(t) == "needle"]
    assert len(docs) >= 5
    counts = set()
    for text in docs:
        needles, answers, haystack = _parse_needle_doc(text)
        assert all(c in CITIES for c in needles) and 1 <= len(needles) <= 4
        assert answers and all(needles[c] == x for c, x in answers.items())
        assert all(text.count(x) == 1 + (c in answers) for c, x in needles.items())
        assert len(haystack.split()) > 10  # corpus text around the needles
        counts.add(len(needles))
    assert len(counts) > 1


def test_needles_only_documents_hold_only_needles_and_the_question(plain, mixed):
    docs = [t for t, _ in _generated(mixed, plain) if _kind(t) == "needles_only"]
    assert docs
    for text in docs:
        needles, answers, rest = _parse_needle_doc(text)
        assert rest == "" and len(needles) >= 3
        assert all(needles[c] == x for c, x in answers.items())


def test_icl_documents_use_the_icl_format_and_never_the_evaluations_items(plain, mixed):
    docs = [t for t, _ in _generated(mixed, plain) if _kind(t) == "icl"]
    eval_words = set(SYNTHETIC_KINDS) | {n for v in SYNTHETIC_KINDS.values() for n in v}
    nouns = {n for g in ICL_GROUPS for n in g}
    fmt = type("F", (), {"x_prefix": "Item: ", "y_prefix": "Kind: "})
    for text in docs:
        items = [re.fullmatch(r"Item: the (\w+) (\w+)\nKind: (\w+)", d) for d in text.split(ICL_SEPARATOR)]
        assert all(items) and len(items) >= 5
        pairs = [(f"the {m.group(1)} {m.group(2)}", m.group(3)) for m in items]
        assert icl_prompt(fmt, pairs[:-1], pairs[-1][0]) + " " + pairs[-1][1] == text  # the icl task's prompt
        label = {}
        for m in items:
            assert m.group(2) in nouns and m.group(3) in ICL_LABELS and not {m.group(2), m.group(3)} & eval_words
            assert label.setdefault(m.group(2), m.group(3)) == m.group(3)  # one label per noun in a document


def test_qa_documents_answer_with_the_inserted_fact(plain, mixed):
    docs = [t for t, _ in _generated(mixed, plain) if _kind(t) == "qa"]
    assert docs
    for text in docs:
        m = re.fullmatch(rf"{re.escape(QA_INSTRUCTION)}\n\nPassage: (.+)\n\nQuestion: (.+)\nAnswer: (.+)", text,
                         re.DOTALL)
        assert m, text[-200:]
        passage, answer = m.group(1), m.group(3)
        assert answer.endswith(".") and passage.count(answer) == 1  # the answer restates the inserted fact
        assert len(passage) > len(answer) + 50


# ------------------------------------------------------------------------------------------- config, identity


def test_generation_is_deterministic_and_seeded(corpus, plain):
    docs = load_corpus(corpus)[:10]
    tok = plain.tokenizer()
    a = generate_mixture(MixtureConfig(**MIX), docs, tok)
    b = generate_mixture(MixtureConfig(**MIX), docs, tok)
    c = generate_mixture(MixtureConfig(**{**MIX, "seed": 4}), docs, tok)
    d = generate_mixture(MixtureConfig(**{**MIX, "qa": 0.2}), docs, tok)
    assert [x.text for x in a.documents] == [x.text for x in b.documents]
    assert [x.text for x in a.documents] != [x.text for x in c.documents]
    needles = lambda m: [x.text for x in m.documents if x.meta["mixture"] == "needle"]  # noqa: E731
    assert needles(d)[:len(needles(a))] == needles(a)  # own stream: more qa only adds needle documents (a larger
    assert len(needles(d)) > len(needles(a))            # split at the same fraction), never changes one


def test_folder_names_keep_mixed_and_plain_data_apart():
    names = {DataConfig(mixture=MixtureConfig(needle=0.1)).resolved_dir(),
             DataConfig(mixture=MixtureConfig(needle=0.2)).resolved_dir(),
             DataConfig(mixture=MixtureConfig(needle=0.1, seed=1)).resolved_dir(),
             DataConfig(mixture=MixtureConfig(needle=0.1, length=128)).resolved_dir(),
             DataConfig().resolved_dir()}
    assert len(names) == 5
    assert DataConfig(mixture={"icl": 0.05}).to_dict()["mixture"]["icl"] == 0.05


@pytest.mark.parametrize("override, message", [
    ("data.mixture.needle=-0.1", "data.mixture.needle must be a fraction"),
    ("data.mixture.icl=1", "data.mixture.icl must be a fraction"),
    ("data.mixture.needle=0.6", "must sum to less than 1"),
    ("data.mixture.neddle=0.1", "unknown key 'neddle' in [data.mixture] (did you mean 'needle'?)"),
    ("data.mixture.qa=true", "data.mixture.qa must be a float"),
    ("data.mixture.length=8", "data.mixture.length must be at least 32"),
    ("data.mixture=0.1", "data.mixture must be a table"),
])
def test_bad_mixture_settings_are_one_line_errors(override, message):
    with pytest.raises(ConfigError) as e:
        load_run_config(overrides=["data.mixture.qa=0.45", override])
    assert message in str(e.value) and "\n" not in str(e.value)


def test_toml_table_and_set_give_the_same_mixture(tmp_path):
    (tmp_path / "m.toml").write_text("[data]\ncorpus = 'sotu'\n[data.mixture]\nneedle = 0.1\nqa = 0.05\n")
    a = load_run_config(tmp_path / "m.toml")
    b = load_run_config(overrides=["data.mixture.needle=0.1", "data.mixture.qa=0.05"])
    assert a.data.mixture == b.data.mixture == MixtureConfig(needle=0.1, qa=0.05)
    assert a.train.data_dir == a.data.resolved_dir() != load_run_config().data.resolved_dir()


def test_a_folder_with_another_mixture_is_refused(corpus, plain, mixed):
    same = DataConfig(corpus=corpus, vocab_size=300, data_dir=str(mixed.out_dir), mixture=MixtureConfig(**MIX))
    assert ensure_data(same).mixture == mixed.mixture
    for data, mix in [(plain, MixtureConfig(**MIX)), (mixed, MixtureConfig()),
                      (mixed, MixtureConfig(**{**MIX, "seed": 0}))]:
        with pytest.raises(DataMismatchError, match="training mixture"):
            ensure_data(DataConfig(corpus=corpus, vocab_size=300, data_dir=str(data.out_dir), mixture=mix))


def test_prepare_command_line_sets_the_mixture(corpus, tmp_path, capsys):
    from difftransformer.cli import main

    out = tmp_path / "cli"
    assert main(["prepare", corpus, "--out-dir", str(out), "--vocab-size", "300", "--set",
                 "data.mixture.icl=0.1", "--set", f"data.mixture.length={LENGTH}"]) == 0
    assert PreparedData.load(out).mixture["config"]["icl"] == 0.1 and "icl" in capsys.readouterr().out
    assert main(["prepare", corpus, "--out-dir", str(out), "--set", "train.lr=1"]) != 0


def test_a_length_too_short_for_the_template_is_a_clear_error(corpus, plain):
    docs = load_corpus(corpus)[:5]
    with pytest.raises(ValueError, match="raise data.mixture.length"):
        generate_mixture(MixtureConfig(needle=0.5, length=64), docs, plain.tokenizer())
