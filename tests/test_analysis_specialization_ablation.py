"""The report's causal expert-importance section: read from a `moee ablate` result (``--ablation``),
refused before any work when the file is missing, malformed or of another model, shown with its
figure and table when given and saying how to get it otherwise."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from moee.analysis.specialization.ablate_results import write_result
from moee.analysis.specialization.html import render_html
from moee.analysis.specialization.sections import ablation
from moee.analysis.specialization.sections.ablation import ablation_section, read_ablation
from moee.capture.tiny import TINY_WORDS, tiny_model, tiny_tokenizer
from moee.cli import main

COMMITTED = Path(__file__).resolve().parent.parent / "analysis" / "ablation_experts"
FAST = ["--device", "cpu", "--permutations", "1", "--token-view-texts", "1"]
L, E = 2, 8  # the tiny OLMoE below


def importance(model: str | None, n_layers: int = L, n_experts: int = E, digest: str | None = None) -> dict:
    """A synthetic ``importance.json`` of the shape ``moee ablate`` writes."""
    rng = np.random.default_rng(0)
    experts = [
        {
            "layer": layer,
            "expert": e,
            "router": f"model.layers.{layer}.mlp.gate",
            "load": float(rng.uniform(0.1, 0.4)),
            "max_activation": 1.0,
            "delta": float(rng.normal(0.01, 0.01)),
            "delta_by_domain": {"a": 0.0},
            "null": 0.002,
            "null_by_domain": {"a": 0.0},
            "excess": 0.001,
            "importance_rank": 1 + layer * n_experts + e,
            "load_rank": 1 + layer * n_experts + e,
        }
        for layer in range(n_layers)
        for e in range(n_experts)
    ]
    meta = {"command": "moee ablate --corpus c.txt --out d", "model": model}
    if digest is not None:
        meta["weights_digest"] = digest
    return {
        "n_tokens": 50,
        "domains": {"a": 50},
        "mode": "reselect",
        "renormalize": False,
        "base": {"loss": 5.0, "loss_by_domain": {"a": 5.0}},
        "layers": [f"model.layers.{i}.mlp.gate" for i in range(n_layers)],
        "n_experts": [n_experts] * n_layers,
        "null": "load-matched: each token loses one of its k selected experts",
        "experts": experts,
        "spearman_importance_load": {
            "pooled": 0.3,
            "by_layer": {str(i): 0.2 for i in range(n_layers)},
            "pooled_excess": 0.1,
        },
        "super_experts": {"ratio": 10.0, "median_max_activation": 1.0, "flagged": [], "delta": None},
        "meta": meta,
    }


def _write(path: Path, result) -> Path:
    """``result`` as `moee ablate` writes it (sealed); a non-object as it is."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(result, dict):
        return write_result(path, result)
    path.write_text(json.dumps(result))
    return path


def test_the_committed_ablation_reads_into_the_section_and_its_page():
    result = read_ablation(COMMITTED)  # the folder: its importance.json
    assert result["source"].endswith("importance.json")
    part = ablation_section(
        result, model="minilm-moe", n_layers=len(result["layers"]), n_experts=result["n_experts"][0]
    )
    assert part["available"] and len(part["experts"]) == len(result["experts"])
    assert part["spearman_importance_load"]["by_layer"] == result["spearman_importance_load"]["by_layer"]
    assert {"load", "delta", "null", "excess"} <= set(part["experts"][0])
    assert part["super_experts"] == result["super_experts"]
    html = ablation.SECTION.render({"ablation": part}, None)
    assert "<img " in html and "<table>" in html and "load-matched null" in html
    top = max(result["experts"], key=lambda r: r["delta"])
    assert f"<td>{top['layer']}:{top['expert']}</td>" in html


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (None, "no such file"),
        ("{not json", "is not JSON"),
        ({"swaps": [], "base": {}}, "a router-swap result, not expert-importance: pass it to --router-swap"),
        ({"experts": []}, "missing spearman_importance_load"),
        (lambda r: r["experts"][3].update(delta="big"), r"experts\[3\] has no number for delta"),
        (lambda r: r["experts"][0].pop("layer"), r"experts\[0\] lacks a layer"),
        (lambda r: r.update(spearman_importance_load={"pooled": 1}), "lacks by_layer"),
    ],
)
def test_a_bad_ablation_file_is_refused_with_the_fix(tmp_path, content, match):
    path = tmp_path / "importance.json"
    if callable(content):
        result = importance("m")
        content(result)
        _write(path, result)
    elif isinstance(content, str):
        path.write_text(content)
    elif content is not None:
        _write(path, content)
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        read_ablation(path)


def test_an_ablation_of_another_model_is_refused(tmp_path):
    ok = read_ablation(_write(tmp_path / "a.json", importance(str(tmp_path))))
    assert ablation_section(ok, model=str(tmp_path), n_layers=L, n_experts=E)["available"]
    with pytest.raises(ValueError, match="another model"):
        ablation_section(ok, model=str(tmp_path), n_layers=L, n_experts=E + 1)
    with pytest.raises(ValueError, match="not of the report's model"):
        ablation_section(ok, model="someone/else", n_layers=L, n_experts=E)
    digested = read_ablation(_write(tmp_path / "b.json", importance("x", digest="abc")))
    with pytest.raises(ValueError, match="other weights"):
        ablation_section(digested, model="x", n_layers=L, n_experts=E, weights_digest="def")
    # the digest decides where both are known, whatever the name
    assert ablation_section(digested, model="renamed", n_layers=L, n_experts=E, weights_digest="abc")[
        "available"
    ]


def test_without_an_ablation_the_section_says_how_to_get_it():
    html = ablation.SECTION.render({"ablation": dict(ablation.UNAVAILABLE)}, None)
    assert "moee ablate" in html and "--ablation" in html and "<img " not in html


def test_the_section_escapes_the_file_strings():
    part = ablation_section(
        {**importance("m"), "source": "<b>x</b>", "mode": "<i>m</i>", "null": "<s>n</s>"},
        model="m",
        n_layers=L,
        n_experts=E,
    )
    html = ablation.SECTION.render({"ablation": part}, None)
    assert "<b>x</b>" not in html and "<i>m</i>" not in html and "<s>n</s>" not in html
    assert "&lt;b&gt;x&lt;/b&gt;" in html


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "olmoe"
    tiny_model("olmoe", n_layers=L).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture
def corpus(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(" ".join(rng.choice(TINY_WORDS, size=6)) for _ in range(6)) + "\n")
    return path


def _argv(model_dir, corpus, out, *extra):
    return ["report", "--model", str(model_dir), "--corpus", str(corpus), "--out", str(out), *FAST, *extra]


@pytest.mark.slow
def test_report_cli_with_and_without_ablation(model_dir, corpus, tmp_path, capsys):
    folder = tmp_path / "abl"
    _write(folder / "importance.json", importance(str(model_dir)))
    out = tmp_path / "rep"
    assert main(_argv(model_dir, corpus, out, "--ablation", str(folder))) == 0
    saved = json.loads((out / "report.json").read_text())
    assert saved["ablation"]["available"] and len(saved["ablation"]["experts"]) == L * E
    page = (out / "report.html").read_text()
    inner = page.split("<section id='ablation'>", 1)[1].split("</section>", 1)[0]
    assert "<img " in inner and "load-matched null" in inner
    plain = tmp_path / "plain"
    assert main(_argv(model_dir, corpus, plain)) == 0
    saved = json.loads((plain / "report.json").read_text())
    assert saved["ablation"] == ablation.UNAVAILABLE
    inner = (plain / "report.html").read_text().split("<section id='ablation'>", 1)[1].split("</section>")[0]
    assert "moee ablate" in inner and "<img " not in inner
    assert render_html(saved).count("<section id='ablation'>") == 1


def test_report_cli_refuses_a_bad_ablation_before_any_work(model_dir, corpus, tmp_path, monkeypatch, capsys):
    import moee.analysis.specialization as package
    from moee.embed.embedder import MoEEmbedder

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded or routed before the ablation was checked")

    monkeypatch.setattr(package, "build_report", refuse)
    monkeypatch.setattr(MoEEmbedder, "from_pretrained", refuse)
    assert main(_argv(model_dir, corpus, tmp_path / "r", "--ablation", str(tmp_path / "none"))) == 2
    assert "--ablation" in capsys.readouterr().err
    bad = _write(tmp_path / "bad.json", {"experts": "no"})
    assert main(_argv(model_dir, corpus, tmp_path / "r", "--ablation", str(bad))) == 2
    assert "not an expert-importance result" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_report_cli_refuses_an_ablation_of_another_model_before_routing(
    model_dir, corpus, tmp_path, monkeypatch, capsys
):
    import moee.analysis.specialization as package

    def refuse(*args, **kwargs):
        raise AssertionError("a model was routed before the ablation was checked")

    monkeypatch.setattr(package, "build_report", refuse)
    other = _write(tmp_path / "o.json", importance(str(model_dir), n_experts=E * 2))
    assert main(_argv(model_dir, corpus, tmp_path / "r", "--ablation", str(other))) == 2
    assert "another model" in capsys.readouterr().err
    digest = _write(tmp_path / "d.json", importance(str(model_dir), digest="0" * 12))
    assert main(_argv(model_dir, corpus, tmp_path / "r", "--ablation", str(digest))) == 2
    assert "other weights" in capsys.readouterr().err
    named = _write(tmp_path / "n.json", importance("someone/else"))
    assert main(_argv(model_dir, corpus, tmp_path / "r", "--ablation", str(named))) == 2
    assert "not of the report's model" in capsys.readouterr().err


def test_report_cli_refuses_a_tampered_or_unsealed_ablation(model_dir, corpus, tmp_path, monkeypatch, capsys):
    """An importance.json whose meta was removed and one delta edited to 9.99 was shown as measured:
    every result `moee ablate` writes is sealed, and an edited or unsealed one is refused before any
    work, naming the file and the command to re-run."""
    import moee.analysis.specialization as package

    def refuse(*args, **kwargs):
        raise AssertionError("a model was routed before the ablation was checked")

    monkeypatch.setattr(package, "build_report", refuse)
    sealed = _write(tmp_path / "ok" / "importance.json", importance(str(model_dir)))
    assert read_ablation(sealed)["result_sha256"]
    tampered = json.loads(sealed.read_text())
    del tampered["meta"]
    tampered["experts"][3]["delta"] = 9.99
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "importance.json").write_text(json.dumps(tampered))
    assert main(_argv(model_dir, corpus, tmp_path / "r", "--ablation", str(tmp_path / "t"))) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 't' / 'importance.json'} was changed after it was written" in err, err
    assert "re-run `moee ablate`" in err
    unsealed = importance(str(model_dir))  # as moee ablate wrote results before they were sealed
    (tmp_path / "u.json").write_text(json.dumps(unsealed))
    assert main(_argv(model_dir, corpus, tmp_path / "r", "--ablation", str(tmp_path / "u.json"))) == 2
    err = capsys.readouterr().err
    assert "u.json has no result_sha256" in err, err
    assert "re-run the command that wrote it: moee ablate --corpus c.txt --out d" in err
    assert not (tmp_path / "r").exists()
