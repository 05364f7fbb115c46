"""The Triton kernels through the real GPU compiler, on a machine without a GPU.

The interpreter tests check the kernels' arithmetic, not that they compile for a GPU, nor what
they cost there. Triton compiles ahead of time without a driver and its wheel ships NVIDIA's
ptxas, so every autotune config of the demanding class (bf16, d = 128, sm_90) is compiled here
(difftransformer.kernels.resources) and ptxas's report is held to what the tile lists in
diff_flash.py were chosen for.
"""

import os

import pytest

triton = pytest.importorskip("triton")

try:
    from triton.backends.nvidia.compiler import get_ptxas

    HAVE_PTXAS = os.path.exists(get_ptxas(90).path)
except Exception:  # a Triton build without the NVIDIA backend
    HAVE_PTXAS = False
if not HAVE_PTXAS:
    pytest.skip("Triton's NVIDIA backend (ptxas) is not installed", allow_module_level=True)

from difftransformer.kernels import diff_flash as df  # noqa: E402
from difftransformer.kernels import resources  # noqa: E402

TILES = df.TILES


H100_SMEM_KIB = 227  # the most shared memory one block may use on sm_90


MAX_SPILL_BYTES = 256  # the chosen d = 128 tiles spill at most 168 B (Triton 3.9, benchmarks/kernel_resources.py)


@pytest.fixture(scope="module")
def reports():
    """(job, ptxas report) for: every bf16 d = 128 config on sm_90, plus the first config of the
    other classes and targets (d = 96 non-causal, exact fp32, fp16 on sm_80)."""
    jobs = [(name, 128, "bf16", True, 90, tile) for name, tiles in TILES.items() for tile in df.tiles_for(tiles, 128)]
    for name, tiles in TILES.items():
        jobs.append((name, 96, "bf16", False, 90, df.tiles_for(tiles, 96)[0]))
        jobs.append((name, 64, "fp32", True, 90, df.tiles_for(tiles, 64, ieee=True)[0]))
        jobs.append((name, 32, "fp16", True, 80, df.tiles_for(tiles, 32)[0]))
    return list(zip(jobs, resources.compile_all(jobs, workers=os.cpu_count() or 1)))


def test_every_config_compiles_for_the_gpu(reports):
    failed = [(job, r["error"]) for job, r in reports if "error" in r]
    assert not failed, failed


def test_d128_tiles_fit_an_h100(reports):
    for job, r in reports:
        if job[1] == 128:
            assert r["smem_kib"] <= H100_SMEM_KIB, (job, r)
            assert not r["wgmma_serialized"], (job, r)


def test_every_class_keeps_spills_small(reports):
    for job, r in reports:
        assert r["spill_bytes"] <= MAX_SPILL_BYTES, (job, r)
        if job[2] != "fp32":
            assert r["mma"] != "none", (job, r)  # half precision must reach the tensor cores


def test_forward_uses_hopper_tensor_cores(reports):
    """At least the 64-row forward tiles must get wgmma on sm_90 (mma.sync runs at about half its rate)."""
    fwd = [r for job, r in reports if job[0] == "fwd" and job[1] == 128]
    assert any(r["mma"] == "wgmma" for r in fwd), fwd


def test_pruner_keeps_the_launch_class():
    configs = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
               for tiles in df.FWD_TILES.values() for m, n, w, s in tiles]
    keep = df._class_pruner(df.FWD_TILES)
    for d, ieee in ((32, False), (64, False), (96, False), (128, False), (64, True), (128, True)):
        kept = {df._tile(c) for c in keep(configs, {}, HEAD_D=d, IEEE=ieee)}
        assert kept == set(df.tiles_for(df.FWD_TILES, d, ieee)), (d, ieee)
    # Triton versions that pass the launch keywords among the named arguments
    kept = {df._tile(c) for c in keep(configs, {"HEAD_D": 128, "IEEE": False})}
    assert kept == set(df.FWD_TILES[128])


def test_pruner_keeps_split_and_unsplit_key_block_tiles_apart():
    fn = df._diff_bwd_dkdv_kernel.fn
    configs = [df.tile_config(t, fn) for t in {t for tiles in df.BWD_KV_TILES.values() for t in tiles}]
    keep = df._class_pruner(df.BWD_KV_TILES)
    for d in (64, 128):
        kept = [df._tile(c) for c in keep(configs, {}, HEAD_D=d, IEEE=False)]
        assert len(kept) == len(set(kept)) and set(kept) == set(df.BWD_KV_TILES[d]), d
        assert any(len(t) == 5 for t in kept) and any(len(t) == 4 for t in kept), d


def test_split_key_block_tiles_get_wgmma_without_spills_at_d128(reports):
    """Why the split tiles exist: at d = 128 no unsplit key-block tile gets wgmma on 128 keys (its fp32
    state does not fit the registers); each split program holds half of it."""
    split = [r for job, r in reports if job[0] == "bwd_dkdv" and job[1] == 128 and r["split"]]
    assert split, "no split tile at d = 128"
    for r in split:
        assert r["mma"] == "wgmma" and r["spill_bytes"] == 0, r
