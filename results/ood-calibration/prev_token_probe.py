"""Where an induction model's heads look on in-distribution sequences: per layer and head, the mean attention weight
from each trigger's successor (the token after a trigger: the key an induction head must find, which must first
learn which trigger precedes it) to that trigger (t - 1, "prev"), to the other trigger tokens before it ("other
triggers") and to the BOS token (position 0: without position encoding a head can only tell how far it is from
the start by the weight it gives the one token that is always there), on 200 sequences of the `ood` test set at 1x (the family and
its settings from the run's prepared-data folder; seeded as `eval ood` seeds it). A DIFF head is read on each map
(A1, A2) and on the signed map A1 - λA2; a Transformer head has one map.

    python results/ood-calibration/prev_token_probe.py runs/ood-induction/seed1/transformer_nope ...

Each argument is a run folder (its final/ weights) or a checkpoint folder inside one (checkpoints/step_N).
"""
import json
import sys
from pathlib import Path

import numpy as np
import torch

from difftransformer.data import PreparedData
from difftransformer.data.ood import Condition
from difftransformer.data.ood.episodes import ITEM
from difftransformer.data.ood.families import SPECIALS
from difftransformer.data.ood.sampler import eval_set
from difftransformer.train import load_model

torch.set_num_threads(1)


def run_folder(path: Path) -> Path:
    return path.parent.parent if path.parent.name == "checkpoints" else path


def probe(path: Path) -> None:
    run = run_folder(path)
    family = PreparedData.load(json.loads((run / "train_config.json").read_text())["data_dir"]).family()
    model = load_model(path / "final" if path == run else path, "cpu").model.eval()
    first_trigger = len(SPECIALS) + family.background_vocab
    episodes = eval_set(family, Condition(length=1.0), 200, seed=0)
    sums: dict[tuple[int, str, str], torch.Tensor] = {}
    count = 0
    with torch.no_grad():
        for start in range(0, len(episodes), 50):
            part = episodes.take(np.arange(start, min(start + 50, len(episodes))))
            out = model(torch.from_numpy(part.inputs), return_attention=True)
            trigger = torch.from_numpy(part.inputs >= first_trigger)  # (B, T)
            b, t = torch.nonzero(trigger[:, :-1] & (torch.from_numpy(part.role[:, 1:]) == ITEM), as_tuple=True)
            t = t + 1  # the successors
            earlier = torch.arange(part.inputs.shape[1])[None] < (t - 1)[:, None]  # (N, S): keys before t - 1
            others = (trigger[b] & earlier).double()
            count += len(b)
            for i, maps in enumerate(out.attentions):
                named = {"a1": maps.a1} if maps.a2 is None else {"a1": maps.a1, "a2": maps.a2, "diff": maps.diff}
                for name, m in named.items():  # (B, heads, T, S)
                    rows = m[b, :, t].double()  # (N, heads, S)
                    for what, x in (("prev", rows[torch.arange(len(b)), :, t - 1]),
                                    ("other triggers", (rows * others[:, None]).sum(-1)), ("bos", rows[..., 0])):
                        key = (i, name, what)
                        sums[key] = sums[key] + x.sum(0) if key in sums else x.sum(0)
    print(f"{path}: {count} successors")
    for (i, name, what), total in sums.items():
        print(f"  layer {i} {name:>4} {what:>14}: " + " ".join(f"{v:.3f}" for v in (total / count).tolist()))


for arg in sys.argv[1:]:
    probe(Path(arg))
