"""benchmarks/decode.py runs end to end (tiny sizes; its timings mean nothing here and are not checked)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_decode_benchmark_prints_a_row_per_prompt():
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "decode.py"), "--preset", "tiny", "--prompts",
                          "8", "16", "--new-tokens", "2", "--repeats", "1"], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    rows = [line for line in run.stdout.splitlines() if line.startswith("| 8 |") or line.startswith("| 16 |")]
    assert len(rows) == 2 and all(len(r.split("|")) == 9 for r in rows), run.stdout
