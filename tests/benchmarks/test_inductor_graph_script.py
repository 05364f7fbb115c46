"""benchmarks/inductor_graph.py: its reading of Inductor's output code on hand-written graphs, and its code path
on CPU through the Triton interpreter (a GPU session is short)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import benchmark_script

ROOT = Path(__file__).resolve().parents[2]

GRAPH = '''
async_compile.wait(globals())

def call(self, args):
    primals_1, = args
    buf0 = empty_strided_cuda((2, 4, 64, 16), (4096, 1024, 16, 1), torch.bfloat16)
    # Topologically Sorted Source Nodes: [q, contiguous], Original ATen: [aten.transpose, aten.clone]
    stream0 = get_raw_stream(0)
    triton_poi_fused_clone_0.run(primals_1, buf0, 8192, stream=stream0)
    # Topologically Sorted Source Nodes: [x, mul, add], Original ATen: [aten.mul, aten.add, aten.clone]
    triton_poi_fused_add_clone_mul_1.run(buf0, buf1, 8192, stream=stream0)
    # Topologically Sorted Source Nodes: [rope], Original ATen: [aten.cos, aten.mul]
    cpp_fused_cos_mul_2(buf1, buf2)
    buf3 = torch.ops.difftransformer.diff_flash_fwd.default(buf0, reinterpret_tensor(buf2, (2, 64), (64, 1), 0), buf1)
    extern_kernels.mm(buf5, primals_1, out=buf6)
    return (buf3, )
'''


def test_kernels_copies_and_custom_op_calls_are_read_from_the_output_code():
    ig = benchmark_script("inductor_graph")
    kernels = ig.kernel_calls(GRAPH)
    assert [k for k, _ in kernels] == ["triton_poi_fused_clone_0", "triton_poi_fused_add_clone_mul_1",
                                       "cpp_fused_cos_mul_2"]
    assert [ig.is_copy(k, s) for k, s in kernels] == [True, False, False]  # the fused add computes: not a copy
    assert ig.our_op_calls(GRAPH) == [("diff_flash_fwd", "buf0, reinterpret_tensor(buf2, (2, 64), (64, 1), 0), buf1")]
    rows, detail = ig.summarise("diff", [GRAPH])
    assert rows == [["diff", "0 (forward)", "3", "2", "1", "1"]]  # one extern mm, one custom op
    assert detail[0] == "- diff forward: copy kernel `triton_poi_fused_clone_0` from [q, contiguous], Original " \
                        "ATen: [aten.transpose, aten.clone]"


@pytest.mark.slow
def test_smoke_run_reads_both_arms_compiled_graphs(tmp_path):
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT / "src"), "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "inductor_graph.py"), "--cpu-smoke-test",
                          "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = [line.split("|")[1:-1] for line in run.stdout.splitlines() if line.startswith("| diff |")
            or line.startswith("| transformer |")]
    assert [(r[0].strip(), r[1].strip()) for r in rows] == [("diff", "0 (forward)"), ("diff", "1 (backward)"),
                                                            ("transformer", "0 (forward)"),
                                                            ("transformer", "1 (backward)")]
    assert [r[5].strip() for r in rows] == ["1", "1", "0", "0"]  # the fused op, once per graph, in DIFF only
    assert "`diff_flash_fwd`(" in run.stdout and "`diff_flash_bwd`(" in run.stdout
    assert "def call(" in (tmp_path / "diff_output_code.py").read_text()


def test_the_smoke_test_needs_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT / "src"), "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "inductor_graph.py"), "--cpu-smoke-test"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "set TRITON_INTERPRET=1" in run.stderr.strip().splitlines()[-1]
