"""Measurement helpers shared by the CPU benchmarks: interleaved timing and peak-memory probes."""

from __future__ import annotations

import multiprocessing as mp
import platform
import resource
import statistics
import time
from collections.abc import Callable

import torch


def rss_kib() -> int:
    """Current resident set size of this process."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() // 1024


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


def _probe(make: Callable, args, threads: int, queue) -> None:
    torch.set_num_threads(threads)
    step = make(args)  # build everything first: only the step's own growth is measured
    before = rss_kib()
    step()
    queue.put(max((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024, 0.0))


def peak_memory_mib(make: Callable, args, threads: int) -> float:
    """Peak-RSS growth (MiB) of one call of `make(args)()`, in a fresh process so peaks never mix.

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
