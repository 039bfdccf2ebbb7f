"""The final export and the final eval each log their own peak (the allocator's on a GPU, the resident set size's
here), measured from a reset at the phase's start: `make gpu-check` compares them with the planner's phases."""

from __future__ import annotations

from tests.conftest import read_metrics


def test_the_export_and_the_eval_log_their_own_peaks(reference_run):
    rows = read_metrics(reference_run(None))
    last = max(row["step"] for row in rows if "loss" in row)
    for phase in ("save", "eval"):
        (row,) = [row for row in rows if f"{phase}_peak_rss_gb" in row]
        assert row["step"] == last and set(row) == {"step", f"{phase}_peak_rss_gb"}
        # This process's resident set: torch and the tiny model, well under the machine's memory.
        assert 0.1 < row[f"{phase}_peak_rss_gb"] < 16, row
