"""`difftransformer report`: (re)write a study folder's report.md from what is on disk."""

from __future__ import annotations

import argparse
from pathlib import Path

from difftransformer.cli.common import print_section
from difftransformer.experiments import write_report
from difftransformer.run_config import ConfigError

HELP = "(re)write report.md for a compare folder"
DESCRIPTION = ("Regenerate <dir>/report.md and its plots from the metrics and models on disk (also works on "
               "a comparison that is still running or was interrupted).")
EXAMPLES = """
    examples:
      difftransformer report runs/demo
      difftransformer report runs/demo3 --no-samples"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", metavar="DIR", help="the compare output folder")
    p.add_argument("--no-samples", action="store_true",
                   help="skip the sample generations (a unit without a result file still has its final weights "
                        "read, to tell which stored evaluation results are its)")


def run(args: argparse.Namespace) -> int:
    if not args.dir.strip():
        raise ConfigError("DIR is empty; name the study folder (the --out-dir of a `difftransformer compare` run), "
                          "e.g. `difftransformer report runs/demo`, or `.` for the current folder")
    if not Path(args.dir).is_dir():
        raise ConfigError(f"{args.dir} is not a folder; give the --out-dir of a `difftransformer compare` run")
    report = write_report(args.dir, samples=not args.no_samples)
    print(f"wrote {report}")
    print_section(report, "## Verdict")
    return 0
