"""How long `eval ood` scores a test set, and what computing only the answer rows saves.

`score()` asks the model for the logits from each batch's first answer position on (`logits_to_keep`), so the
last block computes only those rows. This times it against the same scoring with every position's logits
computed and then cut (the model called without `logits_to_keep`), interleaved round by round so machine load
hits both alike, on the OOD studies' own model shapes (configs/studies/ood-<family>.toml, untrained weights:
the work does not depend on them) at 1x, 4x and 16x the training length, plain and with adaptive temperature.

    python benchmarks/ood_eval.py                          # maxret, induction, flipflop; transformer and diff
    python benchmarks/ood_eval.py --families maxret --rounds 9 --sequences 256

A row's "kept / full" is the time ratio per round, median [95% interval]; below 1 is faster. The answers of
max retrieval come last (the last block shrinks to a few rows: about half a 2-layer model's work), induction's
and flip-flop's lie all along the sequence (nothing to cut: the ratio should be 1).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import subprocess
import sys
import tomllib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import MedianInterval, interleaved_times, machine  # noqa: E402

from difftransformer import DiffTransformerLM  # noqa: E402
from difftransformer.data.ood import Condition  # noqa: E402
from difftransformer.data.ood.families import family_from_dict  # noqa: E402
from difftransformer.data.ood.sampler import eval_set  # noqa: E402
from difftransformer.eval.probes.ood import adaptive_temperature_queries, score  # noqa: E402
from difftransformer.model.config import model_config_from_section  # noqa: E402
from difftransformer.model.inputs import keep_last_positions  # noqa: E402

STUDIES = Path(__file__).resolve().parent.parent / "configs" / "studies"


@contextlib.contextmanager
def full_logits(model: DiffTransformerLM):
    """The model computes every position's logits, then cuts them as `logits_to_keep` asks: the cost of
    scoring without the last block's rows cut, with the same outputs."""
    forward = model.forward

    def full(ids, logits_to_keep: int = 0, **kwargs):
        out = forward(ids, **kwargs)
        out.logits = keep_last_positions(out.logits, logits_to_keep)
        return out

    model.forward = full
    try:
        yield
    finally:
        del model.forward


def study(family: str):
    """(model config, task family) of configs/studies/ood-<family>.toml."""
    cfg = tomllib.loads((STUDIES / f"ood-{family}.toml").read_text())
    return model_config_from_section(cfg["model"]), family_from_dict(cfg["data"]["task"])


def measure(model, episodes, hook, rounds: int, batch: int) -> tuple[float, float, MedianInterval]:
    """(ms per sequence full, ms per sequence kept, kept / full per round)."""
    def scored_full():
        with full_logits(model):
            score(model, episodes, batch, "cpu", hook)

    t_full, t_kept = interleaved_times([scored_full, lambda: score(model, episodes, batch, "cpu", hook)], rounds)
    n = len(episodes)
    med = lambda t: 1e3 * sorted(t)[len(t) // 2] / n  # noqa: E731
    return med(t_full), med(t_kept), MedianInterval.ratio(t_kept, t_full)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", default="maxret,induction,flipflop",
                   help="comma-separated study families (configs/studies/ood-<family>.toml; default: %(default)s)")
    p.add_argument("--arms", default="transformer,diff", help="attention kinds (default: %(default)s)")
    p.add_argument("--lengths", default="1,4,16", help="length factors (default: %(default)s)")
    p.add_argument("--sequences", type=int, default=128, help="sequences per test set (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default %(default)s; 6+ for an "
                   "interval)")
    p.add_argument("--batch", type=int, default=32, help="sequences per batch, as eval's (default: %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    families = [f for f in args.families.split(",") if f]
    for f in families:
        if not (STUDIES / f"ood-{f}.toml").is_file():
            p.error(f"no study config configs/studies/ood-{f}.toml for family {f!r}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"# eval ood scoring, {dt.date.today()}, {machine()}, commit {commit}")
    print(f"# python benchmarks/ood_eval.py --families {','.join(families)} --arms {args.arms} --lengths "
          f"{args.lengths} --sequences {args.sequences} --rounds {args.rounds} --batch {args.batch}")
    print("| family | condition | tokens | arm | scoring | full ms/seq | kept ms/seq | kept / full |")
    print("|---|---|---|---|---|---|---|---|")
    for name in families:
        base, family = study(name)
        for factor in (float(x) for x in args.lengths.split(",")):
            condition = Condition(length=factor)
            if family.max_length(condition) > base.max_position_embeddings:
                print(f"| {name} | {condition.name} | {family.max_length(condition)} | past the model's "
                      f"{base.max_position_embeddings} positions | | | | |")
                continue
            episodes = eval_set(family, condition, args.sequences, seed=0)
            for arm in args.arms.split(","):
                torch.manual_seed(0)
                model = DiffTransformerLM(base.matched(arm)).eval()
                for label, hook in (("plain", None), ("adaptive", adaptive_temperature_queries)):
                    full, kept, ratio = measure(model, episodes, hook, args.rounds, args.batch)
                    print(f"| {name} | {condition.name} | {family.max_length(condition)} | {arm} | {label} | "
                          f"{full:.2f} | {kept:.2f} | {ratio.cell(3)} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
