"""Measurement helpers shared by the benchmarks: device choice, interleaved timing (GPU-synchronised
on CUDA) and peak-memory probes."""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import NamedTuple

import torch

DEVICES = ("auto", "cpu", "cuda")


def resolve_device(name: str) -> torch.device:
    """The device that `--device name` means: 'auto' is CUDA when a GPU is visible, else the CPU.

    A ValueError (one line, for the scripts' `parser.error`) when 'cuda' is asked of a machine without one."""
    if name not in DEVICES:
        raise ValueError(f"--device must be one of {DEVICES}; got {name!r}")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA GPU is visible here (torch.cuda.is_available() is False); "
                         "use --device cpu or auto")
    return torch.device(name)


def sync(device: torch.device) -> None:
    """Wait for the device's queued work, so a wall-clock reading covers it (a no-op on the CPU, where
    calls return when done; on CUDA they return when queued)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _drain() -> None:
    """sync() on the current CUDA device when there is one (the GPU scripts' one device)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def host_ms(fn: Callable[[], None], calls: int = 10) -> float:
    """Mean host time of one call, the device's queue drained first and not awaited after: what it
    costs the CPU to enqueue the call's work. When it reaches the median (device) time, the GPU
    waits for the host, and a faster kernel cannot shorten the call."""
    fn()
    _drain()
    total = 0.0
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        total += time.perf_counter() - t0
        _drain()
    return total / calls * 1e3


def wall_ms(fn: Callable[[], None], iters: int) -> float:
    """Mean time per call of `iters` calls enqueued back to back (CUDA events; wall clock on CPU)."""
    fn()
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) * 1e3 / iters
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def interleaved_times(fns: list[Callable[[], None]], repeats: int, warmup: int = 1,
                      device: torch.device = torch.device("cpu")) -> list[list[float]]:
    """Seconds of every run of each fn, run alternately (a, b, a, b, ...) so machine load hits all alike:
    times[i][r] is fn i's run in round r, so times of one round can be paired.

    On CUDA the clock starts and stops on a synchronised device, so each time is the fn's GPU work
    too, not just the time to queue it."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            times[i].append(time.perf_counter() - t0)
    return times


def interleaved_medians(fns: list[Callable[[], None]], repeats: int, warmup: int = 1,
                        device: torch.device = torch.device("cpu")) -> list[float]:
    """Median seconds of each fn over `interleaved_times`."""
    return [statistics.median(t) for t in interleaved_times(fns, repeats, warmup, device)]


def median_interval(xs: list[float], confidence: float = 0.95) -> tuple[float, float | None, float | None]:
    """(median, low, high): a distribution-free interval for the median of what xs were drawn from, between
    two order statistics whose coverage (binomial, p = 1/2) is at least `confidence`; (median, None, None)
    when there are too few values for one (fewer than 6 at 95%). Machine noise on a ratio of timings is
    neither normal nor symmetric (a busy moment slows one arm of a round), so no t interval."""
    from scipy.stats import binom

    xs = sorted(xs)
    n = len(xs)
    med = statistics.median(xs)
    # [xs[j], xs[n-1-j]] (0-based, sorted) covers the median with probability 1 - 2 P(Binomial(n, 1/2) <= j):
    # the largest j that still reaches `confidence`
    best = None
    for j in range(n // 2):
        if 1 - 2 * binom.cdf(j, n, 0.5) >= confidence:
            best = j
        else:
            break
    return (med, None, None) if best is None else (med, xs[best], xs[n - 1 - best])



class MedianInterval(NamedTuple):
    """A median with its 95% interval from `median_interval` (lo, hi None with too few values); prints as
    a table cell: "0.97 [0.93, 1.01]", or "0.97" alone (`cell(digits)` for other precisions)."""

    med: float
    lo: float | None
    hi: float | None

    @classmethod
    def of(cls, xs: list[float]) -> "MedianInterval":
        return cls(*median_interval(xs))

    @classmethod
    def ratio(cls, a: list[float], b: list[float]) -> "MedianInterval":
        """The median of a / b round by round (both ran in the same round, so load hits them alike)."""
        return cls.of([x / y for x, y in zip(a, b)])

    def cell(self, digits: int = 2) -> str:
        m, lo, hi = self
        return f"{m:.{digits}f}" if lo is None else f"{m:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"

    def __str__(self) -> str:
        return self.cell()

    def verdict(self, side: str, line: float) -> str:
        """A target 'value >= line' (side '>=') or 'value <= line' (side '<='): 'met' / 'not met' where the
        whole interval (unrounded) is on one side of the line, 'open' where it spans the line or there are
        too few values for an interval."""
        if self.lo is None:
            return "open"
        good, bad = (self.lo >= line, self.hi < line) if side == ">=" else (self.hi <= line, self.lo > line)
        return "met" if good else "not met" if bad else "open"


@contextlib.contextmanager
def _silenced_fds():
    """Mute the profiler's own start/stop lines, which bypass Python's streams."""
    saved = [os.dup(1), os.dup(2)]
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        yield
    finally:
        for fd, copy in zip((1, 2), saved):
            os.dup2(copy, fd)
            os.close(copy)
        os.close(devnull)


def _probe(make: Callable, args, threads: int, queue) -> None:
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(threads)
    step = make(args)  # build everything first: only the step's own allocations are measured
    step()  # warm-up, so one-time set-up (thread pools, kernel loading) is not counted
    with _silenced_fds(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    with tempfile.TemporaryDirectory() as tmp:
        trace = os.path.join(tmp, "trace.json")
        with _silenced_fds():
            prof.export_chrome_trace(trace)
        with open(trace) as f:
            events = json.load(f)["traceEvents"]
    # "Total Allocated" counts the bytes allocated since profiling began and not yet freed.
    peak = max((e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]"), default=0)
    queue.put(peak / 2**20)


def peak_memory_mib(make: Callable, args, threads: int) -> float:
    """Peak tensor memory (MiB) allocated by one call of `make(args)()` after a warm-up call, from
    the PyTorch profiler's allocation trace, in a fresh process so runs never mix.

    `make` must be a module-level function (it is pickled into a spawned process).
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_probe, args=(make, args, threads, queue))
    proc.start()
    result = queue.get()
    proc.join()
    return result


def cuda_step_peak_mib(step: Callable[[], None], device: torch.device) -> float:
    """Peak tensor memory (MiB) that one call of `step` allocates on a CUDA device above what was
    allocated before it: the CUDA counterpart of `peak_memory_mib`, measured in this process.

    Tensors that exist before the call (weights, optimizer state, other models) are a constant offset
    of torch.cuda.max_memory_allocated, so they cancel out; call `step` once before, as a warm-up."""
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    step()
    sync(device)
    return (torch.cuda.max_memory_allocated(device) - before) / 2**20


def kernel_times(fn: Callable[[], None], iters: int) -> dict[str, tuple[float, float]]:
    """{kernel name: (GPU ms per call, launches per call)} of `iters` calls of fn under
    torch.profiler, the most expensive first. Without CUDA (the CPU smoke tests) the profiler sees
    no kernels, and the CPU time of aten and difftransformer(_cpu) operators stands in for them."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with warnings.catch_warnings():
        # Some torch versions (2.10, 2.11) warn this when the profiler starts: filter before entering.
        warnings.filterwarnings("ignore", message=".*clears events at the end of each cycle")
        with profile(activities=activities) as prof:
            for _ in range(iters):
                fn()
            if cuda:
                torch.cuda.synchronize()
    rows = {}
    for e in prof.key_averages():
        if cuda:
            if e.device_type != torch.autograd.DeviceType.CUDA or e.self_device_time_total <= 0:
                continue
            us = e.self_device_time_total
        else:
            if not e.key.startswith(("aten::", "difftransformer")) or e.self_cpu_time_total <= 0:
                continue
            us = e.self_cpu_time_total
        rows[e.key] = (us / 1e3 / iters, e.count / iters)
    return dict(sorted(rows.items(), key=lambda kv: -kv[1][0]))


def print_trace(kernels: list[dict[str, tuple[float, float]]], step_s: tuple[float, float], rows: int = 30) -> None:
    """Each kernel's ms per step in both arms (from `kernel_times`), the largest differences first."""
    base, diff = kernels
    busy = [sum(ms for ms, _ in k.values()) for k in kernels]
    print(f"\n## Kernels per step: Transformer {busy[0]:.1f} ms busy of {step_s[0] * 1e3:.1f}, "
          f"DIFF {busy[1]:.1f} ms of {step_s[1] * 1e3:.1f}\n")
    print("| kernel | Transformer ms | DIFF ms | DIFF - T ms | launches T / DIFF |")
    print("|---|---|---|---|---|")
    names = sorted(set(base) | set(diff), key=lambda n: -abs(diff.get(n, (0, 0))[0] - base.get(n, (0, 0))[0]))
    for name in names[:rows]:
        (tb, nb), (td, nd) = base.get(name, (0.0, 0)), diff.get(name, (0.0, 0))
        print(f"| {name[:100]} | {tb:.3f} | {td:.3f} | {td - tb:+.3f} | {nb:g} / {nd:g} |")


def machine(device: torch.device = torch.device("cpu")) -> str:
    """One line naming what the figures were measured on, from the one description of the machine
    (`experiments.provenance.hardware`, which studies record): on CUDA the GPU's name and the CUDA version,
    else the CPU's model and the threads used; the torch version either way."""
    from difftransformer.experiments.provenance import hardware

    hw = hardware(device)
    if device.type == "cuda":
        return f"{hw['gpu']}, torch {hw['torch']}, CUDA {hw['cuda']}"
    return f"{hw['cpu']}, torch {hw['torch']}, {hw['torch_threads']} threads"
