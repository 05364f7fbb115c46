"""Side-by-side runs: every arm (attention kind) x every seed, paired, resumable, then the report.

Per seed, all arms start from `paired_init` (identical weights wherever names and shapes match) and
see the same batches (the same TrainConfig.seed), so the only difference between arms is the
attention. Layout: <out>/<arm>/ for one seed, <out>/seed<s>/<arm>/ for several; <out>/compare.json
records what was run. Re-running continues unfinished arms and skips finished ones.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import logging
import os
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch

from difftransformer._io import atomic_write_text
from difftransformer.config_files import ConfigError, DataSpec, RunConfig, resolve_vocab
from difftransformer.data import PreparedData, prepare_data
from difftransformer.data.prepare import MANIFEST as DATA_MANIFEST
from difftransformer.eval.report import MANIFEST
from difftransformer.model import DiffTransformerConfig, DiffTransformerLM
from difftransformer.train.metrics import METRICS_FILE, read_metrics

log = logging.getLogger("difftransformer.compare")
DONE = "done.json"


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def ensure_data(spec: DataSpec, wait_s: float = 3600.0) -> PreparedData:
    """Load the prepared shards, preparing them first if the folder has none.

    Under torchrun only rank 0 prepares; the others wait for its manifest, so ranks never race on
    the same files. An existing folder made from another corpus is an error, not a silent reuse.
    """
    data_dir = Path(spec.resolved_dir())
    manifest = data_dir / DATA_MANIFEST
    if not manifest.is_file():
        if _rank() == 0:
            log.info("preparing %s into %s (vocab %d)", spec.corpus, data_dir, spec.vocab_size)
            return prepare_data(spec.corpus, data_dir, vocab_size=spec.vocab_size, tokenizer_path=spec.tokenizer_path,
                                val_fraction=spec.val_fraction, test_fraction=spec.test_fraction, seed=spec.seed)
        deadline = time.monotonic() + wait_s
        while not manifest.is_file():
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {_rank()} waited {wait_s:.0f}s for rank 0 to prepare {data_dir}")
            time.sleep(2.0)
    data = PreparedData.load(data_dir)
    fix = f"set data.data_dir to another folder, or delete {data_dir} to have it prepared again"
    if data.corpus and not _same_corpus(data.corpus, spec.corpus):
        raise ConfigError(f"{data_dir} holds data prepared from corpus {data.corpus!r}, not {spec.corpus!r}; {fix}")
    split = {"val_fraction": spec.val_fraction, "test_fraction": spec.test_fraction, "seed": spec.seed}
    if data.split_config and {k: data.split_config.get(k) for k in split} != split:
        raise ConfigError(f"{data_dir} was split with {data.split_config}, not {split}; {fix}")
    if spec.tokenizer_path is not None:
        from difftransformer.data import Tokenizer

        if Tokenizer.from_file(spec.tokenizer_path).hash != data.tokenizer_hash:
            raise ConfigError(f"{data_dir} was tokenised with another tokenizer than {spec.tokenizer_path}; {fix}")
    elif data.vocab_size > spec.vocab_size:
        raise ConfigError(f"{data_dir} has a {data.vocab_size}-token tokenizer, more than data.vocab_size = "
                          f"{spec.vocab_size}; {fix}")
    return data


def _same_corpus(a: str, b: str) -> bool:
    """Equal specs, or the same local path spelled differently ('./notes' and 'notes')."""
    if a == b:
        return True
    (pa, _, oa), (pb, _, ob) = a.partition("#"), b.partition("#")
    return oa == ob and Path(pa).exists() and Path(pa).resolve() == Path(pb).resolve()


def hardware() -> dict[str, Any]:
    """What the numbers were measured on: tokens/s means little without it."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info: dict[str, Any] = {"cpu": cpu, "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                            "torch": torch.__version__, "python": platform.python_version(),
                            "platform": platform.platform(), "world_size": int(os.environ.get("WORLD_SIZE", "1"))}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_count"] = torch.cuda.device_count()
    return info


def invocation() -> str:
    """The command line as the user typed it (console script or python -m), for the report."""
    prog = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "difftransformer"
    prog = "python -m difftransformer" if prog in ("__main__.py", "-m", "") else prog
    torchrun = os.environ.get("WORLD_SIZE", "1") != "1"
    return ("torchrun ... " if torchrun else "") + " ".join([prog, *map(shlex.quote, sys.argv[1:])])


def arm_dir(out_dir: Path, arm: str, seed: int, multi_seed: bool) -> Path:
    return out_dir / f"seed{seed}" / arm if multi_seed else out_dir / arm


def is_finished(run_dir: Path, max_steps: int) -> bool:
    """final/ exists and the metrics reach max_steps (a final/ from a shorter earlier run does not count)."""
    if not (run_dir / "final" / "model.safetensors").is_file():
        return False
    done = run_dir / DONE
    if done.is_file():
        return int(json.loads(done.read_text()).get("final_step", -1)) >= max_steps
    metrics = run_dir / METRICS_FILE
    if not metrics.is_file():
        return False
    return max((r.get("step", -1) for r in read_metrics(metrics)), default=-1) >= max_steps


def arm_configs(base: DiffTransformerConfig, arms: list[str]) -> list[DiffTransformerConfig]:
    """Each arm is the base size spec with another attention kind (heads converted by `matched`)."""
    return [base.matched(a) for a in arms]


def _manifest(cfg: RunConfig, arms: list[str], seeds: list[int], configs: list[DiffTransformerConfig],
              data: PreparedData, command: str | None) -> dict[str, Any]:
    counts = {a: DiffTransformerLM(c, device="meta").num_parameters() for a, c in zip(arms, configs)}
    train = cfg.train.to_dict()
    train.pop("out_dir")
    return {
        "format": "difftransformer-compare-v1",
        "arms": arms,
        "seeds": seeds,
        "baseline": "transformer" if "transformer" in arms else arms[-1],
        "models": {a: c.to_dict() for a, c in zip(arms, configs)},
        "parameters": counts,
        "train": train,
        "data": {**dataclasses.asdict(cfg.data), "data_dir": str(data.out_dir),
                 "corpus": data.corpus or cfg.data.corpus,
                 "num_tokens": data.num_tokens, "num_documents": data.num_documents,
                 "vocab_size": data.vocab_size, "corpus_hash": data.corpus_hash},
        "report": {k: getattr(cfg.compare, k) for k in ("prompts", "sample_tokens", "temperature", "top_k")},
        "config_file": cfg.source,
        "command": command or invocation(),
        "hardware": hardware(),
        "started": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "wall_s": {},
    }


def _check_same_study(old: dict[str, Any], new: dict[str, Any], path: Path) -> None:
    """Resuming into a folder that holds another comparison would mix two studies in one report."""
    for key in ("models", "data"):
        o, n = dict(old.get(key, {})), dict(new[key])
        if key == "data":  # what the tokens are matters; where they are cached does not
            o = {k: o.get(k) for k in ("corpus_hash", "vocab_size")}
            n = {k: n.get(k) for k in ("corpus_hash", "vocab_size")}
        else:  # arms may be added to a comparison; the ones it already has must be unchanged
            o, n = {a: c for a, c in o.items() if a in n}, {a: c for a, c in n.items() if a in o}
        if o != n:
            raise ConfigError(f"{path} was written for a different comparison ({key} differ); use another "
                              f"--out-dir, or delete {path.parent} to start over")


def write_json(path: Path, payload: dict[str, Any]) -> None:
    atomic_write_text(path, json.dumps(payload, indent=2) + "\n")


def run_compare(cfg: RunConfig, out_dir: str | Path, *, arms: list[str] | None = None, seeds: list[int] | None = None,
                resume: bool = True, command: str | None = None, report: bool = True) -> Path:
    """Train every arm for every seed (paired), then write <out_dir>/report.md; returns out_dir."""
    from difftransformer.train import paired_init, train

    out_dir = Path(out_dir)
    arms = list(arms or cfg.compare.arms)
    seeds = list(seeds if seeds is not None else (cfg.compare.seeds or [cfg.train.seed]))
    multi = len(seeds) > 1
    data = ensure_data(cfg.data)
    resolve_vocab(cfg, data.vocab_size)
    configs = arm_configs(cfg.model, arms)

    manifest = _manifest(cfg, arms, seeds, configs, data, command)
    path = out_dir / MANIFEST
    if path.is_file():
        old = json.loads(path.read_text())
        _check_same_study(old, manifest, path)
        manifest["started"] = old.get("started", manifest["started"])
        manifest["wall_s"] = old.get("wall_s", {})
        # Keep arms/seeds from earlier invocations so the report covers everything in the folder.
        manifest["arms"] = arms + [a for a in old.get("arms", []) if a not in arms]
        manifest["seeds"] = sorted(set(seeds) | set(old.get("seeds", [])))
        manifest["models"] = {**old.get("models", {}), **manifest["models"]}
        manifest["parameters"] = {**old.get("parameters", {}), **manifest["parameters"]}
    if _rank() == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        write_json(path, manifest)

    for seed in seeds:
        dirs = [arm_dir(out_dir, a, seed, multi) for a in arms]
        pending = [i for i, d in enumerate(dirs) if not (resume and is_finished(d, cfg.train.max_steps))]
        for i in set(range(len(arms))) - set(pending):
            log.info("seed %d, arm %s: already finished in %s; skipping", seed, arms[i], dirs[i])
        if not pending:
            continue
        states = paired_init(configs, seed)  # ignored by train() for arms that resume from a checkpoint
        for i in pending:
            tcfg = dataclasses.replace(cfg.train, out_dir=str(dirs[i]), seed=seed)
            log.info("seed %d, arm %s (%d/%d): training into %s", seed, arms[i], pending.index(i) + 1,
                     len(pending), dirs[i])
            t0 = time.perf_counter()
            result = train(configs[i], tcfg, init_state=states[i], resume=resume)
            wall = time.perf_counter() - t0
            if _rank() == 0:
                key = f"seed{seed}/{arms[i]}"
                manifest["wall_s"][key] = manifest["wall_s"].get(key, 0.0) + wall if resume else wall
                write_json(path, manifest)
                write_json(dirs[i] / DONE, {"final_step": result.final_step, "final_val_loss": result.final_val_loss,
                                            "tokens_per_s": result.tokens_per_s, "wall_s": wall})
            states[i] = None  # free memory early: big models
            del result
    if _rank() == 0:
        manifest["finished"] = dt.datetime.now().astimezone().isoformat(timespec="seconds")
        write_json(path, manifest)
        if report:
            from difftransformer.eval.report import write_report

            write_report(out_dir)
    return out_dir
