"""results.md's sweep table: the footnote on cumulative expert statistics only under columns that show some."""

from __future__ import annotations

from strata.bench.record import expert_delta
from strata.bench.report import write

NOTE = "are cumulative since the server started"


def _row(length: int, experts: dict, note: str | None = None) -> dict:
    s = {"median": 10.0, "min": 9.0, "max": 11.0, "n": 1}
    return {"length": length, "prompt_tokens": [length], "prefill_tok_s": s, "decode_tok_s": s, "ttft_s": s,
            "experts": experts, **({"note": note} if note else {})}


def _report(tmp_path, rows: list[dict]) -> str:
    results = {"name": "x", "date": "d", "temperature": 0,
               "suites": {"sweep": {"config": {"warmup": 1, "runs": 1, "gen": 8}, "rows": rows}}}
    return write(results, tmp_path)["markdown"].read_text(encoding="utf-8")


def test_no_expert_footnote_when_the_expert_columns_are_empty(tmp_path):
    """A server whose experts are all resident has no expert rates in /metrics, only the decode lanes: the bench
    records its statistics as cumulative with nothing in them, and the table's expert columns are all '-'."""
    empty = expert_delta({"experts": {"decode_lanes": {}}}, {"experts": {"decode_lanes": {}}})
    assert empty == {"cumulative": True}
    md = _report(tmp_path, [_row(1024, empty), _row(4096, empty)])
    assert "| 1K | 1024 |" in md and "| - | - | - |" in md
    assert NOTE not in md


def test_the_expert_footnote_when_a_row_has_rates(tmp_path):
    """Cumulative rates in any row: one footnote naming the first such row; the notes of the rows after it are
    still printed."""
    rates = {"hit_rate": 0.7, "cpu_per_token": 1.5, "pcie_per_token": 2.0, "cumulative": True}
    md = _report(tmp_path, [_row(1024, {"cumulative": True}), _row(4096, rates), _row(16384, rates, note="late")])
    assert md.count(NOTE) == 1
    assert f"Expert statistics at 4K {NOTE}" in md
    assert "Note (16K): late" in md
