"""One definition of a study folder: where a comparison keeps its runs, its manifest and its report.

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
from typing import Any

from difftransformer._io import Folder, folder_entry, register_folder_kind
from difftransformer.experiments.units import MANIFEST_COPY, Unit
from difftransformer.train import RunDir

MANIFEST_FILE = MANIFEST_COPY
register_folder_kind("a study", MANIFEST_FILE)
RESULTS_DIR = "results"
REPORT_FILE = "report.md"
HTML_FILE = "report.html"
LOSS_PLOT_FILE = "loss_curves.png"
LAMBDA_PLOT_FILE = "lambda.png"
_SEED_PREFIX = "seed"


class StudyDir(Folder):
    """The folder of one comparison study (it need not exist yet)."""

    __slots__ = ()

    manifest, report, loss_plot, lambda_plot, html = map(folder_entry, (
        MANIFEST_FILE, REPORT_FILE, LOSS_PLOT_FILE, LAMBDA_PLOT_FILE, HTML_FILE))
    results = folder_entry(RESULTS_DIR)

    def results_dir(self, manifest: dict[str, Any] | None = None) -> Path:
        """Where this study's result files are: results/ inside it, else the manifest's results_dir,
        else the folder itself when it is a results folder (a manifest and no run folders)."""
        if (self.results / MANIFEST_FILE).is_file() or self.results.is_dir():
            return self.results
        named = (manifest or {}).get("results_dir")
        if named and Path(named).is_dir():
            return Path(named)
        return self.path if not self.run_dirs() else self.results

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
