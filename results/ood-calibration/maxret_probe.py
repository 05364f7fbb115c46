"""What a max-retrieval calibration model predicts at its answer token, on 2,000 fresh sequences of the calibration
task (4-8 items among 32-48 tokens): accuracy, the mean probability on the answer, and on the values present in
the context (any item's). A model that copies some item's value but cannot find the largest key puts nearly all its
probability on the values present and ~1/(distinct values present) on the answer.

    python results/ood-calibration/maxret_probe.py runs/cal/maxret-diff-short/final ...
"""
import sys

import numpy as np
import torch

from difftransformer.data.ood.families import SPECIALS, MaxRetrieval
from difftransformer.model import DiffTransformerLM

torch.set_num_threads(1)
family = MaxRetrieval(min_context=32, max_context=48)
episodes = family.generate(np.random.default_rng(123), 2000)
first_value = len(SPECIALS) + family.num_keys
rows, cols = np.nonzero(episodes.targets >= 0)
answers = episodes.targets[rows, cols]
present = np.zeros((len(rows), first_value + family.num_values), dtype=bool)
for i, r in enumerate(rows):
    seq = episodes.inputs[r]
    present[i, np.unique(seq[(seq >= first_value) & (seq < first_value + family.num_values)])] = True
x = torch.from_numpy(episodes.inputs)
for path in sys.argv[1:]:
    model = DiffTransformerLM.from_pretrained(path).eval()
    with torch.no_grad():
        logits = torch.cat([model(x[i:i + 250]).logits for i in range(0, len(x), 250)])
    probs = logits.float().softmax(-1).numpy()[rows, cols][:, :present.shape[1]]
    p_answer = probs[np.arange(len(rows)), answers]
    print(f"{path}: accuracy {(probs.argmax(1) == answers).mean():.3f}, p(answer) {p_answer.mean():.3f}, "
          f"p(values present) {(probs * present).sum(1).mean():.3f}, "
          f"distinct values present {present.sum(1).mean():.2f}")
