"""The text formats of the synthetic in-context tasks: what evaluations ask and what training mixtures teach.

The evaluations (eval/tasks/icl.py with eval/labelled.py, eval/tasks/hallucination.py) build their
prompts from these pieces, and the training mixture (data/mixture.py) builds its documents from the
same pieces, so a model trained on a mixture has seen the exact wording it is tested on. They live in
`data` because `data` may import only the base modules: the mixture cannot import `eval`, while
`eval` may import `data`. Each format is defined here once. (The needle task's format, draws and
samples have their own module, data/needle.py.)

- In-context learning (eval/tasks/icl.py): demonstrations `{x_prefix}{text}\\n{y_prefix}{label}`
  joined by ICL_SEPARATOR, the query without its label (`icl_demo`, `icl_query`, `icl_prompt`); the
  `synthetic` labelled set's nouns, kinds, adjectives and prefixes.
- Context QA (eval/tasks/hallucination.py): facts about made-up people (`Fact`, `person_fact` and
  the value tables), the QA / summary prompt (`fact_prompt`), a held-out window as text
  (`held_out_text`) and where a fact goes in it (`insert_at_depth`).
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

# ------------------------------------------------------------------------------- in-context learning

ICL_SEPARATOR = "\n==\n"


class Prefixed(Protocol):
    """Anything with the two prompt prefixes of a labelled set (eval/labelled.LabelledSet)."""

    x_prefix: str
    y_prefix: str


def icl_demo(data: Prefixed, item: tuple[str, str]) -> str:
    return f"{data.x_prefix}{item[0]}\n{data.y_prefix}{item[1]}"


def icl_query(data: Prefixed, text: str) -> str:
    """The test item without its label; ends with the label prefix, no trailing space (as the original)."""
    return f"{data.x_prefix}{text}\n{data.y_prefix}".rstrip()


def icl_prompt(data: Prefixed, demos: Sequence[tuple[str, str]], text: str) -> str:
    """k demonstrations and the test item, joined by the separator."""
    return ICL_SEPARATOR.join([*(icl_demo(data, d) for d in demos), icl_query(data, text)])


# the `synthetic` labelled set (eval/labelled.py): "the {adjective} {noun}" -> the noun's kind
SYNTHETIC_X_PREFIX, SYNTHETIC_Y_PREFIX = "Item: ", "Kind: "
SYNTHETIC_KINDS: dict[str, tuple[str, ...]] = {
    "animal": ("horse", "sheep", "bird"),
    "plant": ("tree", "rose", "wheat"),
    "metal": ("iron", "copper", "silver"),
    "tool": ("hammer", "knife", "spade"),
}
SYNTHETIC_ADJECTIVES = ("old", "new", "small", "large", "young", "heavy", "cheap", "rare", "common", "fine",
                        "plain", "strange", "famous", "local", "foreign", "quiet", "simple", "whole", "single",
                        "broken", "dark", "bright", "long", "short", "wet", "dry", "hot", "cold", "clean", "dirty",
                        "soft", "hard", "thin", "thick", "tall", "wide", "rough", "smooth", "sharp", "pale")


# ----------------------------------------------------------------------------------------- context QA

QA_INSTRUCTION = "Answer the question using only the passage."
SUMMARY_INSTRUCTION = "Restate the key fact of the passage in one sentence."
SUMMARY_CUE = "In summary,"

FIRST_NAMES = ("Maria", "Aiko", "Omar", "Elena", "Tomas", "Priya", "Lukas", "Amara", "Diego", "Ingrid", "Kofi",
               "Mei", "Rafael", "Sofia", "Henrik", "Leila", "Mateo", "Nadia", "Viktor", "Yusuf")
LAST_NAMES = ("Lopez", "Okafor", "Tanaka", "Novak", "Haddad", "Lindqvist", "Moreau", "Kowalski", "Brennan",
              "Castillo", "Petrov", "Nakamura", "Osei", "Fischer", "Romano", "Dubois", "Sato", "Varga", "Mendes",
              "Halvorsen")
FACT_CITIES = ("Lyon", "Porto", "Krakow", "Osaka", "Tampere", "Valencia", "Gdansk", "Leeds", "Bergen", "Graz",
               "Bologna", "Utrecht", "Ghent", "Seville", "Turku", "Brno", "Nantes", "Malmo", "Aarhus", "Cork")
JOBS = ("baker", "pilot", "tailor", "dentist", "plumber", "painter", "sailor", "jeweller", "librarian", "potter",
        "surveyor", "chemist", "butcher", "carpenter", "florist")
COLOURS = ("green", "purple", "orange", "yellow", "crimson", "violet", "turquoise", "scarlet", "indigo", "amber",
           "silver", "maroon")
YEARS = tuple(str(y) for y in range(1850, 2000))
AMOUNTS = tuple(f"{500 * n:,}" for n in range(2, 199))

# (subject with {name}, relation, value pool, tail after the value, question with {name})
PERSON_RELATIONS = (
    ("{name}", "was born in", FACT_CITIES, "", "Where was {name} born?"),
    ("{name}", "was born in the year", YEARS, "", "In which year was {name} born?"),
    ("{name}", "works as a", JOBS, "", "What is {name}'s job?"),
    ("{name}'s favourite colour", "is", COLOURS, "", "What is {name}'s favourite colour?"),
    ("{name}", "paid", AMOUNTS, " dollars for the farm", "How many dollars did {name} pay for the farm?"),
)


@dataclass(frozen=True)
class Fact:
    """One inserted fact: "{subject} {relation} {value}{tail}." and how it is asked back."""

    subject: str
    relation: str
    value: str  # the in-context answer
    tail: str
    question: str
    pool: tuple[str, ...]  # values of the same kind (the judge's candidates, the forced choice's distractors)
    world: str | None = None  # the world-knowledge value a counterfactual contradicts

    @property
    def sentence(self) -> str:
        return f"{self.subject} {self.relation} {self.value}{self.tail}."

    def continuation(self, value: str, summary: bool) -> str:
        """What follows the cue when the model states `value`."""
        return f" {self.relation} {value}{self.tail}" if summary else f" {value}"


def person_fact(rng: random.Random) -> Fact:
    name = f"{rng.choice(FIRST_NAMES)} {rng.choice(LAST_NAMES)}"
    subject, relation, pool, tail, question = rng.choice(PERSON_RELATIONS)
    return Fact(subject.format(name=name), relation, rng.choice(pool), tail, question.format(name=name), pool)


def fact_prompt(subtask: str, passage: str, fact: Fact) -> tuple[str, str, str]:
    """(prompt, question or instruction, cue): the prompt ends with the cue, which the answer continues."""
    if subtask == "summary":
        cue = f"{SUMMARY_CUE} {fact.subject}"
        return f"Passage: {passage}\n\n{SUMMARY_INSTRUCTION}\n{cue}", SUMMARY_INSTRUCTION, cue
    cue = f"{fact.subject} {fact.relation}"
    return f"{QA_INSTRUCTION}\n\nPassage: {passage}\n\nQuestion: {fact.question}\nAnswer: {cue}", fact.question, cue


_SENTENCE_BOUNDARY = re.compile(r"(?<=[.!?])\s+")


def held_out_text(tokens: np.ndarray, start: int, count: int, text_tokenizer, eos_id: int) -> str:
    """The split's tokens [start, start + count) as text: documents joined by a blank line, a word cut by
    either end of the window dropped."""
    window = tokens[start:start + count].tolist()
    pieces, current = [], []
    for t in window:
        if t == eos_id:
            pieces.append(current)
            current = []
        else:
            current.append(t)
    pieces.append(current)
    text = "\n\n".join(text_tokenizer.decode(p) for p in pieces)
    cut_start = start > 0 and tokens[start - 1] != eos_id and window and window[0] != eos_id \
        and not text_tokenizer.decode(window[:1])[:1].isspace()
    end = start + count
    cut_end = end < len(tokens) and tokens[end] != eos_id \
        and not text_tokenizer.decode([int(tokens[end])])[:1].isspace()
    if cut_start:
        i = next((k for k, c in enumerate(text) if c.isspace()), len(text))
        text = text[i:]
    if cut_end:
        i = max((k for k, c in enumerate(text) if c.isspace()), default=0)
        text = text[:i]
    return text.strip()


def insert_at_depth(text: str, sentence: str, depth: float) -> tuple[str, str, str]:
    """(passage, before, after): `sentence` put at the sentence boundary of `text` nearest to
    depth * len(text); before/after are the held-out text on either side as it reads in the passage."""
    bounds = [0, len(text)] + [m.start() for m in _SENTENCE_BOUNDARY.finditer(text)]
    at = min(bounds, key=lambda b: (abs(b - depth * len(text)), b))
    before, after = text[:at].rstrip(), text[at:].lstrip()
    return " ".join(p for p in (before, sentence, after) if p), before, after
