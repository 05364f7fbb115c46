"""Re-measure the attention of study units whose `ood` result predates the signed map's parts.

Since 2026-11-27 the `ood` probe keeps the positive and negative parts of A1 - λA2 apart
("diff_positive_mass", "diff_negative_mass"); the report reads the retrieving head's shares from them, and
a DIFF unit measured before has no entry there. This script re-runs only the mechanism (eval/probes/ood.py
`mechanism`, on the same first `attention_sequences` sequences of each condition's fixed test set) for every
unit of a study's results folder that lacks them (DIFF kinds: a softmax map has no negative part), from the
unit's trained model (its run folder must be on this machine), and replaces each cell's "attention" entry in
the unit's result file; accuracy is untouched. The ood result gains "attention_remeasured" (date, commit,
command).

    python results/ood-remeasure-attention.py results/ood-flipflop [--dry-run]
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from difftransformer._io import atomic_write_text
from difftransformer.data.ood import Condition, family_from_dict
from difftransformer.data.ood.sampler import eval_set
from difftransformer.eval.probes.ood import head_shares, mechanism, retrieving_head, summary_masses
from difftransformer.train.run_dir import load_model

MAPS = ("diff", "a1", "a2")


def _needs(ood: dict) -> bool:
    """A signed map (A1 − λA2 is not A1) measured without its parts; a softmax map's parts are itself."""
    cells = ood.get("details", {}).get("cells", [])
    layers = [layer for c in cells for layer in c.get("attention", {}).get("layers", [])]
    return any("diff_positive_mass" not in layer and layer["diff_mass"] != layer["a1_mass"] for layer in layers)


def _remeasure(unit_file: Path, ood: dict) -> None:
    record = json.loads(unit_file.read_text())
    run = Path(record["run_dir"])
    model = load_model(run, "cpu").model.eval()
    settings = ood["settings"]
    family = family_from_dict(settings["family"])
    seed, sequences = settings["eval_config"]["eval_seed"], settings["options"]["attention_sequences"]
    for cell in ood["details"]["cells"]:
        if "attention" not in cell:
            continue
        episodes = eval_set(family, Condition(length=cell["length"], density=cell["density"]), cell["sequences"],
                            seed=seed)
        sample = episodes.take(np.arange(min(sequences, len(episodes))))
        attention = mechanism(model, sample, "cpu")
        if attention["answer_positions"] != cell["attention"]["answer_positions"]:
            raise RuntimeError(f"{unit_file} {cell['condition']}: {attention['answer_positions']} answer positions, "
                               f"the stored result has {cell['attention']['answer_positions']}: not the same sequences")
        attention["mean"] = {w: summary_masses(attention["layers"], w) for w in MAPS}
        cell["attention"] = attention
        print(f"  {cell['condition']}: {attention['answer_positions']} answer positions", flush=True)
    head = retrieving_head(ood["details"]["cells"][0].get("attention"))  # as the probe: chosen at the training one
    for cell in ood["details"]["cells"]:
        if "attention" in cell:
            cell["attention"].pop("top_head", None)
            cell["attention"]["retrieving"] = head_shares(cell["attention"], head)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    ood["attention_remeasured"] = {"date": datetime.date.today().isoformat(), "commit": commit,
                                   "command": "python results/ood-remeasure-attention.py " + " ".join(sys.argv[1:])}
    record["evals"]["ood"] = ood
    atomic_write_text(unit_file, json.dumps(record, indent=1) + "\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results_dir", type=Path, help="a study's results folder (seed*/<arm>.json)")
    p.add_argument("--dry-run", action="store_true", help="list the units that need it, change nothing")
    args = p.parse_args()
    for unit_file in sorted(args.results_dir.glob("seed*/*.json")):
        ood = json.loads(unit_file.read_text()).get("evals", {}).get("ood")
        if ood and _needs(ood):
            print(unit_file, flush=True)
            if not args.dry_run:
                _remeasure(unit_file, ood)
    return 0


if __name__ == "__main__":
    sys.exit(main())
