"""Where an MQAR calibration model errs, on 2,000 fresh sequences of its own task (read from the run folder):
accuracy by query index, by pairs in the context and by distance from the answer to its pair, and whether a
wrong answer is another value of the context. A model that answers by elimination (the value no earlier query
took) is right on the last query of a sequence whose every pair is asked, whatever it attends to.

    python results/ood-calibration/mqar_probe.py runs/cal/mqar-t-lr1e-3/final
"""
import json
import sys
from pathlib import Path

import numpy as np
import torch

from difftransformer.data.ood.families import SPECIALS, family_from_dict
from difftransformer.model import DiffTransformerLM

torch.set_num_threads(1)
run = Path(sys.argv[1]).parent
data_dir = json.loads((run / "train_config.json").read_text())["data_dir"]
family = family_from_dict(json.loads((Path(data_dir) / "prepared.json").read_text())["task"])
e = family.generate(np.random.default_rng(7), 2000)
model = DiffTransformerLM.from_pretrained(sys.argv[1]).eval()
x = torch.from_numpy(e.inputs)
with torch.no_grad():
    pred = torch.cat([model(x[i:i + 250]).logits for i in range(0, len(x), 250)]).argmax(-1).numpy()
rows, cols = np.nonzero(e.targets >= 0)
ok = pred[rows, cols] == e.targets[rows, cols]
query = e.answer_query[rows, cols]
pairs = np.array([len(set(e.support[r][e.support[r] >= 0])) for r in rows])
dist = np.array([c - np.nonzero(e.support[r] == e.answer_item[r, c])[0].max() for r, c in zip(rows, cols)])
print(f"{family.to_dict()}\naccuracy {ok.mean():.3f} over {len(ok)} answers")
for k in np.unique(query):
    print(f"query {k}: {ok[query == k].mean():.3f} ({(query == k).sum()})")
for k in np.unique(pairs):
    print(f"{k} pairs: {ok[pairs == k].mean():.3f}")
for lo, hi in [(0, 15), (15, 30), (30, 45), (45, 1000)]:
    m = (dist >= lo) & (dist < hi)
    if m.any():
        print(f"distance {lo}-{hi}: {ok[m].mean():.3f} ({m.sum()})")
first_value = len(SPECIALS) + family.num_keys
values = [set(s[(s >= first_value) & (s < first_value + family.num_values)]) for s in e.inputs]
present = np.array([pred[r, c] in values[r] for r, c in zip(rows, cols)])
print(f"wrong answers that are a value of the context: {present[~ok].mean():.3f}")
