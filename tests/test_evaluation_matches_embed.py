"""The score `moee evaluate` reports is the score of the vectors `moee embed` writes with the same
flags, with no flags too (both then use the model's saved configuration): the default model on the
offline STS task lee_sts, scored from the embedded vectors by hand."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from scipy.stats import spearmanr

from moee.cli import main
from moee.data.offline_tasks import load_task_data

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def lee(tmp_path_factory) -> tuple[Path, np.ndarray, np.ndarray, np.ndarray]:
    """lee_sts's distinct texts in a file, each pair's rows and gold scores."""
    rows = load_task_data("lee_sts")["test"]
    texts = list(dict.fromkeys([r["sentence1"] for r in rows] + [r["sentence2"] for r in rows]))
    index = {t: i for i, t in enumerate(texts)}
    path = tmp_path_factory.mktemp("lee") / "texts.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    left = np.array([index[r["sentence1"]] for r in rows])
    right = np.array([index[r["sentence2"]] for r in rows])
    return path, left, right, np.array([float(r["score"]) for r in rows])


def _embed_score(lee, out: Path, flags: list[str]) -> tuple[float, dict]:
    path, left, right, gold = lee
    assert main(["embed", str(path), "--out", str(out), "--device", "cpu", *flags]) == 0
    x = np.load(out)
    x = x / np.linalg.norm(x, axis=1, keepdims=True)
    sidecar = json.loads(Path(f"{out}.json").read_text())
    return 100 * float(spearmanr(gold, np.sum(x[left] * x[right], axis=1))[0]), sidecar


def _evaluate_scores(out: Path, flags: list[str]) -> dict[str, tuple[float, dict]]:
    argv = ["evaluate", "--tasks", "lee_sts", "--out", str(out), "--device", "cpu", *flags]
    assert main(argv) == 0
    doc = json.loads((out / "tables.json").read_text())
    return {r["settings"]["method"]: (r["tasks"]["lee_sts"], r["settings"]) for r in doc["systems"]}, doc[
        "run"
    ]


@pytest.mark.slow
def test_evaluate_and_embed_agree_without_flags(lee, tmp_path):
    scores, run = _evaluate_scores(tmp_path / "eval", [])
    assert set(scores) == {"hs", "rw", "moee_concat", "moee_sum"}
    assert run["model_config"]["pooling"] == "mean" and run["pooling"] == "mean" and run["config_given"] == []
    embedded, sidecar = _embed_score(lee, tmp_path / "default.npy", [])  # moee_sum: embed's own default
    score, settings = scores["moee_sum"]
    assert score == pytest.approx(embedded, abs=1e-3)
    assert (sidecar["pooling"], sidecar["prompt"], sidecar["score"]) == ("mean", None, "native")
    assert (settings["pooling"], settings["prompt"], settings["score"]) == ("mean", "none", "native")
    assert settings["alpha"] == sidecar["alpha"] == 1.0
    # the README's HS row of the default model (its own configuration: mean pooling, no prompt, its
    # reference statistics) is what no flag gives
    committed = json.loads((ROOT / "eval/results/smollm2_moe/mean/tables.json").read_text())
    hs = next(r for r in committed["systems"] if r["settings"] == scores["hs"][1])
    assert scores["hs"][0] == pytest.approx(hs["tasks"]["lee_sts"], abs=0.01)


@pytest.mark.slow
def test_evaluate_and_embed_agree_with_the_same_flags(lee, tmp_path):
    flags = ["--pooling", "last", "--score", "softmax"]
    scores, run = _evaluate_scores(tmp_path / "eval", [*flags, "--methods", "hs", "--prompts", "prompteol"])
    assert run["config_given"] == ["pooling", "score"]
    embedded, sidecar = _embed_score(
        lee, tmp_path / "hs.npy", [*flags, "--method", "hs", "--prompt", "prompteol"]
    )
    assert scores["hs"][0] == pytest.approx(embedded, abs=1e-3)
    assert (sidecar["pooling"], sidecar["prompt"], sidecar["score"]) == ("last", "prompteol", "softmax")
