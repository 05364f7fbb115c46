"""Fixtures of the data tests: one small tokenizer trained once per module."""

import random

import pytest

from difftransformer.data import Tokenizer
from tests.helpers import sentences


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    rng = random.Random(1)
    texts = [sentences(rng, 200) for _ in range(20)] + ["naïve café 日本語 🎉 Ωmega\n" * 5]
    return Tokenizer.train(texts, vocab_size=400)
