"""The batch-size study's script: reuse of finished runs, the table's figures, the plot.

On fabricated metrics (no training): the learning runs are the study itself.
"""

import json
import os

import numpy as np
import pytest

from benchmarks import sngan_batch_size as study


def _metrics(accuracies, seconds_per_update, first_seconds=2.0, eval_every=50):
    """One record per interval; FID falls as accuracy rises."""
    out, t = [], first_seconds
    for i, acc in enumerate(accuracies, start=1):
        out.append({"step": i * eval_every, "fid": 100.0 * (1.0 - acc) + 1.0, "class_accuracy": acc,
                    "train_seconds": t, "seconds": t + 5.0 * i, "d_loss": 1.0, "g_loss": 0.0,
                    "inception_score": 5.0})
        t += eval_every * seconds_per_update[i % len(seconds_per_update)]
    return out


@pytest.fixture()
def runs_dir(tmp_path):
    """Two finished runs, as the command leaves them (metrics.json) and the script's record."""
    fabricated = {32: (_metrics([0.1, 0.3, 0.6, 0.85], [0.1, 0.12]), 100.0),
                  256: (_metrics([0.2, 0.9, 0.95, 0.97], [0.5]), 300.0)}
    for batch, (history, wall) in fabricated.items():
        run = tmp_path / "runs" / f"batch{batch}"
        run.mkdir(parents=True)
        (run / "metrics.json").write_text(json.dumps(history))
        (run / "study.json").write_text(json.dumps({"process_seconds": wall, "invocations": []}))
    return tmp_path


def test_reuses_finished_runs_and_writes_table_and_plot(runs_dir, capsys):
    results = runs_dir / "results"
    # Finished runs are reused: no command is started (it would fail: no TF devices wanted here).
    assert study.main(["--out", str(runs_dir / "runs"), "--results", str(results),
                       "--batch-sizes", "32", "256", "--steps", "200", "--eval-every", "50"]) == 0
    assert "reusing" in capsys.readouterr().out
    doc = json.loads((results / "sngan_batch_size.json").read_text())
    assert [r["batch"] for r in doc["runs"]] == [32, 256]
    assert "--global-batch-size 256" in doc["runs"][1]["command"]

    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in (results / "sngan_batch_size.md").read_text().splitlines()
            if line.startswith("| 32 ") or line.startswith("| 256 ")}
    # Columns: @100, @200 (steps/2 = 100 and 2 * eval_every = 100 merge), best FID, updates
    # and training seconds to accuracy 0.8, seconds per update, total, wall.
    assert rows["32"][:2] == ["71.0 / 0.30", "16.0 / 0.85"]
    assert rows["32"][2] == "16.0 (@200)"
    assert rows["32"][3:5] == ["200", f"{2.0 + 50 * 0.12 + 50 * 0.1 + 50 * 0.12:.0f}"]
    # The median over the intervals (0.12, 0.1, 0.12), not the mean.
    assert rows["32"][5] == "0.120"
    assert rows["256"][3:6] == ["100", f"{2.0 + 50 * 0.5:.0f}", "0.500"]
    assert rows["256"][7] == "300"
    png = (results / "sngan_batch_size.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_not_reached_and_bad_batch(runs_dir, capsys):
    history = json.loads((runs_dir / "runs" / "batch32" / "metrics.json").read_text())
    entry = {"batch": 32, "metrics": history[:3], "process_seconds": None}
    summary = study.summarize(entry)
    assert summary["reached_step"] is None and np.isclose(summary["seconds_per_update"], 0.11)
    with pytest.raises(SystemExit):
        study.main(["--out", str(runs_dir / "runs"), "--batch-sizes", "30"])
    assert "is not divisible by --replicas 4" in capsys.readouterr().err
    assert not os.path.exists(runs_dir / "runs" / "batch30")
