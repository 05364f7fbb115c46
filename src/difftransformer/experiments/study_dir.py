"""One definition of a study folder: where a study keeps its runs, its manifest and its report.

    <study>/
      compare.json          the manifest: arms, seeds, model configs, train recipe, data, hardware
      report.md             written by experiments.report, with loss_curves.png and lambda.png
      <arm>/                one run folder per arm (see train/run_dir.py) when one seed is run ...
      seed<s>/<arm>/        ... and per seed and arm when several are; a grid of sizes and token
                            budgets adds <size>/ and <tokens>tok/ in front (units.Unit.rel)
      results/              each unit's result file, <same path>.json, unless compare.results_dir
                            puts them elsewhere (e.g. results/<study>/ in the repository, to commit)

A folder that was filled by hand (no compare.json) is still read: arms and seeds come from its layout.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from difftransformer._io import Folder, folder_entry, register_folder_kind
from difftransformer.experiments.units import MANIFEST_FILE, Unit, find_results
from difftransformer.train import RunDir
from difftransformer.train.run_dir import METRICS_FILE

register_folder_kind("a study", MANIFEST_FILE)
RESULTS_DIR = "results"
REPORT_FILE = "report.md"
HTML_FILE = "report.html"
LOSS_PLOT_FILE = "loss_curves.png"
LAMBDA_PLOT_FILE = "lambda.png"
_SEED_PREFIX = "seed"


def _integer(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**63


def _table_of(kind: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, dict) and all(kind(x) for x in v.values())


def _list_of(kind: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: v is None or (isinstance(v, list) and all(kind(x) for x in v))


_number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) < 2**63  # noqa: E731
# What the runner and the report read of a manifest, and the type each element must have.
_MANIFEST_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "arms": (lambda v: isinstance(v, list) and all(isinstance(a, str) and a for a in v), "a list of arm names"),
    "seeds": (lambda v: isinstance(v, list) and all(map(_integer, v)), "a list of integer seeds >= 0"),
    "baseline": (lambda v: v is None or isinstance(v, str), "an arm name"),
    "sizes": (_list_of(lambda s: isinstance(s, dict) and isinstance(s.get("name"), str)),
              "a list of sizes with a name"),
    "tokens": (_list_of(_integer), "a list of integer token budgets"),
    "results_dir": (lambda v: v is None or isinstance(v, str), "a folder path"),
    "train": (_table_of(lambda x: True), "a table of training settings"),
    "data": (_table_of(lambda x: True), "a table of data settings"),
    "report": (_table_of(lambda x: True), "a table of report settings"),
    "models": (_table_of(lambda m: isinstance(m, dict)), "a table of model configs"),
    "arm_specs": (_table_of(lambda m: isinstance(m, dict)), "a table of arm settings"),
    "parameters": (_table_of(lambda n: n is None or _integer(n)), "a table of parameter counts"),
    "wall_s": (_table_of(lambda n: n is None or _number(n)), "a table of seconds"),
    "eval_tasks": (_list_of(lambda t: isinstance(t, str)), "a list of task names"),
}


def manifest_problem(manifest: dict[str, Any]) -> str | None:
    """What in a manifest has the wrong type for the runner and the report that read it, naming the key and
    the value (None: all fine)."""
    for key, (ok, what) in _MANIFEST_FIELDS.items():
        if key in manifest and not ok(manifest[key]):
            return f"{key} is {_shown(manifest[key])}, not {what}"
    return None


def _shown(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


class StudyDir(Folder):
    """The folder of one comparison study (it need not exist yet)."""

    __slots__ = ()

    manifest, report, loss_plot, lambda_plot, html = map(folder_entry, (
        MANIFEST_FILE, REPORT_FILE, LOSS_PLOT_FILE, LAMBDA_PLOT_FILE, HTML_FILE))
    results = folder_entry(RESULTS_DIR)

    def results_dir(self, manifest: dict[str, Any] | None = None) -> Path:
        """Where this study's result files are: results/ inside it; else the folder itself when it is a results
        folder holding result files (no run folders); else the manifest's results_dir; else the folder itself
        when it has no run folders. A results folder's own files come before the results_dir its manifest
        names, which is relative to where the study ran: a copy read from elsewhere (or from a checkout
        holding another folder of that name) must report its own results, not that folder's."""
        if (self.results / MANIFEST_FILE).is_file() or self.results.is_dir():
            return self.results
        runs = self.run_dirs()
        if not runs and not any(self.path.rglob(METRICS_FILE)) and find_results(self.path):  # no run folder, any layout
            return self.path
        named = (manifest or {}).get("results_dir")
        if named and Path(named).is_dir():
            return Path(named)
        return self.path if not runs else self.results

    def is_study(self) -> bool:
        """Whether a comparison has been started here (its manifest exists)."""
        return self.manifest.is_file()

    def read_manifest(self) -> dict[str, Any] | None:
        """The manifest (None when there is none yet); an unreadable one is a ValueError naming the file."""
        if not self.manifest.is_file():
            return None
        try:
            manifest = json.loads(self.manifest.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{self.manifest} is not readable JSON ({e}); restore it, or delete it to have the "
                             f"study read from its run folders") from None
        if not isinstance(manifest, dict) or not isinstance(manifest.get("arms"), list) \
                or not isinstance(manifest.get("seeds"), list):
            raise ValueError(f"{self.manifest} lacks its list of arms or seeds; restore it, or delete it to have "
                             f"the study read from its run folders")
        problem = manifest_problem(manifest)
        if problem:
            raise ValueError(f"{self.manifest}: {problem} (edited by hand?); restore it, or delete it to have the "
                             f"study read from its run folders")
        return manifest

    def run_dir(self, arm: str, seed: int, multi_seed: bool) -> RunDir:
        """Where the run of `arm` with training seed `seed` goes."""
        return RunDir(self.path / f"{_SEED_PREFIX}{seed}" / arm if multi_seed else self.path / arm)

    def unit_dir(self, unit: Unit, multi_seed: bool) -> RunDir:
        """Where a unit of the grid is trained."""
        return RunDir(self.path / unit.rel(multi_seed))

    def find_unit(self, unit: Unit) -> RunDir | None:
        """The existing run folder of a unit (either layout), or None."""
        if unit.size is None and unit.tokens is None:
            return self.find_run(unit.arm, unit.seed)
        for multi in (True, False):
            run = self.unit_dir(unit, multi)
            if run.has_metrics() and (multi or (run.seed() if run.seed() is not None else unit.seed) == unit.seed):
                return run
        return None

    def find_run(self, arm: str, seed: int) -> RunDir | None:
        """The existing run of (arm, seed): seed<s>/<arm>, or <arm> when its train_config has that seed."""
        multi = self.run_dir(arm, seed, multi_seed=True)
        if multi.has_metrics():
            return multi
        single = self.run_dir(arm, seed, multi_seed=False)
        if single.has_metrics() and (single.seed() if single.seed() is not None else seed) == seed:
            return single
        return None

    def run_dirs(self) -> list[RunDir]:
        """Every run folder that has logged: seed<s>/<arm>/ ones if there are any, else <arm>/ ones."""
        if not self.path.is_dir():
            return []
        multi = [RunDir(p) for p in sorted(self.path.glob(f"{_SEED_PREFIX}*/*")) if RunDir(p).has_metrics()]
        return multi or [RunDir(p) for p in sorted(self.path.iterdir()) if RunDir(p).has_metrics()]

    def discover(self) -> dict[str, Any]:
        """A manifest for a folder without compare.json: arms and seeds from its layout."""
        runs = self.run_dirs()
        seeds = sorted(int(p.name[len(_SEED_PREFIX):]) for p in self.path.glob(f"{_SEED_PREFIX}*")
                       if p.name[len(_SEED_PREFIX):].isdigit())
        arms = sorted({r.path.name for r in runs}, key=lambda a: (a != "diff", a == "transformer", a))
        if not seeds:
            seeds = sorted({r.seed() if r.seed() is not None else 0 for r in runs}) or [0]
        return {"arms": arms, "seeds": seeds}
