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


SMOLLM2 = ROOT / "analysis" / "smollm2_moe"


def test_the_smollm2_readme_quotes_its_ablation_steering_and_report():
    """analysis/smollm2_moe/README.md's causal and report figures are the committed JSON's."""
    if not (SMOLLM2 / "specialization" / "report.json").is_file():
        pytest.skip("no committed smollm2-moe report")
    readme = " ".join((SMOLLM2 / "README.md").read_text().split())
    ablation = json.loads((SMOLLM2 / "ablation_experts" / "importance.json").read_text())
    top = max(ablation["experts"], key=lambda e: e["delta"])
    assert f"+{top['delta']:.4f} ({top['layer']}:{top['expert']})" in readme
    above = sum(e["excess"] > 0 for e in ablation["experts"])
    assert f"{above} of {len(ablation['experts'])}" in readme
    for case in ("boost", "suppress"):
        steering = json.loads((SMOLLM2 / "steering" / case / "steering.json").read_text())
        assert f"| {steering['kl_next_token']:.4f} |" in readme, case
    report = json.loads((SMOLLM2 / "specialization" / "report.json").read_text())
    assert f"| {_range([c['max_ratio'] for c in report['coactivation']['by_layer']])} |" in readme
    assert f"| {_range([p['excess'] for p in report['cross_layer']['pairs']])} |" in readme
    assert f"{report['summary']['n_tokens']:,} tokens" in readme
