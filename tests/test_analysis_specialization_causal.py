"""The report's router-swap and steering sections, from real `moee ablate --swap-from / --steer`
outputs of a tiny model: shown with their nulls, figures and the donor's identity; refused before any
work when the file is missing, not JSON or the wrong kind of result, and refused when it is of
another model."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from moee.analysis.specialization.sections import router_swap, steering
from moee.analysis.specialization.sections.router_swap import read_swap, router_swap_section
from moee.analysis.specialization.sections.steering import read_steering, steering_section
from moee.capture.tiny import tiny_model, tiny_tokenizer
from moee.cli import main

FAST = ["--device", "cpu", "--permutations", "1", "--token-view-texts", "1"]
L, E = 2, 8  # the tiny OLMoE of tests/conftest.py
WORDS = "the cat sat on the mat and a dog ran in the park".split()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "c.jsonl"
    path.write_text(
        "".join(
            json.dumps({"text": " ".join(WORDS[i:] + WORDS[:i]), "d": "pq"[i % 2]}) + "\n" for i in range(6)
        )
    )
    return path


@pytest.fixture(scope="module")
def donor(tmp_path_factory) -> str:
    """Another tiny OLMoE of the same shape (other weights): a donor, and another model."""
    path = tmp_path_factory.mktemp("donor") / "olmoe"
    tiny_model("olmoe", n_layers=L, seed=7).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return str(path)


def _ablate(model: str, corpus: Path, out: Path, *extra: str) -> Path:
    argv = ["ablate", "--model", model, "--corpus", str(corpus), "--domain-field", "d", "--device", "cpu"]
    assert main([*argv, "--null-draws", "2", "--out", str(out), *extra]) == 0
    return out


@pytest.fixture(scope="module")
def results(tiny_model_dir, donor, corpus, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ablate")
    return {
        "swap": _ablate(tiny_model_dir, corpus, root / "swap", "--swap-from", donor),
        "boost": _ablate(tiny_model_dir, corpus, root / "boost", "--steer", "0:1=2", "1:2=2"),
        "suppress": _ablate(tiny_model_dir, corpus, root / "suppress", "--steer", "0:1=-2", "1:2=-2"),
        "importance": _ablate(tiny_model_dir, corpus, root / "imp", "--layers", "1", "--no-null"),
        "other": _ablate(donor, corpus, root / "other", "--swap-from", tiny_model_dir),
    }


def _report(model: str, corpus: Path, out: Path, *extra: str) -> int:
    argv = ["report", "--model", model, "--corpus", str(corpus), "--out", str(out), *FAST]
    return main([*argv, *extra])


def _inner(page: str, section: str) -> str:
    return page.split(f"<section id='{section}'>", 1)[1].split("</section>", 1)[0]


@pytest.mark.slow
def test_the_sections_render_from_real_ablate_outputs(tiny_model_dir, donor, corpus, results, tmp_path):
    out = tmp_path / "rep"
    steer = [str(results["boost"]), str(results["suppress"] / "steering.json")]
    assert (
        _report(tiny_model_dir, corpus, out, "--router-swap", str(results["swap"]), "--steering", *steer) == 0
    )
    saved = json.loads((out / "report.json").read_text())
    swap = saved["router_swap"]
    written = json.loads((results["swap"] / "swap.json").read_text())
    assert swap["available"] and swap["donor"] == donor and swap["donor_digest"] == written["donor_digest"]
    assert [r["layer"] for r in swap["swaps"]] == [0, 1, "all"]
    assert [r["null"] for r in swap["swaps"]] == [r["null"] for r in written["swaps"]]
    assert all(r["recovered"] is None or r["recovered"] == 1 - r["delta"] / r["null"] for r in swap["swaps"])
    cases = saved["steering"]["cases"]
    assert [[b["bias"] for b in c["biases"]] for c in cases] == [[2.0, 2.0], [-2.0, -2.0]]
    assert all(len(c["null"]["draws"]) == 2 and c["null"]["kl_next_token"]["std"] >= 0 for c in cases)
    page = (out / "report.html").read_text()
    inner = _inner(page, "router_swap")
    assert "<img " in inner and "permuted" in inner and donor in inner and written["donor_digest"] in inner
    inner = _inner(page, "steering")
    assert "<img " in inner and "drawn at random" in inner and "0:1+2 1:2+2" in inner and "0:1-2" in inner
    assert saved["ablation"]["available"] is False  # not given: still there, saying so


@pytest.mark.slow
def test_without_them_the_sections_say_how_to_get_them(tiny_model_dir, corpus, tmp_path):
    out = tmp_path / "plain"
    assert _report(tiny_model_dir, corpus, out) == 0
    saved = json.loads((out / "report.json").read_text())
    assert saved["router_swap"] == router_swap.UNAVAILABLE and saved["steering"] == steering.UNAVAILABLE
    page = (out / "report.html").read_text()
    assert "--swap-from" in _inner(page, "router_swap") and "--router-swap" in _inner(page, "router_swap")
    assert "--steer " in _inner(page, "steering") and "<img " not in _inner(page, "steering")


def test_a_result_of_another_model_is_refused(tiny_model_dir, corpus, results, tmp_path, monkeypatch, capsys):
    import moee.analysis.specialization as package

    def refuse(*args, **kwargs):
        raise AssertionError("the texts were routed before the swap was checked")

    monkeypatch.setattr(package, "build_report", refuse)
    assert _report(tiny_model_dir, corpus, tmp_path / "r", "--router-swap", str(results["other"])) == 2
    assert "a router-swap result of other weights" in capsys.readouterr().err
    other = read_swap(results["other"])
    with pytest.raises(ValueError, match="another model"):
        router_swap_section(other, model=tiny_model_dir, n_layers=L, n_experts=E + 1)
    case = read_steering(results["boost"])
    with pytest.raises(ValueError, match="steering result of other weights"):
        steering_section([case], model=tiny_model_dir, n_layers=L, n_experts=E, weights_digest="0" * 12)
    with pytest.raises(ValueError, match="another model"):
        steering_section([case], model=tiny_model_dir, n_layers=1, n_experts=E)


@pytest.mark.parametrize(
    ("flag", "given", "match"),
    [
        ("--router-swap", "missing", "--router-swap .*no such file"),
        ("--steering", "missing", "--steering .*no such file"),
        ("--steering", "notjson", "is not JSON"),
        (
            "--steering",
            "importance",
            "holds importance.json, an expert-importance result: pass it to --ablation",
        ),
        (
            "--steering",
            "importance/importance.json",
            "an expert-importance result, not steering: pass it to --ablation",
        ),
        ("--router-swap", "boost/steering.json", "a steering result, not router-swap: pass it to --steering"),
        (
            "--ablation",
            "swap/swap.json",
            "a router-swap result, not expert-importance: pass it to --router-swap",
        ),
        ("--router-swap", "noswaps", r"not a router-swap result \('swaps' is not a non-empty list\)"),
        ("--steering", "badbias", r"biases\[0\] has no number for bias"),
        ("--router-swap", "editedswap", r"f\.json was changed after it was written .*re-run .*moee ablate"),
        ("--steering", "editedkl", r"f\.json was changed after it was written .*re-run .*moee ablate"),
    ],
)
def test_a_wrong_file_is_refused_before_any_work(
    tiny_model_dir, corpus, results, tmp_path, monkeypatch, capsys, flag, given, match
):
    import moee.analysis.specialization as package
    from moee.embed.embedder import MoEEmbedder

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded or routed before the file was checked")

    monkeypatch.setattr(package, "build_report", refuse)
    monkeypatch.setattr(MoEEmbedder, "from_pretrained", refuse)
    path = tmp_path / "f.json"
    if given == "missing":
        path = tmp_path / "none"
    elif given == "notjson":
        path.write_text("{nope")
    elif given == "noswaps":
        path.write_text(json.dumps({"swaps": [], "base": {}}))
    elif given == "badbias":
        result = json.loads((results["boost"] / "steering.json").read_text())
        result["biases"][0]["bias"] = "big"
        path.write_text(json.dumps(result))
    elif given == "editedswap":  # a well-formed number, edited: only the seal tells
        result = json.loads((results["swap"] / "swap.json").read_text())
        result["swaps"][0]["delta"] = 9.99
        path.write_text(json.dumps(result))
    elif given == "editedkl":
        result = json.loads((results["boost"] / "steering.json").read_text())
        result["kl_next_token"] = 9.99
        path.write_text(json.dumps(result))
    elif "/" in given:
        folder, name = given.split("/")
        path = results[folder] / name
    else:
        path = results[given]
    assert _report(tiny_model_dir, corpus, tmp_path / "r", flag, str(path)) == 2
    err = capsys.readouterr().err
    assert re.search(match, err), err
    assert not (tmp_path / "r").exists()


def test_the_sections_escape_the_file_strings(tiny_model_dir, results):
    swap = read_swap(results["swap"])
    hostile = "<b>x</b>"
    swap = {**swap, "source": hostile, "donor": hostile, "donor_digest": hostile}
    swap["swaps"][0]["router"] = hostile
    part = router_swap_section(swap, model=tiny_model_dir, n_layers=L, n_experts=E)
    case = {**read_steering(results["boost"]), "source": hostile}
    case["null"]["description"] = hostile
    html = router_swap.SECTION.render({"router_swap": part}, None) + steering.SECTION.render(
        {"steering": steering_section([case], model=tiny_model_dir, n_layers=L, n_experts=E)}, None
    )
    assert hostile not in html and "&lt;b&gt;x&lt;/b&gt;" in html
