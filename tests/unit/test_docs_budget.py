"""docs/architecture.md is the map of the code, not its measurements: it stays under a line budget,
and carries no tracker numbers. Measurements live in benchmarks/README.md, mechanisms in depth
(kernels, TP, MLA, Mamba, the spans table) in docs/internals.md. The budget is the map's size after
those moved out, with a little room; a section that needs more belongs in internals.md."""

import re
from pathlib import Path

ARCHITECTURE = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"
LINE_BUDGET = 400


def test_architecture_within_line_budget():
    lines = ARCHITECTURE.read_text().splitlines()
    assert len(lines) <= LINE_BUDGET, (
        f"docs/architecture.md has {len(lines)} lines, budget {LINE_BUDGET}: move depth to docs/internals.md, "
        "figures to benchmarks/README.md")


def test_architecture_names_no_tracker_numbers():
    hits = [n for n, line in enumerate(ARCHITECTURE.read_text().splitlines(), 1)
            if re.search(r"\bissues? \d", line)]
    assert hits == [], f"tracker numbers in docs/architecture.md at lines {hits} (commit messages keep them)"
