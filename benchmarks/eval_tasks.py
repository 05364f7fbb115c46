"""How long each evaluation task takes with its defaults, and how much memory it holds.

Each (task, model) runs as its own `difftransformer eval TASK MODEL --force` process, into a
temporary results folder, so that its wall time and peak resident memory (from os.wait4) are its
own. The two models alternate, task by task, so machine load hits both alike. Prints a Markdown table.
The target: every task's defaults finish on the demo model in <= 2 minutes on 2 cores.

    python benchmarks/eval_tasks.py runs/demo/transformer runs/demo/diff
    python benchmarks/eval_tasks.py runs/demo/diff --tasks outliers --extra "--tokens 131072"
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import machine  # noqa: E402


def _run(task: str, model: str, extra: list[str], out_dir: str) -> tuple[float, float, int]:
    """(seconds, peak RSS in MiB, exit code) of one eval process."""
    cmd = [sys.executable, "-m", "difftransformer", "eval", task, model, "--force", "--out-dir", out_dir, *extra]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - t0
    err = proc.stderr.read().decode(errors="replace").strip().splitlines()
    proc.stderr.close()
    code = os.waitstatus_to_exitcode(status)
    if code:
        print(f"  {task} on {model} failed ({code}): {err[-1] if err else ''}", file=sys.stderr)
    return seconds, usage.ru_maxrss / 1024, code


def main() -> None:
    from difftransformer.eval import TASKS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("models", nargs="+", help="run folders (e.g. runs/demo/transformer runs/demo/diff)")
    p.add_argument("--tasks", default=",".join(sorted(TASKS)), help="comma-separated tasks (default: all)")
    p.add_argument("--extra", default="", help="extra flags for every eval call, e.g. \"--tokens 131072\"")
    args = p.parse_args()
    extra = shlex.split(args.extra)
    print(f"# eval task defaults, {machine()}\n")
    print("| task | " + " | ".join(f"{m} s | {m} peak MiB" for m in args.models) + " |")
    print("|---|" + "---|---|" * len(args.models))
    with tempfile.TemporaryDirectory() as tmp:
        for task in args.tasks.split(","):
            cells = []
            for i, model in enumerate(args.models):
                seconds, rss, code = _run(task, model, extra, os.path.join(tmp, str(i)))
                cells += [f"{seconds:.1f}" if not code else "failed", f"{rss:.0f}"]
            print(f"| {task} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
