"""Progress in logs (not a terminal) and the readable end-of-eval table."""

from __future__ import annotations

import logging

from mmfast.progress import Progress
from mmfast.report import metrics_table


def test_progress_logs_done_total_rate_eta_without_a_terminal(caplog, monkeypatch):
    monkeypatch.setenv("MMFAST_PROGRESS_EVERY", "0")  # a line per update
    with caplog.at_level(logging.INFO, logger="mmfast.progress"), Progress(10, "pope_random") as p:
        p.update(4)
        p.update(6)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("pope_random: 4/10 samples (40%),") and "/s, ETA " in lines[0]
    assert lines[-1].startswith("pope_random: 10/10 samples (100%)")


def test_progress_is_quiet_between_intervals(caplog, monkeypatch):
    monkeypatch.setenv("MMFAST_PROGRESS_EVERY", "3600")
    with caplog.at_level(logging.INFO, logger="mmfast.progress"), Progress(10, "chair") as p:
        for _ in range(9):
            p.update(1)
        assert not caplog.records  # nothing yet: the interval has not passed
        p.update(1)
    assert [r.getMessage().split(",")[0] for r in caplog.records] == ["chair: 10/10 samples (100%)"]


def test_metrics_table_is_readable_with_intervals():
    metrics = {
        "pope": {
            "random": {"f1": 0.9, "f1_ci95": [0.85, 0.94], "accuracy": 0.91, "yes_ratio": 0.5, "n": 100},
            "mean_f1": 0.9,
            "mean_f1_ci95": [0.86, 0.93],
            "mean_accuracy": 0.91,
            "n": 100,
        },
        "chair": {"chair_s": 0.6, "chair_i": 0.21, "chair_i_ci95": [0.18, 0.24], "recall": 0.55, "n": 50},
    }
    table = metrics_table(metrics).splitlines()
    assert table[0].split() == ["task", "n"]
    assert "pope random" in table[1] and "F1 0.900 [0.850, 0.940]" in table[1] and " 100 " in table[1]
    assert "F1 0.900 [0.860, 0.930]" in table[2]
    assert "CHAIR_i 0.210 [0.180, 0.240]" in table[3] and "recall 0.550" in table[3]
    assert "{" not in "\n".join(table)  # no raw JSON
