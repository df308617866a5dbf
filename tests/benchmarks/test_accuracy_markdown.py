"""benchmarks/accuracy.py --only: the re-measured rows go in place of theirs, the rest of the matrix stays."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import accuracy  # noqa: E402


def _row(name, act):
    return {"layout": name, "states_exact": True, "worst_category": "activations", "worst": act, "activations": act,
            "peak": 0.01, "tracked_peak": 0.01, "bubble_error": None, "step_analytic": -0.5, "step_measured_s": 0.5}


def test_only_rows_replace_their_own_and_keep_the_others():
    old = accuracy.markdown([_row("A", 0.5), _row("B", 0.2)], 4).replace("## How the two sides", "## Old notes\n\n## How")
    new = accuracy.merge_markdown(old, [_row("B", 0.03)], 4)
    assert "| A | yes | activations 50.0 % |" in new  # kept as it was measured
    assert "| B | yes | activations 3.0 % |" in new and "activations 20.0 %" not in new
    assert "## Old notes" not in new and new.count("## How the two sides are made to compare") == 1


def test_a_layout_new_to_the_matrix_goes_at_the_end_of_its_table():
    old = accuracy.markdown([_row("A", 0.5), _row("B", 0.2)], 4)
    new = accuracy.merge_markdown(old, [_row("C", 0.04)], 4)
    lines = new.split("\n")
    a, b, c = (next(i for i, x in enumerate(lines) if x.startswith(f"| {n} |")) for n in "ABC")
    assert a < b < c and lines[c - 1].startswith("| B |")  # right after the table's last row
    assert new.count("| C |") == 1 and "| A | yes | activations 50.0 % |" in new
