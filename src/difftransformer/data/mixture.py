"""Training mixtures: generated task documents added to the TRAIN split, so that small models learn the formats
the evaluations ask in.

`generate_mixture(config, train_docs, tokenizer)` returns documents of four kinds, each made of the
evaluations' own text pieces (data/needle.py for needles, data/templates.py for the others), and how many tokens
each kind took. `prepare_data` appends them to the train split after the tokenizer is trained on the
corpus alone; val and test stay pure corpus, so validation loss and the evaluations' held-out
haystacks do not change. Every document is a new document (the shard puts EOS before it), as every
evaluation prompt starts with EOS.

Kinds (`MixtureConfig` fractions):
- needle: [instruction][corpus haystack with k needles at random token positions][question][answers],
  k uniform in 1..max_needles (data/needle.needle_document, whose module doc states the layout). The
  haystack is a contiguous window of the train split's tokens, EOS removed (as the evaluation takes
  held-out tokens), cut between any two tokens by the needles, as the evaluation does.
- needles_only: [instruction][needles only, each its own city and number][question][answers] (RULER
  multi-key, the needle task's haystack "needles"; data/needle.needles_only_document).
- icl: demonstrations "Item: the {adjective} {noun}\\nKind: {label}" joined by "\\n==\\n" (the icl
  task's format and the `synthetic` set's prefixes), filling the length; the last one is the "query"
  with its answer. Each document draws 2 to 4 noun groups and gives each a label drawn at random
  from ICL_LABELS, so the label of an item can only be read from an earlier item with the same noun:
  the in-context copying the synthetic set measures, not a mapping stored in weights.
- qa: the hallucination task's qa prompt, "Answer the question using only the passage.\\n\\nPassage:
  {train text with a fact at a random sentence boundary}\\n\\nQuestion: {question}\\nAnswer: {cue}",
  answered " {value}{tail}." The fact is a made-up person's (`person_fact`), drawn again when its value
  already occurs in the window (as the evaluation does).

Leakage: haystacks and passages are train-split text only, so no evaluation haystack (test split)
is ever trained on. Needle cities come from the evaluation's list but every document draws its own
cities and 7-digit numbers (9e6 values): a test prompt's (city, number) pairs are new to the model.
ICL items use nouns and labels that the evaluation's labelled sets never use (checked at import):
no test item of any labelled set, nor the synthetic set's noun -> kind mapping, is ever shown.
QA facts are fresh random draws; a memorised fact would only hurt (the value is random per prompt).

Sizes: with T corpus tokens in the train split and fractions f_k summing to S < 1, kind k gets
documents until its tokens (each document's tokens plus its EOS) are within half a document of
f_k * T / (1 - S), i.e. its share of the resulting train split. Each kind has its own seeded stream
(`MixtureConfig.seed` and the kind's name), so changing one fraction changes no other kind's documents,
only how many there are (the split grows): one kind's documents for a larger target extend its list.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from .config import MIXTURE_KINDS, MixtureConfig
from .corpus import Document
from .needle import needle_document, needles_only_document
from .templates import (
    ICL_SEPARATOR,
    SYNTHETIC_ADJECTIVES,
    SYNTHETIC_KINDS,
    SYNTHETIC_X_PREFIX,
    SYNTHETIC_Y_PREFIX,
    fact_prompt,
    held_out_text,
    icl_demo,
    insert_at_depth,
    person_fact,
)
from .tokenizer import Tokenizer

MAX_ATTEMPTS = 50  # draws per qa document before giving up with the reason
# Noun groups and labels of the icl documents: none is a noun or label of an evaluation's labelled set.
ICL_GROUPS = (("apple", "pear", "plum"), ("car", "boat", "truck"), ("shirt", "coat", "scarf"),
              ("violin", "drum", "flute"), ("chair", "table", "bed"), ("bread", "cheese", "soup"),
              ("river", "lake", "pond"), ("snake", "frog", "lizard"), ("cup", "bowl", "plate"),
              ("pencil", "brush", "chalk"))
ICL_LABELS = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "kappa", "sigma", "omega")


def _disjoint_from_eval() -> None:
    eval_words = set(SYNTHETIC_KINDS) | {n for nouns in SYNTHETIC_KINDS.values() for n in nouns}
    ours = set(ICL_LABELS) | {n for group in ICL_GROUPS for n in group}
    assert not eval_words & ours, f"icl mixture words overlap the evaluation's: {sorted(eval_words & ours)}"


_disjoint_from_eval()


@dataclass
class Mixture:
    """The generated documents (kinds in MIXTURE_KINDS order) and what each kind took."""

    documents: list[Document]
    num_tokens: dict[str, int]  # per kind, EOS included (as the shard counts them)
    num_documents: dict[str, int]
    corpus_tokens: int  # the train split's corpus tokens the fractions were sized against
    targets: dict[str, int] = field(default_factory=dict)

    def summary(self, config: MixtureConfig) -> dict:
        """What prepared.json records."""
        return {"config": config.to_dict(), "num_tokens": self.num_tokens, "num_documents": self.num_documents,
                "corpus_tokens": self.corpus_tokens}


@dataclass(frozen=True)
class _Format:
    x_prefix: str
    y_prefix: str


_ICL_FORMAT = _Format(SYNTHETIC_X_PREFIX, SYNTHETIC_Y_PREFIX)


class TrainText:
    """The train split's tokens: with EOS between documents (for passages) and without (for haystacks)."""

    def __init__(self, docs: Sequence[Document], tokenizer: Tokenizer, batch: int = 256):
        parts: list[np.ndarray] = []
        for i in range(0, len(docs), batch):
            for ids in tokenizer.encode_batch([d.text for d in docs[i:i + batch]]):
                parts.append(np.asarray([*ids, tokenizer.eos_id], dtype=np.int32))
        self.tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
        self.eos_id = tokenizer.eos_id
        self.plain = self.tokens[self.tokens != self.eos_id]

    def window(self, rng: random.Random, n: int, plain: bool = True) -> tuple[int, np.ndarray]:
        source = self.plain if plain else self.tokens
        if n > len(source):
            raise ValueError(f"a mixture document needs {n} tokens of train text but the train split has only "
                             f"{len(source)}; lower data.mixture.length or use a larger corpus")
        start = rng.randrange(len(source) - n + 1)
        return start, source[start:start + n]


# ------------------------------------------------------------------------------------------- documents


def icl_document(rng: random.Random, tok: Tokenizer, length: int) -> str:
    """Demonstrations "Item: the {adj} {noun}\\nKind: {label}" joined by the icl separator, about `length` tokens."""
    groups = rng.sample(ICL_GROUPS, rng.randint(2, 4))
    label = dict(zip(groups, rng.sample(ICL_LABELS, len(groups))))
    demos: list[str] = []
    used = 1 - len(tok.encode(ICL_SEPARATOR))  # the EOS; the first demonstration has no separator before it
    while True:
        group = rng.choice(groups)
        demo = icl_demo(_ICL_FORMAT, (f"the {rng.choice(SYNTHETIC_ADJECTIVES)} {rng.choice(group)}", label[group]))
        cost = len(tok.encode(ICL_SEPARATOR + demo))
        if used + cost > length:
            break
        demos.append(demo)
        used += cost
    if len(demos) < 2:
        raise ValueError(f"data.mixture.length = {length} tokens cannot hold two icl demonstrations; raise "
                         f"data.mixture.length")
    return ICL_SEPARATOR.join(demos)


def qa_document(rng: random.Random, tok: Tokenizer, text: TrainText, length: int) -> str:
    """The hallucination task's qa prompt on train text, answered; about `length` tokens with its EOS."""
    for _ in range(MAX_ATTEMPTS):
        fact = person_fact(rng)
        answer = fact.continuation(fact.value, summary=False) + f"{fact.tail}."
        overhead = 1 + len(tok.encode(fact_prompt("qa", fact.sentence, fact)[0] + answer))
        if overhead + 8 > length:
            raise ValueError(f"data.mixture.length = {length} tokens leaves no passage for a qa document (its "
                             f"instruction, fact and question take {overhead}); raise data.mixture.length")
        start, _ = text.window(rng, length - overhead, plain=False)
        passage_text = held_out_text(text.tokens, start, length - overhead, tok, text.eos_id)
        if re.search(rf"\b{re.escape(fact.value)}\b", passage_text, re.IGNORECASE):
            continue
        passage, _, _ = insert_at_depth(passage_text, fact.sentence, rng.random())
        return fact_prompt("qa", passage, fact)[0] + answer
    raise ValueError(f"could not find train text without the fact's value in {MAX_ATTEMPTS} tries")


# ------------------------------------------------------------------------------------------- the mixture


def _maker(kind: str, tok: Tokenizer, text: TrainText, config: MixtureConfig) -> Callable[[random.Random], str]:
    return {
        "needle": lambda rng: needle_document(rng, tok, text, config.length, config.max_needles),
        "needles_only": lambda rng: needles_only_document(rng, tok, config.length),
        "icl": lambda rng: icl_document(rng, tok, config.length),
        "qa": lambda rng: qa_document(rng, tok, text, config.length),
    }[kind]


def generate_mixture(config: MixtureConfig, train_docs: Sequence[Document], tokenizer: Tokenizer) -> Mixture:
    """The documents of every kind with a fraction > 0, sized against the corpus tokens of `train_docs`;
    a fraction too small for one whole document is refused (`_check_target`), never made silently empty."""
    text = TrainText(train_docs, tokenizer)
    corpus_tokens = int(len(text.tokens))
    total = corpus_tokens / (1 - sum(config.fractions.values()))
    docs: list[Document] = []
    num_tokens, num_docs, targets = {}, {}, {}
    for kind in MIXTURE_KINDS:
        if config.fractions[kind] == 0:
            continue
        target = round(config.fractions[kind] * total)
        _check_target(kind, config, target)
        rng = random.Random(f"mixture/{config.seed}/{kind}")
        make = _maker(kind, tokenizer, text, config)
        got, count = 0, 0
        while target - got > config.length / 2:
            doc = make(rng)
            got += len(tokenizer.encode(doc)) + 1
            docs.append(Document(f"mixture/{kind}/{count:07d}", doc, {"mixture": kind}))
            count += 1
        num_tokens[kind], num_docs[kind], targets[kind] = got, count, target
    return Mixture(docs, num_tokens, num_docs, corpus_tokens, targets)


def _check_target(kind: str, config: MixtureConfig, target: int) -> None:
    """Refuse a fraction > 0 whose token target is at most half of one document.

    Documents are made whole, one of `config.length` tokens at a time, while more than half a document is
    still wanted; a smaller target would get no document at all, and the prepared data would lack the kind
    its config (and prepared.json) asks for."""
    if target > config.length / 2:
        return
    at_most = f" (to at most {2 * target:,})" if target else ""
    raise ValueError(f"data.mixture.{kind} = {config.fractions[kind]:g} is {target:,} tokens, less than half of "
                     f"one {config.length:,}-token document, so no {kind} document would be made; lower "
                     f"data.mixture.length{at_most} or raise the fraction")

