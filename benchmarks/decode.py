"""Decoding speed: DIFF LM vs its matched Transformer LM on each attention backend, on CPU or CUDA,
and (on CPU) transformers' Llama.

For each prompt length and batch size, every arm generates new_tokens tokens greedily from a random
prompt with its KV cache (`generate(..., temperature=0)`; for Llama, transformers' `generate(do_sample=False,
use_cache=True)`), and a forward pre-hook on the model splits each generate call in two: prefill ms runs
from the call to the start of the model's second forward (the prompt's forward into a fresh cache and
its first token: time to first token), decode tokens/s is batch * (new_tokens - 1) over the rest (the
single-token steps, each forward with its sampling; the split falls after the first step's input
preparation, a few µs that prefill carries instead). One call gives both, so a prefill's noise never
enters the decode rate (a difference of two calls' times carried it, and at long prompts the prefill is
most of a call). The arms run alternately in one process, in rounds (each arm's call once per round),
so machine load hits all alike; figures are medians over the rounds (on CUDA the clock reads a
synchronised GPU). Timing whole generate calls of every arm, transformers' included, measures what a
user gets, with each library's own loop and prefill (both compute only the last position's logits there).

Arms: the Transformer (T) and DIFF on each of `--backends`: by default the fused C++ kernel (`cpp`,
what 'auto' picks on CPU) and PyTorch's SDPA (`sdpa`) on CPU, and `auto` on CUDA (the fused Triton
kernel for DIFF in bf16, SDPA's FlashAttention for T; the header says what 'auto' resolved to).
'triton' exists for DIFF only, so T has no 'triton' arm; columns follow the arms that run. "best"
is a kind's fastest backend. `Llama (HF)` (CPU only) is transformers' LlamaForCausalLM with the
Transformer arm's sizes (hidden, layers, heads, kv heads, FFN, vocab, RoPE theta, tied
embeddings), random weights, in `--precision`, its default attention; left out when transformers
is not installed. The models are built with a context of the longest prompt plus the new tokens
(the presets' own max_position_embeddings may be shorter than the long prompts). `--precision
bf16` builds every model in bf16 (DIFF's λ vectors stay fp32, as the model keeps them).

Ratios are taken round by round (both arms measured under the same load) and printed as the median
per-round ratio with a distribution-free 95% interval for it (order statistics; from 6 rounds on);
below the table each target (docs/benchmarks.md) gets 'met' or 'not met' at a row only where that interval
(unrounded) lies wholly on one side of its line, else 'open'. The coverage is nominal: it takes rounds
as independent (consecutive rounds on a loaded machine are not quite), and "best" picks each kind's
faster backend from the same rounds. DIFF/T decode is DIFF's tokens/s over the Transformer's (higher is
better for DIFF), at each
kind's best backend and on each backend both kinds run; prefill DIFF/T is a time ratio (lower is
better for DIFF); T cpp/sdpa (when both run) compares our kernel's Transformer decode with SDPA's;
ours/Llama is the best of our two models' decode over Llama's.

    python benchmarks/decode.py                                          # the full CPU table
    python benchmarks/decode.py --prompts 64 512 --batch 1 --new-tokens 16 --repeats 1   # quick
    python benchmarks/decode.py --threads 1        # one thread: steadier on a shared machine
    python benchmarks/decode.py --device cuda --preset gpu-small --precision bf16 --prompts 512 2048 \\
        --new-tokens 128 --backends auto sdpa      # GPU: fused Triton DIFF vs SDPA, both kinds
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import DEVICES, MedianInterval, kernel_times, machine, print_trace, resolve_device, sync  # noqa: E402

BACKEND_CHOICES = ("auto", "cpp", "sdpa", "triton", "eager")
DEFAULT_BACKENDS = {"cpu": ("cpp", "sdpa"), "cuda": ("auto",)}
DECODERS = ("dynamic", "static", "graph")
DEFAULT_DECODERS = {"cpu": ("dynamic",), "cuda": ("graph", "dynamic")}
KINDS = (("transformer", "T"), ("diff", "DIFF"))
LLAMA = "Llama (HF)"


class Arm:
    """A model and how it generates greedily (prompt, n) -> n new tokens, timed phase by phase (`timed`).

    The phases split where the first new token is known: ours reports each token through generate's
    `on_token` (a CUDA graph's replayed steps call no forward), transformers' Llama through its model's
    second forward (the first single-token step begins)."""

    def __init__(self, name: str, model: torch.nn.Module, generate: Callable[..., object], device: torch.device,
                 streams: bool = True):
        self.name, self.generate, self.device, self.streams = name, generate, device, streams
        self.events, self.split, self.last = 0, 0.0, None
        if not streams:
            model.register_forward_pre_hook(self._on_event)

    def _on_event(self, *args) -> None:
        self.events += 1
        if self.events == (1 if self.streams else 2):  # the prompt and its first token are done
            sync(self.device)
            self.split = time.perf_counter()

    def timed(self, prompt: torch.Tensor, n: int) -> tuple[float, float]:
        """(prefill s, decode s) of one generate of n >= 2 new tokens: up to the first token, and from it to the
        end (n - 1 single-token steps)."""
        self.events = 0
        sync(self.device)
        t0 = time.perf_counter()
        if self.streams:
            self.last = self.generate(prompt, n, on_token=self._on_event)
        else:
            self.last = self.generate(prompt, n)
        sync(self.device)
        t1 = time.perf_counter()
        if self.events != n:  # one token (or forward) per new token, or the split above is not the prefill's end
            raise RuntimeError(f"{self.name}: generate of {n} tokens reported {self.events} steps, not {n}")
        return self.split - t0, t1 - self.split


def _config(preset: str, kind: str, backend: str, context: int):
    from difftransformer import get_preset

    return get_preset(preset).config(kind, attn_backend=backend, max_position_embeddings=context)


def _resolved(cfg, device: torch.device, dtype: torch.dtype) -> str:
    """The backend the arm's attention runs; a ValueError when `cfg`'s backend cannot run on `device`."""
    from difftransformer.attention.backends import resolve_backend

    return resolve_backend(cfg.attn_backend, device, dtype=dtype, ordinary=not cfg.kind.fused_kernel)


def _ours(cfg, name: str, device: torch.device, dtype: torch.dtype, decoder: str,
          models: dict | None = None) -> Arm:
    """An arm of our LM with `cfg`, decoding with `decoder`; arms of one config share its model (`models`)."""
    from difftransformer import DiffTransformerLM

    models = {} if models is None else models
    if id(cfg) not in models:
        torch.manual_seed(0)
        models[id(cfg)] = DiffTransformerLM(cfg, device=device, dtype=dtype).eval()
    model = models[id(cfg)]

    def generate(prompt, n, on_token=None):
        return model.generate(prompt, n, temperature=0, decoder=decoder, on_token=on_token)

    return Arm(name, model, generate, device)


def _llama(preset: str, context: int, dtype: torch.dtype) -> Arm | None:
    """transformers' LlamaForCausalLM with the Transformer arm's sizes; None without transformers."""
    try:
        import transformers
    except ImportError:
        return None
    from difftransformer import get_preset

    transformers.logging.set_verbosity_error()
    c = get_preset(preset).config("transformer", max_position_embeddings=context)
    cfg = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads or c.num_attention_heads, max_position_embeddings=context,
        rope_theta=c.rope_theta, rms_norm_eps=c.rms_norm_eps, tie_word_embeddings=c.tie_word_embeddings,
        attention_bias=False, mlp_bias=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(dtype).eval()

    @torch.no_grad()
    def generate(prompt, n):
        # min_new_tokens: never stop early at a random eos, so every arm makes the same number of tokens
        return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n,
                              min_new_tokens=n, do_sample=False, use_cache=True, pad_token_id=0)

    return Arm(LLAMA, model, generate, torch.device("cpu"), streams=False)


def _med(xs: list[float]) -> float:
    return statistics.median(xs)


def _ratio(a: list[float] | None, b: list[float] | None) -> MedianInterval | str:
    """The median per-round ratio a/b, with its 95% interval (order statistics) where there are enough rounds."""
    if a is None or b is None:
        return "-"
    return MedianInterval.ratio(a, b)


def _best(values: dict[str, list], kind: str, backends, pick) -> list | None:
    """The per-round values of `kind`'s best backend (by median: max for rates, min for times)."""
    arms = [v for b in backends if (v := values.get(f"{kind} {b}")) is not None]
    return pick(arms, key=_med, default=None)


def _ours_best(rate: dict[str, list], backends) -> list | None:
    return max((r for k in ("T", "DIFF") if (r := _best(rate, k, backends, max)) is not None), key=_med, default=None)


def _columns(names: list[str], backends: list[str]) -> list[tuple[str, Callable[[dict, dict], str]]]:
    """The table's columns for the arms that run (`names`, Llama last when it runs): (title, cell of
    (prefill seconds, decode tokens/s), each by arm name as one value per round). One list makes both
    the header and every row."""
    both = [b for b in backends if f"T {b}" in names and f"DIFF {b}" in names]
    cols = [(f"prefill ms {n}", lambda pre, rate, n=n: f"{_med(pre[n]) * 1e3:.1f}") for n in names]
    cols += [("prefill DIFF/T (best)", lambda pre, rate: _ratio(_best(pre, "DIFF", backends, min),
                                                               _best(pre, "T", backends, min)))]
    cols += [(f"decode tok/s {n}", lambda pre, rate, n=n: f"{_med(rate[n]):,.0f}") for n in names]
    cols += [("decode DIFF/T (best)", lambda pre, rate: _ratio(_best(rate, "DIFF", backends, max),
                                                              _best(rate, "T", backends, max)))]
    cols += [(f"decode DIFF/T {b}", lambda pre, rate, b=b: _ratio(rate[f"DIFF {b}"], rate[f"T {b}"])) for b in both]
    if "T cpp" in names and "T sdpa" in names:
        cols += [("decode T cpp/sdpa", lambda pre, rate: _ratio(rate["T cpp"], rate["T sdpa"]))]
    if LLAMA in names:
        cols += [("decode ours/Llama", lambda pre, rate: _ratio(_ours_best(rate, backends), rate[LLAMA]))]
    for k in ("T", "DIFF"):  # a decoder's speed-up over the growing cache, on each backend both decoders run
        cols += [(f"decode {k} {v}/dynamic", lambda pre, rate, k=k, v=v: _ratio(
            rate[f"{k} {v}"], rate[f"{k} {v.rsplit(' ', 1)[0]} dynamic"])) for v in backends
            if not v.endswith(" dynamic") and f"{k} {v}" in names and f"{k} {v.rsplit(' ', 1)[0]} dynamic" in names]
    return cols


# The targets (docs/benchmarks.md), each a column of the table and the side of a line it must be on; a title
# ending in '*' is every column it begins (the graph decoder's columns, one per backend).
TARGETS = (("decode DIFF/T (best)", ">=", 0.95), ("decode T cpp/sdpa", ">=", 1.0),
           ("prefill DIFF/T (best)", "<=", 1.15), ("decode ours/Llama", ">=", 1.0),
           ("decode DIFF/T * graph", ">=", 0.90), ("decode T * graph/dynamic", ">=", 5.0),
           ("decode DIFF * graph/dynamic", ">=", 5.0))


def _matching(title: str, present) -> list[str]:
    """The columns among `present` a TARGETS title names."""
    if "*" not in title:
        return [title] if title in present else []
    head, tail = title.split("*")
    return [t for t in present if t.startswith(head) and t.endswith(tail) and len(t) > len(head) + len(tail)]


def _summary(rows: list[tuple[str, dict]]) -> str:
    """Per target, the rows where it is met, not met and open (by the 95% intervals of the table)."""
    lines = ["", "Targets, by the 95% interval of each median per-round ratio ('open': the interval spans the "
             "line, or fewer than 6 repeats):"]
    targets = [(t, side, line) for pattern, side, line in TARGETS for t in _matching(pattern, rows[0][1] if rows
                                                                                     else {})]
    for title, side, line in targets:
        if not rows or title not in rows[0][1]:
            continue
        groups: dict[str, list[str]] = {"met": [], "not met": [], "open": []}
        for label, cells in rows:
            if isinstance(cells[title], MedianInterval):
                groups[cells[title].verdict(side, line)].append(label)
        parts = [f"{k} at {', '.join(v)}" for k, v in groups.items() if v]
        lines.append(f"- {title} {side} {line:g}: {'; '.join(parts) or 'no data'}")
    return "\n".join(lines)


def _header(cols) -> str:
    titles = ["prompt", "batch", *(t for t, _ in cols)]
    return "| " + " | ".join(titles) + " |\n|" + "---|" * len(titles)


def _row(T: int, B: int, arms: list[Arm], cols, repeats: int, new_tokens: int,
         device: torch.device, first_calls: list[str]) -> tuple[str, dict]:
    """One row of the table and its cells by title. Each round runs every arm's generate once, arm after
    arm (after one warm-up round), so each round gives every arm a prefill time and a decode rate measured
    under the same load, and ratios are taken round by round. The warm-up round's decode time of each arm
    that decodes from a CUDA graph (which it captures there) goes to `first_calls`."""
    prompt = torch.randint(3, 512, (B, T), generator=torch.Generator().manual_seed(T * 131 + B)).to(device)
    first = {arm.name: arm.timed(prompt, new_tokens)[1] for arm in arms}
    _compare_tokens(f"{T}/{B}", arms, first_calls)
    pre: dict[str, list] = {a.name: [] for a in arms}
    rate: dict[str, list] = {a.name: [] for a in arms}
    for _ in range(repeats):
        for arm in arms:
            p, d = arm.timed(prompt, new_tokens)
            pre[arm.name].append(p)
            rate[arm.name].append(B * (new_tokens - 1) / d)
    cells = {title: cell(pre, rate) for title, cell in cols}
    for name, seconds in first.items():
        if name.endswith(" graph"):
            steady = B * (new_tokens - 1) / _med(rate[name])
            first_calls.append(f"{T}/{B} {name}: {seconds * 1e3:.0f} ms (steady {steady * 1e3:.0f} ms)")
    return "| " + " | ".join([str(T), str(B), *map(str, cells.values())]) + " |", cells


def _trace_steps(models: dict, configs: dict, T: int, B: int, steps: int, device: torch.device) -> None:
    """The kernels of `steps` decoding steps of each kind on a static KV cache, run eagerly (the kernels a CUDA
    graph replays), after a prompt of T tokens in a batch of B: the first config of each kind."""
    from difftransformer.model.static_decode import StaticDecoder

    fns, walls = [], []
    for _, k in KINDS:
        cfg = next(c for n, c in configs.items() if n.startswith(f"{k} "))
        model = models[id(cfg)]
        decoder = StaticDecoder(model, B, T + 2 * steps + 1, device, graph=False)  # prompt, one step, 2 x steps
        tokens = torch.zeros(B, dtype=torch.long, device=device)
        with torch.no_grad():
            decoder.start(torch.randint(3, 512, (B, T), device=device), None)
            decoder.step(tokens)

        def step(decoder=decoder, tokens=tokens):
            with torch.no_grad():
                decoder.step(tokens)

        sync(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        sync(device)
        walls.append((time.perf_counter() - t0) / steps)
        fns.append(step)
    print_trace([kernel_times(fn, steps) for fn in fns], tuple(walls))


def _compare_tokens(row: str, arms: list[Arm], notes: list[str]) -> None:
    """Each arm decoding otherwise than 'dynamic' against the 'dynamic' arm of its model: the greedy tokens of
    their warm-up calls, equal or where they first part (a near tie may flip under other rounding)."""
    by_name = {a.name: a for a in arms}
    for arm in arms:
        base = by_name.get(arm.name.rsplit(" ", 1)[0] + " dynamic")
        if base is None or base is arm:
            continue
        differs = (arm.last != base.last).any(dim=0).nonzero()
        if len(differs) == 0:
            notes.append(f"{row} {arm.name}: greedy tokens equal to dynamic")
        else:
            notes.append(f"{row} {arm.name}: greedy tokens part from dynamic at new token "
                         f"{int(differs[0]) - int(row.split('/')[0]) + 1}")


def _parse() -> tuple[argparse.Namespace, torch.device]:
    from difftransformer.model.config import PRESETS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", choices=DEVICES, help="auto: cuda when a GPU is visible")
    p.add_argument("--preset", default=None, choices=list(PRESETS),
                   help="model size (default: gpu-small on CUDA, cpu-small on CPU)")
    p.add_argument("--backends", nargs="+", default=None, choices=BACKEND_CHOICES,
                   help="attention backends each kind runs on (default: cpp sdpa on CPU, auto on CUDA)")
    p.add_argument("--decoders", nargs="+", default=None, choices=DECODERS,
                   help="how our models decode (generate's decoder=): 'dynamic' the growing KV cache, 'static' a "
                        "fixed one, 'graph' that step replayed from a CUDA graph (default: dynamic on CPU, graph "
                        "and dynamic on CUDA); with more than one, arms are named 'kind backend decoder'")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"], help="dtype the models are built in")
    p.add_argument("--prompts", type=int, nargs="+", default=[64, 512, 2048, 4096], help="prompt lengths")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="batch sizes")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generated per row (at least 2)")
    p.add_argument("--repeats", type=int, default=7,
                   help="timed rounds, every arm once per round (medians; ratios get a 95%% interval from 6 "
                        "rounds on); one warm-up round first (default 7)")
    p.add_argument("--trace", type=int, default=0, metavar="STEPS",
                   help="then profile STEPS eager static-cache decoding steps of each kind at the last prompt and "
                        "batch (the kernels a CUDA graph replays) and print each kernel's ms per step")
    p.add_argument("--no-llama", action="store_true", help="leave out transformers' Llama (always out on CUDA)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads for every arm (default: PyTorch's own choice; CPU work only)")
    args = p.parse_args()
    try:
        device = resolve_device(args.device)
    except ValueError as e:
        p.error(str(e))
    if args.threads is not None and args.threads < 1:
        p.error(f"--threads must be positive; got {args.threads}")
    if 2 * args.trace + 1 > args.new_tokens:
        p.error(f"--trace {args.trace} profiles 2 x {args.trace} steps after one, which must fit in the context of "
                f"--new-tokens {args.new_tokens}; raise --new-tokens or lower --trace")
    if args.new_tokens < 2:
        p.error(f"--new-tokens must be at least 2 (one prefill, then decoding steps); got {args.new_tokens}")
    if min(args.prompts) < 1 or min(args.batch) < 1 or args.repeats < 1:
        p.error("--prompts, --batch and --repeats must be positive")
    args.preset = args.preset or ("gpu-small" if device.type == "cuda" else "cpu-small")
    args.backends = list(dict.fromkeys(args.backends or DEFAULT_BACKENDS[device.type]))
    args.decoders = list(dict.fromkeys(args.decoders or DEFAULT_DECODERS[device.type]))
    if "graph" in args.decoders and device.type != "cuda":
        p.error("--decoders graph replays CUDA graphs and needs --device cuda")
    args.variants = [(b if len(args.decoders) == 1 else f"{b} {d}", b, d) for b in args.backends
                     for d in args.decoders]
    args.dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    context = max(args.prompts) + args.new_tokens + 1
    try:  # every arm's backend must run here: refuse before any model is built
        args.configs = {f"{k} {b}": _config(args.preset, kind, b, context) for kind, k in KINDS
                        for b in args.backends if not (b == "triton" and kind == "transformer")}
        args.resolved = {n: _resolved(c, device, args.dtype) for n, c in args.configs.items()}
    except ValueError as e:
        p.error(f"--backends {' '.join(args.backends)} on {device.type} in {args.precision}: {e}")
    return args, device


def main() -> None:
    args, device = _parse()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    from difftransformer.kernels import flash_cpu

    notes = []
    configs = dict(args.configs)
    if "cpp" in args.backends and not flash_cpu.is_available():
        configs = {n: c for n, c in configs.items() if not n.endswith(" cpp")}
        notes.append(f"cpp kernel unavailable: {flash_cpu.build_error()}")
    if "triton" in args.backends:
        notes.append("T has no triton arm (the fused Triton kernel is DIFF-only)")
    models: dict = {}
    arms = [_ours(c, f"{n.split()[0]} {label}", device, args.dtype, decoder, models) for n, c in configs.items()
            for label, backend, decoder in args.variants if n.endswith(f" {backend}")]
    if device.type == "cuda":
        notes.append("Llama (HF) left out on CUDA")
    elif not args.no_llama and (llama := _llama(args.preset, max(args.prompts) + args.new_tokens + 1, args.dtype)):
        arms.append(llama)
    cols = _columns([a.name for a in arms], [label for label, _, _ in args.variants])
    auto = [f"{n}={args.resolved[n]}" for n in configs if n.endswith(" auto")]
    notes = ([f"auto resolves to {', '.join(auto)}"] if auto else []) + notes
    print(f"# Greedy decoding, {args.preset}, {args.precision}, {args.new_tokens} new tokens, medians of "
          f"{args.repeats} rounds (ratios: median per-round ratio [95% interval]), on {device.type} "
          f"({machine(device)}){''.join('; ' + n for n in notes)}\n")
    print(_header(cols), flush=True)
    rows, first_calls = [], []
    for T in args.prompts:
        for B in args.batch:
            line, cells = _row(T, B, arms, cols, args.repeats, args.new_tokens, device, first_calls)
            print(line, flush=True)
            rows.append((f"{T}/{B}", cells))
    print(_summary(rows))
    if args.trace:
        _trace_steps(models, configs, args.prompts[-1], args.batch[-1], args.trace, device)
    if first_calls:
        print("\nWarm-up round (a graph arm captures its step there; greedy tokens against the dynamic arm):\n- "
              + "\n- ".join(first_calls))


if __name__ == "__main__":
    main()
