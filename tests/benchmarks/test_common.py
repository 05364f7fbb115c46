"""benchmarks/common.py's CUDA paths, checked on CPU with torch.cuda's calls recorded: the timed calls must
start and end on a synchronised device, and the step peak must be measured from a reset counter."""

import importlib.util
from pathlib import Path

import pytest
import torch

_spec = importlib.util.spec_from_file_location(
    "benchmarks_common", Path(__file__).resolve().parents[2] / "benchmarks" / "common.py")
common = importlib.util.module_from_spec(_spec)  # by path: the scripts' folder stays off sys.path
_spec.loader.exec_module(common)

CUDA = torch.device("cuda")


@pytest.fixture
def log(monkeypatch):
    events = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append("sync"))
    return events


def test_each_timed_call_is_fenced_by_synchronisation_on_cuda(log):
    fns = [lambda: log.append("a"), lambda: log.append("b")]
    medians = common.interleaved_medians(fns, repeats=2, warmup=1, device=CUDA)
    assert len(medians) == 2 and all(m >= 0 for m in medians)
    assert log == ["a", "b"] + ["sync", "a", "sync", "sync", "b", "sync"] * 2


def test_no_synchronisation_on_cpu(log):
    common.interleaved_medians([lambda: log.append("a")], repeats=3, warmup=0)
    assert log == ["a"] * 3


def test_cuda_step_peak_is_the_steps_own_allocation(log, monkeypatch):
    state = {"allocated": 300 * 2**20, "peak": 900 * 2**20}  # a stale peak from before: must be reset

    def reset(device=None):
        log.append("reset")
        state["peak"] = state["allocated"]

    def step():
        log.append("step")
        state["peak"] = max(state["peak"], state["allocated"] + 40 * 2**20)
        state["allocated"] += 4 * 2**20  # what the step leaves behind counts only through the peak

    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: state["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: state["peak"])
    assert common.cuda_step_peak_mib(step, CUDA) == 40
    assert log == ["sync", "reset", "step", "sync"]


def test_resolve_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert common.resolve_device("auto") == torch.device("cpu") == common.resolve_device("cpu")
    with pytest.raises(ValueError, match="no CUDA GPU is visible"):
        common.resolve_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert common.resolve_device("auto") == CUDA == common.resolve_device("cuda")


def test_median_interval_is_the_order_statistics_a_binomial_gives():
    """By hand: with 9 values [x1, x7] (0-based) covers the median with probability 1 - 2 (1 + 9) / 512 = 0.961 and
    [x2, x6] with 1 - 2 (1 + 9 + 36) / 512 = 0.820; with 5 values even [min, max] covers it only 1 - 2 / 32 = 0.9375."""
    import random

    rng = random.Random(3)
    xs = [rng.random() for _ in range(9)]  # unsorted: order must not matter
    s = sorted(xs)
    assert len(set(xs)) == 9 and xs != s
    assert common.median_interval(xs) == (s[4], s[1], s[7])
    assert common.median_interval(xs, confidence=0.8) == (s[4], s[2], s[6])
    assert common.median_interval([5.0, 1.0, 3.0, 2.0, 4.0]) == (3.0, None, None)
    assert common.median_interval([5.0, 1.0, 3.0, 2.0, 4.0, 6.0]) == (3.5, 1.0, 6.0)  # 1 - 2/64 = 0.969


def test_a_target_verdict_reads_the_whole_interval_on_the_unrounded_bounds():
    """By hand: 'met' only when the whole interval is on the target's side of the line (>= line for '>=',
    <= line for '<='), 'not met' only when it is wholly on the other, 'open' otherwise or without an interval."""
    MI = common.MedianInterval
    assert MI(1.0, 0.96, 1.02).verdict(">=", 0.95) == "met"
    assert MI(1.0, 0.949, 1.02).verdict(">=", 0.95) == "open"  # prints as [0.95, 1.02]: the digits hide it
    assert MI(0.9, 0.85, 0.9499).verdict(">=", 0.95) == "not met"
    assert MI(1.03, 1.02, 1.05).verdict("<=", 1.05) == "met"
    assert MI(1.06, 1.0501, 1.07).verdict("<=", 1.05) == "not met"
    assert MI(1.05, 1.04, 1.06).verdict("<=", 1.05) == "open"
    assert MI(1.0, None, None).verdict(">=", 0.5) == "open"
    assert str(MI(1.0, 0.949, 1.02)) == "1.00 [0.95, 1.02]" and MI(1.0, 0.949, 1.02).cell(3) == "1.000 [0.949, 1.020]"
    assert MI(1.25, None, None).cell(1) == "1.2" and MI(0.5, None, None).cell() == "0.50"


def test_kernel_times_counts_each_operator_per_call():
    """Two matrix products and one add per call, profiled over 3 calls: 2 and 1 launches per call
    (on CPU the operators stand in for kernels), every time positive, the most expensive first."""
    a, b = torch.randn(64, 64), torch.randn(64, 64)

    def fn():
        torch.mm(a, b)
        torch.mm(b, a)
        torch.add(a, b)

    times = common.kernel_times(fn, 3)
    assert times["aten::mm"][1] == 2 and times["aten::add"][1] == 1
    assert all(ms > 0 for ms, _ in times.values())
    assert list(times.values()) == sorted(times.values(), key=lambda t: -t[0])


def test_kernel_times_silences_the_profilers_start_warning(monkeypatch, recwarn):
    """torch 2.10-2.11 warn "Profiler clears events at the end of each cycle" as the profiler starts: the filter must
    be in place before the profiler is entered."""
    import warnings

    from torch.profiler import profiler

    real = profiler._KinetoProfile.prepare_trace

    def warning_prepare(self, *args, **kwargs):
        warnings.warn("Profiler clears events at the end of each cycle. Only events from the current cycle "
                      "are reported.", UserWarning)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(profiler._KinetoProfile, "prepare_trace", warning_prepare)
    with pytest.warns(UserWarning, match="clears events"):  # the stand-in does warn where not filtered
        with profiler.profile():
            pass
    recwarn.clear()
    common.kernel_times(lambda: torch.add(torch.ones(2), 1), 1)
    assert not [w for w in recwarn if "clears events" in str(w.message)]


def test_median_interval_ratio_is_per_round():
    got = common.MedianInterval.ratio([2.0, 6.0, 3.0], [1.0, 2.0, 3.0])
    assert got == common.MedianInterval.of([2.0, 3.0, 1.0])


def test_machine_names_the_cpu_model_a_study_records():
    from difftransformer.experiments.provenance import hardware

    line = common.machine()
    assert line.startswith(f"{hardware()['cpu']}, torch {torch.__version__}, ")
    assert line.endswith(f", {torch.get_num_threads()} threads")


def test_machine_on_cuda_reads_the_same_description(monkeypatch):
    """The GPU line comes from `hardware(device)` too (one description of the machine), not a second query."""
    from difftransformer.experiments import provenance

    asked = []
    fake = {"cpu": "c", "torch": "9.9", "torch_threads": 3, "gpu": "Some GPU", "cuda": "12.8"}
    monkeypatch.setattr(provenance, "hardware", lambda device=None: asked.append(device) or fake)
    assert common.machine(torch.device("cuda")) == "Some GPU, torch 9.9, CUDA 12.8"
    assert common.machine() == "c, torch 9.9, 3 threads" and asked == [torch.device("cuda"), torch.device("cpu")]
