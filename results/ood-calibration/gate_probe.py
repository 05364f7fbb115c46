"""The gated control's gates where it answers: the mean sigmoid gate of every layer and head at the answer positions
of 200 sequences of the `ood` test sets at 1x, 4x and 16x the training length (the family and its settings from the
run's prepared-data folder; test sets seeded as `eval ood` seeds them). A gate that closed the retrieving layer's
heads as the context grows would be the gate acting as a switch against attention noise.

    python results/ood-calibration/gate_probe.py runs/ood-maxret/seed0/transformer_gated ...
"""
import json
import sys
from pathlib import Path

import numpy as np
import torch

from difftransformer.data import PreparedData
from difftransformer.data.ood import Condition
from difftransformer.data.ood.sampler import eval_set
from difftransformer.train import load_model

torch.set_num_threads(1)
for run in map(Path, sys.argv[1:]):
    family = PreparedData.load(json.loads((run / "train_config.json").read_text())["data_dir"]).family()
    model = load_model(run / "final", "cpu").model.eval()
    gates: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(model.layers):
        layer.self_attn.head_gate.register_forward_hook(
            lambda module, args, out, i=i: gates.__setitem__(i, torch.sigmoid(out.float())))
    print(run)
    for factor in (1.0, 4.0, 16.0):
        episodes = eval_set(family, Condition(length=factor), 200, seed=0)
        seen: dict[int, list[np.ndarray]] = {i: [] for i in range(len(model.layers))}
        with torch.no_grad():
            for start in range(0, len(episodes), 25):
                part = episodes.take(np.arange(start, min(start + 25, len(episodes))))
                model(torch.from_numpy(part.inputs))
                rows, cols = np.nonzero(part.answer_mask)
                for i, g in gates.items():
                    seen[i].append(g[rows, cols].numpy())
        means = {i: np.concatenate(v).mean(0) for i, v in seen.items()}
        print(f"  {factor:>4}x  " + "  ".join(f"layer {i}: " + " ".join(f"{x:.3f}" for x in m)
                                          for i, m in means.items()))
