"""analysis/README.md quotes the committed specialization report: its co-activation and cross-layer
figures must be the ones analysis/specialization/report.json holds (rerunning `moee report` without
updating the text fails here)."""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "analysis" / "README.md"
REPORT = ROOT / "analysis" / "specialization" / "report.json"


def _range(values) -> str:
    return f"{min(values):.2f}-{max(values):.2f}"


@pytest.fixture(scope="module")
def texts():
    if not REPORT.is_file():
        pytest.skip("no committed specialization report")
    return " ".join(README.read_text().split()), json.loads(REPORT.read_text())


def test_the_readme_quotes_the_reports_coactivation_range(texts):
    readme, report = texts
    quoted = re.search(r"has P\(b \| a\) (\d\.\d\d-\d\.\d\d)", readme)
    assert quoted, "analysis/README.md no longer quotes the co-activation range"
    assert quoted.group(1) == _range([c["max_ratio"] for c in report["coactivation"]["by_layer"]])


def test_the_readme_quotes_the_reports_cross_layer_excess_on_top_k_sets(texts):
    readme, report = texts
    quoted = re.search(r"`cross_layer\.pairs\[\]\.excess`\) is (\d\.\d\d-\d\.\d\d)", readme)
    assert quoted, "analysis/README.md no longer quotes the cross-layer excess"
    assert quoted.group(1) == _range([p["excess"] for p in report["cross_layer"]["pairs"]])
    assert "first-choice pairs above independence" not in readme  # it is computed on top-k sets
