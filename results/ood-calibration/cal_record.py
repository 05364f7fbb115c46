"""Write a calibration run's record beside the others: results/ood-calibration/<name>.json, from its run folder
(model_config.json, train_config.json, metrics.jsonl) and the study config whose task it trained on.

    python results/ood-calibration/cal_record.py runs/cal_induction-diff-nope-24k cal_induction-diff-nope-24k \\
        configs/studies/ood-induction.toml "DIFF without position encoding ... : learned / not learned"

The record keeps what the recipes table reads: the model's shape and position encoding, the training recipe,
the synthetic task's settings, every validation loss, and a one-line note saying what the run showed.
"""
import datetime
import json
import platform
import sys
import tomllib
from pathlib import Path

MODEL_KEYS = ("attention", "hidden_size", "num_hidden_layers", "num_attention_heads", "position_encoding")
TRAIN_KEYS = ("seq_len", "batch_size", "max_steps", "lr", "min_lr", "warmup_steps", "seed")


def main(run: Path, name: str, config: Path, note: str) -> Path:
    model = json.loads((run / "model_config.json").read_text())
    train = json.loads((run / "train_config.json").read_text())
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    task = tomllib.loads(config.read_text()).get("data", {}).get("task", {})
    import torch

    record = {"run": name, "date": datetime.date.today().isoformat(),
              "machine": f"{platform.processor() or platform.machine()}, torch {torch.__version__}",
              "model": {k: model.get(k) for k in MODEL_KEYS},
              "train": {k: train.get(k) for k in TRAIN_KEYS},
              "task": "\n".join(f"{k} = {json.dumps(v)}" for k, v in task.items()),
              "val_loss": [{k: r[k] for k in ("step", "loss", "tokens")} for r in rows if r.get("kind") == "val"],
              "note": note}
    out = Path(__file__).parent / f"{name}.json"
    out.write_text(json.dumps(record, indent=2) + "\n")
    return out


if __name__ == "__main__":
    if len(sys.argv) != 5:
        sys.exit(__doc__)
    print(main(Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), sys.argv[4]))
