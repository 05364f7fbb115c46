"""The package's dependency rules (docs/architecture.md), read from the imports in the source itself.

Every `import difftransformer...` / `from difftransformer... import` in src/ (lazy ones inside
functions included) is checked against the table of what each part may use, and the file names of a
run folder, a study folder and a prepared-data folder are spelled only by their owners.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "difftransformer"
# Base modules import nothing of the package; anyone may import them.
BASE = {"_io", "_config", "_version", "norm", "dist", "numerics"}

# part -> the parts it may import (besides itself and BASE). A part is a top-level module or package.
ALLOWED = {
    "_io": set(), "_config": set(), "_version": set(), "norm": set(), "dist": set(), "numerics": set(),
    "kernels": set(),
    "attention": {"kernels"},
    "model": {"attention"},
    "data": set(),
    "train": {"model", "data"},
    "eval": {"model", "data"},
    "experiments": {"train", "eval", "data", "model"},
    "convert": {"model"},
    "hf": {"model", "convert", "data"},
    "run_config": {"model", "train", "data", "experiments"},
    "cli": {"attention", "kernels", "model", "data", "train", "eval", "experiments", "convert", "hf", "run_config"},
    "__init__": {"attention", "model"},
    "__main__": {"cli"},
}
# Finer rules inside a part: (importing module prefix, imported module prefix) pairs that are allowed
# although the parts alone would forbid them. Only white-box probes may look inside attention.
EXCEPTIONS = {("eval.probes", "attention")}


def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path, module: str | None = None) -> list[tuple[str, int]]:
    """(imported difftransformer module, line) for every import in the file, relative ones resolved.

    module: the file's dotted name inside the package (default: from its place under src/)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = (module or _module_name(path)).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name[len("difftransformer."):], node.lineno) for a in node.names
                      if a.name.startswith("difftransformer.")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1] if node.level > 1 else package
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and (node.module == "difftransformer" or node.module.startswith("difftransformer.")):
                target = node.module[len("difftransformer."):] if node.module != "difftransformer" else ""
            else:
                continue
            if target:
                found.append((target, node.lineno))
            else:  # from difftransformer import x: x is a part
                found += [(a.name, node.lineno) for a in node.names]
    return sorted(found, key=lambda item: item[1])


def _part(module: str) -> str:
    return module.split(".")[0] if module else "__init__"


def _files() -> list[Path]:
    return sorted(p for p in SRC.rglob("*.py") if "__pycache__" not in p.parts)


def test_the_rules_cover_every_part_of_the_package():
    parts = {_part(_module_name(p)) for p in _files()}
    assert parts <= set(ALLOWED), f"parts without a rule: {sorted(parts - set(ALLOWED))}"


def test_no_import_breaks_the_dependency_rules():
    broken = []
    for path in _files():
        me = _module_name(path)
        mine = _part(me)
        for target, line in _imports(path):
            theirs = _part(target)
            if theirs in (mine, *BASE) or theirs in ALLOWED[mine]:
                continue
            if any(me.startswith(a) and target.startswith(b) for a, b in EXCEPTIONS):
                continue
            broken.append(f"{path.relative_to(SRC)}:{line} ({mine}) imports {target} ({theirs})")
    assert not broken, "imports against docs/architecture.md:\n" + "\n".join(broken)


def test_base_modules_import_nothing_of_the_package():
    for name in BASE:
        assert _imports(SRC / f"{name}.py") == [], name


def test_the_checker_sees_lazy_and_relative_imports(tmp_path):
    """The rule test must be able to fail: a lazy upward import and a relative one are both found."""
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from difftransformer.train import train\nfrom .corpus import x\n"
                     "from difftransformer import dist\n")
    assert _imports(probe, module="data.probe") == [("train", 2), ("data.corpus", 3), ("dist", 4)]


# File names of the folders the package writes: each is spelled by its owner only.
OWNERS = {
    "metrics.jsonl": "train/metrics.py", "checkpoints": "train/checkpoint.py",
    "model_config.json": "train/checkpoint.py", "train_config.json": "train/checkpoint.py",
    "final": "train/run_dir.py", "tb": "train/run_dir.py", "done.json": "train/run_dir.py",
    "samples.json": "train/run_dir.py", "tokenizer.json": "data/tokenizer.py",
    "compare.json": "experiments/units.py", "report.md": "experiments/study_dir.py",
    "loss_curves.png": "experiments/study_dir.py", "lambda.png": "experiments/study_dir.py",
    "prepared.json": "data/prepare.py", "prepare-failed.txt": "data/prepare.py",
    "config.json": "model/serialization.py",
    ".lock": "_io.py", "replaced": "train/run_dir.py",
    "model.safetensors": "model/serialization.py",
}


@pytest.mark.parametrize("name", sorted(OWNERS))
def test_folder_file_names_are_spelled_only_by_their_owner(name):
    spelled = [str(p.relative_to(SRC)) for p in _files()
               if any(isinstance(n, ast.Constant) and n.value == name for n in ast.walk(ast.parse(p.read_text())))]
    assert spelled == [OWNERS[name]], f"{name!r} is spelled in {spelled}; use the owner's constant"


def _module_graph() -> dict[str, set[str]]:
    """File -> files it imports (a package import leads to its __init__; `from pkg import sub` to sub)."""
    modules = {_module_name(p): p for p in _files()}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for me, path in modules.items():
        for target, _ in _imports(path):
            graph[me].add(target if target in modules else target.rsplit(".", 1)[0])
    return {m: {t for t in ts if t in modules and t != m} for m, ts in graph.items()}


def _cycles(graph: dict[str, set[str]]) -> list[str]:
    """Every back edge of a depth-first walk, as 'a -> ... -> a'."""
    state: dict[str, int] = {}
    found: list[str] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                found.append(" -> ".join((stack + [node])[(stack + [node]).index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack + [node])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    return found


def test_no_file_imports_itself_through_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a -> b -> c -> a"]  # the check can fail
    cycles = _cycles(_module_graph())
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_only_hf_imports_transformers():
    """The core runs without the optional `hf` extra: transformers, peft and lm_eval live in hf/ alone."""
    optional = ("transformers", "peft", "lm_eval")
    offenders = []
    for path in _files():
        if path.relative_to(SRC).parts[0] == "hf":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            offenders += [f"{path.relative_to(SRC)}:{node.lineno} {n}" for n in names if n.split(".")[0] in optional]
    assert not offenders, offenders
