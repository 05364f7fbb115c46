"""Measurement helpers shared by the CPU benchmarks: interleaved timing and peak-memory probes."""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable

import torch


def interleaved_medians(fns: list[Callable[[], None]], repeats: int, warmup: int = 1) -> list[float]:
    """Median seconds of each fn, run alternately (a, b, a, b, ...) so machine load hits all alike."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            times[i].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


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


def machine() -> str:
    return f"{platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads"
