"""What torch.compile's Inductor puts around DIFF's fused attention: the kernels of one compiled training step.

For each arm (DIFF and its matched Transformer) one forward and backward of a model is compiled, and the code
Inductor writes for the two graphs (TORCH_LOGS=output_code) is kept as `<out>/<arm>_output_code.py`. The
table counts, per arm and graph, the kernels Inductor launches, the extern calls (matmuls, SDPA, our custom
ops) and the copy kernels: those named for `clone`, `copy` or `contiguous` (in the kernel's name or its ATen
ops) whose ATen ops only move data (a layout or dtype change Inductor makes, not a computation of the model).
Each copy kernel of either arm is listed with the ATen ops it was made from, and each call of
`difftransformer::diff_flash_fwd/bwd` with its arguments (a `reinterpret_tensor` of a producer's buffer: read in
place; a buffer of a copy kernel: copied first), so a layout copy that the custom ops force can be found and
removed. Compiled DIFF trails compiled SDPA
(docs/benchmarks.md); this names the extra kernels behind it.

    python benchmarks/inductor_graph.py --device cuda --preset gpu-small --layers 2 --seq-len 2048 \
        --batch 2 --precision bf16 --out runs/gpu/inductor
    TRITON_INTERPRET=1 python benchmarks/inductor_graph.py --cpu-smoke-test   # the code path, on the CPU

On the CPU (torch 2.13, the Triton interpreter, tiny preset) DIFF's step has no copy kernel: the custom ops read
the RoPE kernel's and the projections' buffers in place. Whatever the GPU's graph adds is Inductor's choice for
CUDA, and this script shows it.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import DEVICES, machine, resolve_device  # noqa: E402

COPY_WORDS = ("clone", "copy", "contiguous")
OUR_OPS = re.compile(r"torch\.ops\.difftransformer\.(\w+)\.default\((.*)\)\s*$")


class _OutputCode(logging.Handler):
    """Keeps the text of every compiled graph's output code (the records that hold a `def call(`)."""

    def __init__(self) -> None:
        super().__init__()
        self.graphs: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if "def call(" in text:
            self.graphs.append(text)


def compiled_step_code(model, ids: torch.Tensor) -> list[str]:
    """The output code of the forward and backward graphs of one compiled training step of `model`. Read from
    the `output_code` artifact (torch._logging.set_logs, documented), whose loggers' names end in
    "__output_code"; their records are kept here and not printed."""
    import torch._inductor.graph  # noqa: F401  (registers the artifact's loggers)

    handler = _OutputCode()
    torch._logging.set_logs(output_code=True)
    loggers = [logging.getLogger(name) for name in list(logging.Logger.manager.loggerDict)
               if name.endswith("__output_code")]
    kept = [lg.propagate for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.propagate = False
    try:
        torch._dynamo.reset()
        logits = torch.compile(model)(ids).logits
        logits.float().logsumexp(-1).mean().backward()
    finally:
        for lg, propagate in zip(loggers, kept):
            lg.removeHandler(handler)
            lg.propagate = propagate
        torch._logging.set_logs()
    if not handler.graphs:
        raise RuntimeError(f"no output code was captured: torch {torch.__version__} logs it under other logger "
                           f"names than '*__output_code' (found {len(loggers)}); run with TORCH_LOGS=output_code")
    return handler.graphs


def kernel_calls(code: str) -> list[tuple[str, str]]:
    """(kernel name, its source comment) for every kernel launch in one graph's `call`: a Triton kernel's
    `.run(` or a C++ kernel's call, each after its "# Topologically Sorted Source Nodes" comment."""
    out, source = [], ""
    body = code.split("def call(", 1)[-1]
    for line in body.splitlines():
        text = line.strip()
        if text.startswith("# Topologically Sorted Source Nodes"):
            source = text
        elif m := re.match(r"(triton_\w+|cpp_fused_\w+)(?:\.run)?\(", text):
            out.append((m.group(1), source))
    return out


def is_copy(name: str, source: str) -> bool:
    """A kernel that only moves data into another layout or dtype: one of COPY_WORDS in its name or its ATen
    ops, and nothing else computed (a fused kernel that also adds or multiplies computes the model)."""
    ops = re.findall(r"aten\.(\w+)", source.split("Original ATen:", 1)[-1]) if "Original ATen" in source else []
    moves = {"clone", "copy", "copy_", "contiguous", "_to_copy", "view", "_unsafe_view", "permute", "transpose",
             "expand", "reshape", "t", "unsqueeze", "squeeze", "select", "slice", "as_strided"}
    named = any(w in name for w in COPY_WORDS) or any(any(w in op for w in COPY_WORDS) for op in ops)
    return named and bool(ops) and all(op in moves for op in ops)


def our_op_calls(code: str) -> list[tuple[str, str]]:
    """(op name, argument text) of every call of a difftransformer custom op in one graph."""
    return [(m.group(1), m.group(2)) for line in code.splitlines() if (m := OUR_OPS.search(line.strip()))]


def summarise(arm: str, graphs: list[str]) -> tuple[list[list[str]], list[str]]:
    """Table rows (arm, graph, kernels, extern calls, copy kernels, custom-op calls) and the detail lines."""
    rows, detail = [], []
    for n, code in enumerate(graphs):
        name = "backward" if "_backward" in code.split("def call(", 1)[0] else "forward"
        kernels = kernel_calls(code)
        copies = [(k, s) for k, s in kernels if is_copy(k, s)]
        externs = len(re.findall(r"extern_kernels\.\w+\(|torch\.ops\.\w+\.\w+\.default\(", code))
        ops = our_op_calls(code)
        rows.append([arm, f"{n} ({name})", str(len(kernels)), str(externs), str(len(copies)), str(len(ops))])
        detail += [f"- {arm} {name}: copy kernel `{k}` from {s.split(':', 1)[-1].strip()}" for k, s in copies]
        detail += [f"- {arm} {name}: `{op}`({args[:300]})" for op, args in ops]
    return rows, detail


def build(args, attention: str, device: torch.device):
    from difftransformer import DiffTransformerLM, get_preset

    cfg = get_preset(args.preset).config("diff", attn_backend=args.backend, num_hidden_layers=args.layers,
                                         max_position_embeddings=max(args.seq_len, 256))
    if attention != "diff":
        cfg = cfg.matched(attention)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    return DiffTransformerLM(cfg).to(device=device, dtype=dtype), cfg


def parse_args(argv=None):
    head, rest = __doc__.split("\n\n", 1)
    p = argparse.ArgumentParser(description=head, epilog=rest, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", choices=DEVICES)
    p.add_argument("--preset", default=None, help="model size preset (default: gpu-small on CUDA, tiny on the CPU)")
    p.add_argument("--layers", type=int, default=2, help="layers of the model (every layer compiles alike)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: 2048 CUDA, 64 CPU)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--precision", choices=("bf16", "fp32"), default=None, help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--backend", default="auto", help="DIFF's attention backend ('triton' for the fused kernel on "
                   "the CPU interpreter; 'auto' picks it on CUDA in bf16)")
    p.add_argument("--out", default="runs/inductor", help="where the output code of each arm is written")
    p.add_argument("--cpu-smoke-test", action="store_true", help="tiny, on the CPU with the Triton interpreter")
    args = p.parse_args(argv)
    try:
        device = resolve_device("cpu" if args.cpu_smoke_test else args.device)
    except ValueError as e:
        p.error(str(e))
    cuda = device.type == "cuda"
    args.preset = args.preset or ("gpu-small" if cuda else "tiny")
    args.seq_len = args.seq_len or (2048 if cuda else 64)
    args.precision = args.precision or ("bf16" if cuda else "fp32")
    if args.cpu_smoke_test:
        if os.environ.get("TRITON_INTERPRET") != "1":
            p.error("--cpu-smoke-test runs the fused kernel in the Triton interpreter: set TRITON_INTERPRET=1")
        args.backend, args.layers = "triton", 1
    if args.layers < 1 or args.batch < 1 or args.seq_len < 2:
        p.error(f"--layers, --batch must be >= 1 and --seq-len >= 2; got {args.layers}, {args.batch}, {args.seq_len}")
    return args, device


def main(argv=None) -> int:
    args, device = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, detail = [], []
    for attention in ("diff", "transformer"):
        model, cfg = build(args, attention, device)
        ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len), device=device)
        graphs = compiled_step_code(model, ids)
        (out / f"{attention}_output_code.py").write_text("\n\n# ---- next graph ----\n\n".join(graphs))
        r, d = summarise(attention, graphs)
        rows += r
        detail += d
    print(f"# Inductor's kernels for one compiled training step: {args.preset}, {args.layers} layers, "
          f"T={args.seq_len}, batch {args.batch}, {args.precision}, on {device.type} ({machine(device)})\n")
    print("| arm | graph | kernels | extern calls | copy kernels | custom-op calls |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print("\n" + ("\n".join(detail) if detail else "(no copy kernel and no custom-op call)"))
    print(f"\noutput code: {out}/<arm>_output_code.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
