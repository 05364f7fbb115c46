"""Session set-up and the fixtures several test folders share (helpers live in tests/helpers.py).

Triton decides at import time whether kernels run in its CPU interpreter, and several modules
import it indirectly (torch.compile does), so the switch must be set before any test module loads.
"""

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (`make test` runs one worker per core) each worker computes on one thread: two workers of
# two threads each on two cores would fight for them. A test that needs more threads sets them itself.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"  # and the commands and scripts the tests start in subprocesses


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> str:
    """A small prepared corpus (vocab 300, 24 documents), read-only, shared by the tests that train or evaluate."""
    from difftransformer.data import prepare_data

    root = tmp_path_factory.mktemp("train_data")
    rng = random.Random(0)
    words = ["the", "of", "and", "to", "in", "a", "is", "that", "for", "it"]
    words += ["".join(rng.choice("abcdefghij") for _ in range(rng.randint(2, 7))) for _ in range(200)]
    corpus = root / "corpus"
    corpus.mkdir()
    for i in range(24):
        (corpus / f"doc{i:02d}.txt").write_text(" ".join(rng.choice(words) for _ in range(400)) + ".\n")
    prepare_data(corpus=str(corpus), out_dir=root / "data", vocab_size=300)
    return str(root / "data")
