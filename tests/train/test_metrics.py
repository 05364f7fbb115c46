"""The metrics.jsonl readers: rows in file order, and series by kind and step; a torn last line is skipped."""

import json

from difftransformer.train.metrics import METRICS_FILE, read_metric_series, read_metrics


def test_metrics_readers_skip_a_torn_last_line(tmp_path):
    path = tmp_path / METRICS_FILE
    rows = [{"kind": "train", "step": 1, "loss": 2.0}, {"kind": "val", "step": 1, "loss": 2.1},
            {"kind": "train", "step": 2, "loss": 1.9}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"kind": "train", "st')
    assert read_metrics(path) == rows
    assert read_metrics(path, "val") == rows[1:2]
    assert read_metric_series(path) == ([rows[0], rows[2]], [rows[1]])
    assert read_metric_series(tmp_path / "missing.jsonl") == ([], [])
