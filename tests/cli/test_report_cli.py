"""`report`: hand-edited or misplaced result files are named, and nothing from an arm name or a prompt
reaches report.html as live HTML; the grid and token-scaling views count what was trained."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from difftransformer.cli import main
from difftransformer.experiments.report.fmt import code_span
from difftransformer.experiments.report.html import render_html
from difftransformer.experiments.report.scaling_view import points
from difftransformer.experiments.report.sections import Context, header
from tests.cli.conftest import tiny_run_config
from tests.helpers import cli_fails

TAG_ARM = "<img src=x onerror=alert(1)>"
TAG_PROMPT = "<img src=x onerror=alert(2)> | *x* `y"


def _run(arm, seed, finished=True, **kw):
    return SimpleNamespace(**{"arm": arm, "seed": seed, "finished": finished, "last_step": 2, "max_steps": 2,
                              "final_val": 5.0, "tokens": 0, **kw})


def _grid(cells, headline, manifest=None):
    return Context(study=SimpleNamespace(path=Path("/s")), manifest=manifest or {}, arms=["diff", "transformer"],
                   seeds=[0, 1], baseline="transformer", runs=cells[headline], cells=cells, headline=headline)


def test_report_on_edited_study_files(compared, tmp_path, capsys):
    study = tmp_path / "study"
    shutil.copytree(compared, study)
    (study / "compare.json").write_text('{"format": "difftransformer-compare-v1"}')
    cli_fails(capsys, ["report", str(study), "--no-samples"], "compare.json lacks its list of arms")
    (study / "compare.json").write_text("{not json")
    cli_fails(capsys, ["report", str(study), "--no-samples"], "compare.json is not readable JSON")
    (study / "compare.json").unlink()
    with (study / "diff" / "metrics.jsonl").open("a") as fh:
        fh.write(json.dumps({"kind": "train", "step": 9, "loss": 1.0}) + "\n")  # no tokens
        fh.write(json.dumps({"kind": "train", "step": "x", "loss": 1.0}) + "\n")  # no usable step
    assert main(["report", str(study), "--no-samples"]) == 0


@pytest.mark.parametrize("field, value, needle", [
    ("unit", "x", "is not a difftransformer-unit-v1 result file"),
    ("val", "x", "val is not a list"),
    ("val", [{"step": 1, "loss": "abc"}], "val is not a list"),
    ("train", [5], "train is not a list"),
    ("last_step", "x", "last_step is not an integer"),
    ("finished", "no", "finished is not true or false"),  # not read as finished (bool("no") is True)
    ("evals", {"heldout-loss": 5}, "evals is not a table of task results"),
])
def test_report_on_a_hand_edited_result_file(compared, tmp_path, capsys, field, value, needle):
    study = tmp_path / "study"
    shutil.copytree(compared, study)
    path = study / "results" / "diff.json"
    record = json.loads(path.read_text())
    record[field] = value
    path.write_text(json.dumps(record))
    cli_fails(capsys, ["report", str(study), "--no-samples"], str(path), needle)


def test_a_result_file_in_another_units_place_is_refused(compared, tmp_path, capsys):
    """diff.json holding the transformer arm's unit is refused, naming the file, the unit it holds and the file that
    unit belongs in (transformer.json): the report never shows one arm's numbers under the other's name."""
    study = tmp_path / "study"
    shutil.copytree(compared, study)
    path = study / "results" / "diff.json"
    record = json.loads(path.read_text())
    record["unit"]["arm"] = "transformer"
    path.write_text(json.dumps(record))
    cli_fails(capsys, ["report", str(study), "--no-samples"], str(path), "holds the result of seed 0, arm transformer",
              "transformer.json")


def test_report_html_holds_no_tag_from_an_arm_name_or_a_prompt(workdir, tmp_path):
    """An arm named `<img src=x onerror=alert(1)>` and a prompt holding a tag reach report.html as text, never as
    live tags (the verdict, the wall-time list, "Prompt:"), and `*x*` is not emphasis."""
    config = Path(tiny_run_config(workdir, tmp_path, max_steps=2, eval_interval=2, warmup_steps=1))
    config.write_text(config.read_text() + "\n[compare]\n"
                      f"arms = [\"diff\", {{name = \"{TAG_ARM}\", attention = \"transformer\"}}]\n"
                      f"prompts = [{json.dumps(TAG_PROMPT)}]\nsample_tokens = 2\neval_tasks = []\n")
    study = tmp_path / "study"
    assert main(["compare", "--config", str(config), "--out-dir", str(study)]) == 0
    assert main(["report", str(study)]) == 0
    page = (study / "report.html").read_text()
    assert "<img src=x" not in page and "onerror=alert(1)&gt;" in page
    assert "<em>x</em>" not in page
    md = (study / "report.md").read_text()
    assert f"**Prompt:** {code_span(repr(TAG_PROMPT))}" in md
    assert "**diff vs `<img src=x onerror=alert(1)>`:**" in md


def test_raw_html_in_the_markdown_is_escaped_and_figures_still_embed(tmp_path):
    """A tag or an entity-like `&` in prose and tables is text; the report's own
    images (Markdown image syntax) are still embedded."""
    (tmp_path / "a.png").write_bytes(b"\x89PNG")
    page = render_html('**<b>x&y"z\'</b>** <script>alert(1)</script>\n\n<div>x</div>\n\n| a |\n|---|\n'
                       '| <img src=y onerror=z> |\n\n![fig](a.png)\n', tmp_path, "t")
    assert "<b>" not in page and "<script>" not in page and "<div>" not in page and "<img src=y" not in page
    assert "&lt;b&gt;x&amp;y" in page and 'src="data:image/png;base64,' in page


def test_code_span_survives_backticks():
    """A name or prompt with backticks stays one code span."""
    assert code_span("a`b") == "``a`b``"
    assert code_span("`y") == "`` `y ``"
    assert code_span("plain") == "`plain`"


def test_a_missing_unit_outside_the_headline_cell_is_reported(tmp_path):
    """A size-grid study with w32/seed1/transformer gone is incomplete though its headline cell (w64) is whole: the
    "Incomplete" line names the cell and the missing unit."""
    full = {(a, s): _run(a, s) for a in ("diff", "transformer") for s in (0, 1)}
    small = {k: v for k, v in full.items() if k != ("transformer", 1)}
    text = "\n".join(header(_grid({("w32", None): small, ("w64", None): dict(full)}, ("w64", None))))
    assert "**Incomplete:**" in text and "size w32: transformer (seed 1)" in text


def test_the_token_fit_uses_the_tokens_trained_not_the_budget():
    """A 300-token budget at 128 tokens per step trains 3 steps = 384 tokens: the fit's x is 384, the tokens trained,
    not the budget."""
    runs = {(a, 0): _run(a, 0, max_steps=3) for a in ("diff", "transformer")}
    ctx = _grid({(None, 300): runs, (None, 256): {k: _run(k[0], 0, max_steps=2) for k in runs}}, (None, 300),
                {"train": {"batch_size": 4, "seq_len": 32}})
    xs = sorted(x for series in points(ctx, "tokens")["diff"].values() for x, _ in series)
    assert xs == [256.0, 384.0]


def test_the_scaling_claim_says_when_its_grid_lacks_a_seed():
    """With one unit of a token grid gone, the claims table says some grid cells lack a seed, rather than giving the
    fit as if every cell held every seed; for a full grid it says nothing of the kind."""
    from difftransformer.experiments.report.claims import _scaling_claims

    def cell(steps, base):
        return {(a, s): _run(a, s, max_steps=steps, last_step=steps, final_val=base + (0.1 if a == "diff" else 0)
                             + 0.01 * s) for a in ("diff", "transformer") for s in (0, 1)}
    train = {"train": {"batch_size": 4, "seq_len": 32}}
    for drop, lacking in ((("transformer", 1), True), (None, False)):
        small = {k: v for k, v in cell(2, 5.0).items() if k != drop}
        grid = {(None, 256): small, (None, 512): cell(4, 4.5), (None, 1024): cell(8, 4.0)}
        rows = _scaling_claims(_grid(grid, (None, 1024), train))
        assert rows and ("some grid cells lack a seed" in rows[0]["ours"]) == lacking, rows
