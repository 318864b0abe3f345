"""The report page as markup: sections and TOC, self-containment, escaping of corpus text, the
token view's embedded data and the two-report comparison (the browser test opens the same pages)."""

import json
import re

import numpy as np
import pytest

from moee.analysis.specialization import BaselineDraws, SpecializationAccumulator
from moee.analysis.specialization.html import (
    SECTIONS,
    render_html,
    token_view_payload,
)

HOSTILE = ["<script>alert(1)</script>", '"><img src=x onerror=alert(1)>', "</script><!--", "a&amp;b"]
WORDS = ["the", " cat", "\n", "  ", *HOSTILE, " sat"]
L, E, K = 3, 6, 2


def _decode(ids):
    return "".join(WORDS[i % len(WORDS)] for i in ids)


def _texts(n_texts: int = 6, seed: int = 0):
    """Token ids and dense routes ``[T, L, E]`` per text; token id t prefers expert t % E."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n_texts):
        ids = np.arange(i, i + 5 + i % 4) % len(WORDS)
        logits = rng.normal(size=(ids.size, L, E))
        logits[np.arange(ids.size), :, ids % E] += 3.0
        p = np.exp(logits)
        out.append((ids, p / p.sum(-1, keepdims=True)))
    return out


def make_report(n_texts: int = 6, seed: int = 0, model: str = "<b>model</b>") -> dict:
    """A real accumulator's report over hand-made routes (corpus text includes ``HOSTILE``) plus a
    ``token_view`` of every token: the page's input without a model."""
    acc = SpecializationAccumulator(
        L, E, K, n_contexts=2, context_window=2, draws=BaselineDraws(permutations=2, seed=seed)
    )
    texts = _texts(n_texts, seed)
    for i, (ids, p) in enumerate(texts):
        acc.update(ids, p, text_index=i, domain=HOSTILE[i % 2] if i % 3 else "plain")
    rep = acc.result(_decode, min_token_count=1)
    rep["meta"] = {"command": "moee report --corpus <c>.txt", "versions": {}}
    rep["summary"]["model"] = model
    _fill_new_sections(rep, np.random.default_rng(seed))
    rep["token_view"] = {
        "n_texts": len(texts),
        "n_tokens": sum(ids.size for ids, _ in texts),
        "decimals": 3,
        "texts": [
            {
                "text_index": i,
                "domain": "plain",
                "tokens": [WORDS[t] for t in ids],
                "token_ids": ids.tolist(),
                "predicted": [WORDS[(t + 1) % len(WORDS)] for t in ids],
                "selected": np.argsort(-p, axis=2)[:, :, :K].tolist(),
                "probs": np.round(p, 3).tolist(),
            }
            for i, (ids, p) in enumerate(texts)
        ],
    }
    return rep


def _fill_new_sections(rep: dict, rng: np.random.Generator) -> None:
    """The sections of the current report schema that the accumulator does not (yet) compute
    itself, filled with plausible random numbers of the right shapes (``setdefault``: the real
    ones win where they exist)."""
    u = lambda *shape: np.round(rng.uniform(0.05, 0.95, shape), 3).tolist()  # noqa: E731

    def top():
        return [
            {"token": w, "token_id": i, "fraction": 0.5, "count": 3, "n_t": 6} for i, w in enumerate(HOSTILE)
        ]

    by_key = {
        key: {
            "available": key != "predicted",
            "reason": None if key != "predicted" else "no LM head <found>",
            "description": key,
            "n_tokens": 40,
            "by_layer": [
                {
                    "layer": layer,
                    "weighted_max_fraction": 0.6,
                    "weighted_max_fraction_baseline": 0.4,
                    "mean_expert_specialization": 0.5,
                    "mean_expert_specialization_baseline": None if layer == 0 else 0.3,
                    "random_baseline": K / E,
                }
                for layer in range(L)
            ],
            "experts": [
                [
                    {"expert": e, "specialization": 0.5, "specialization_baseline": 0.3, "top": top()}
                    for e in range(E)
                ]
                for _ in range(L)
            ],
        }
        for key in ("input", "next", "predicted")
    }
    rep.setdefault(
        "token_specialization",
        {"keys": list(by_key), "min_token_count": 1, "n_top": 5, "random_baseline": K / E, "by_key": by_key},
    )
    rows = [
        {
            "layer": layer,
            **{f"{k}_entropy": 1.0 for k in ("dense", "selection", "load", "importance")},
            **{f"{k}_kl_uniform": 0.1 for k in ("dense", "selection", "load", "importance")},
            "dense_entropy_normalized": 0.8,
            "selection_entropy_normalized": 0.9,
        }
        for layer in range(L)
    ]
    rep.setdefault("router_entropy", {"by_layer": rows, "baseline": {"description": "uniform <router>"}})
    rep.setdefault(
        "cross_layer",
        {
            "pairs": [
                {
                    "layers": [layer, layer + 1],
                    "excess": 0.2,
                    "excess_baseline": 0.05,
                    "max_lift": 2.5,
                    "max_lift_baseline": 1.2,
                    "top_pairs": [
                        {"a": 1, "b": 2, "count": 9, "expected": 5.0, "lift": 1.8, "p_b_given_a": 0.4}
                    ],
                }
                for layer in range(L - 1)
            ],
            "heatmap_layers": [0],
            "matrices": {"0": u(E, E)},
        },
    )
    n_top = 4
    co = rep["coactivation"]
    co.setdefault("top_experts", [list(range(n_top)) for _ in range(L)])
    co.setdefault("heatmaps", [u(n_top, n_top) for _ in range(L)])
    co.setdefault("independent_heatmaps", [u(n_top, n_top) for _ in range(L)])
    for row in co["by_layer"]:
        row.setdefault("max_ratio_baseline", 0.3)
        row.setdefault("mean_lift", 1.1)
    doms = rep["domains"]
    doms.setdefault("names", sorted(doms["domains"]))
    doms.setdefault(
        "specialization_by_layer", [{"layer": i, "jsd": 0.02, "jsd_baseline": 0.01} for i in range(L)]
    )
    checkpoints = [{"name": f"step{s}", "step": s, "fraction_of_training": s / 300} for s in (100, 200, 300)]
    checkpoints[0]["name"] = HOSTILE[1]  # checkpoint names are user text too
    rep.setdefault(
        "saturation",
        {
            "available": True,
            "reason": None,
            "final": "step300",
            "n_texts": 4,
            "n_tokens": 30,
            "checkpoints": checkpoints,
            "by_layer": [
                {
                    "layer": i,
                    "top1": [0.3, 0.6, 1.0],
                    "topk": [0.4, 0.7, 1.0],
                    "top1_permutation": [0.2] * 3,
                    "topk_permutation": [0.35] * 3,
                }
                for i in range(L)
            ],
            "mean_top1": [0.3, 0.6, 1.0],
            "mean_topk": [0.4, 0.7, 1.0],
            "random_baseline": {"top1": 1 / E, "topk": K / E},
        },
    )
    rep.setdefault("ablation", ablation_part(rng))
    rep.setdefault("router_swap", router_swap_part())
    rep.setdefault("steering", steering_part())


def ablation_part(rng: np.random.Generator, source: str = HOSTILE[0]) -> dict:
    """An ablation section (what ``ablation_section`` returns) with user text in its strings."""
    experts = [
        {
            "layer": layer,
            "expert": e,
            "load": float(rng.uniform(0.1, 0.5)),
            "delta": float(rng.normal(0.01, 0.01)),
            "null": float(rng.normal(0.005, 0.002)),
            "excess": float(rng.normal(0.005, 0.01)),
            "importance_rank": layer * E + e + 1,
            "load_rank": layer * E + e + 1,
            "max_activation": 1.0,
        }
        for layer in range(L)
        for e in range(E)
    ]
    return {
        "available": True,
        "reason": None,
        "source": source,
        "model": HOSTILE[1],
        "weights_digest": None,
        "command": "moee ablate",
        "mode": HOSTILE[2],
        "renormalize": False,
        "n_tokens": 40,
        "domains": {HOSTILE[3]: 40},
        "base_loss": 5.0,
        "null": "load-matched " + HOSTILE[0],
        "experts": experts,
        "spearman_importance_load": {
            "pooled": 0.2,
            "pooled_excess": -0.1,
            "by_layer": {str(i): 0.1 * i for i in range(L)},
        },
        "super_experts": {"ratio": 10.0, "flagged": [{"layer": 0, "expert": 1}], "delta": 0.5},
    }


def router_swap_part() -> dict:
    """A router-swap section (what ``router_swap_section`` returns) with user text in its strings."""
    rows = [
        {
            "layer": i,
            "router": HOSTILE[i % 2],
            "delta": 0.01 * i,
            "null": 0.5,
            "null_std": 0.02,
            "recovered": 0.9,
        }
        for i in range(L)
    ]
    rows.append(
        {"layer": "all", "router": "all", "delta": 0.1, "null": 1.0, "null_std": 0.1, "recovered": 0.9}
    )
    return {
        "available": True,
        "reason": None,
        "source": HOSTILE[0],
        "donor": HOSTILE[1],
        "donor_digest": HOSTILE[0],
        "n_tokens": 40,
        "base_loss": 5.0,
        "null": HOSTILE[2],
        "null_draws": 3,
        "seed": 0,
        "swaps": rows,
    }


def steering_part() -> dict:
    """A steering section (what ``steering_section`` returns) with user text in its strings."""
    spread = {"mean": 0.01, "std": 0.002, "draws": [0.01]}
    case = {
        "source": HOSTILE[1],
        "biases": [{"layer": 0, "expert": 1, "bias": 2.0}],
        "kl_next_token": 0.05,
        "embedding_cosine": {"mean": 0.98},
        "selection_rate": [{"layer": 0, "expert": 1, "before": 0.1, "after": 0.6}],
        "selection_shift": 0.5,
        "null": {
            "description": HOSTILE[0],
            "n_draws": 1,
            "kl_exceeds_draws": 1,
            "kl_next_token": spread,
            "embedding_cosine_mean": {"mean": 0.99, "std": 0.001},
            "selection_shift": spread,
        },
    }
    return {"available": True, "reason": None, "cases": [case]}


def embedded_payloads(page: str) -> list[dict]:
    blocks = re.findall(r"<script type='application/json' id='[^']*'>(.*?)</script>", page, flags=re.S)
    return [json.loads(b) for b in blocks]


@pytest.fixture(scope="module")
def report():
    return make_report()


@pytest.fixture(scope="module")
def page(report):
    return render_html(report)


def test_every_section_has_an_id_a_toc_entry_and_a_figure_where_it_plots(page):
    toc = page[page.index("<nav id='toc'>") : page.index("</nav>")]
    for section in SECTIONS:
        assert f"<section id='{section.id}'>" in page, section.id
        assert f"<a href='#{section.id}'>" in toc, section.id
    ids = re.findall(r"\bid='([^']+)'", page)
    assert len(ids) == len(set(ids))
    assert page.count("<img ") == page.count("data:image/png;base64,")
    # a figure in every section but the methods table and the token view (drawn by its script)
    for section in SECTIONS:
        inner = page.split(f"<section id='{section.id}'>", 1)[1].split("</section>", 1)[0]
        assert ("<img " in inner) == (section.id not in ("baselines", "token_view")), section.id


def test_page_is_self_contained(page):
    for external in ('src="http', "src='http", 'href="http', "href='http", "<link", "@import", "<script src"):
        assert external not in page
    assert page.count("<script>") == 1  # the token view's own script, inlined


def test_corpus_text_is_escaped_everywhere(page):
    for text in HOSTILE[:2]:
        assert text not in page
    assert "&lt;b&gt;model&lt;/b&gt;" in page and "<b>model</b>" not in page
    assert "&lt;c&gt;.txt" in page
    # the data block: nothing can close it or open a comment, and it decodes to the corpus tokens
    (block,) = re.findall(r"<script type='application/json'[^>]*>(.*?)</script>", page, flags=re.S)
    assert "<" not in block and ">" not in block and "&" not in block
    (payload,) = embedded_payloads(page)
    tokens = {t[0] for text in payload["texts"] for t in text["tokens"]}
    tokens |= {t[3] for text in payload["texts"] for t in text["tokens"]}
    assert set(HOSTILE) <= tokens


def test_token_view_payload_rounds_caps_and_checks(report):
    payload = token_view_payload(report)
    first = report["token_view"]["texts"][0]
    text, selected, dense, predicted = payload["texts"][0]["tokens"][0]
    assert text == first["tokens"][0] and selected == first["selected"][0]
    assert predicted == first["predicted"][0]
    assert dense == np.rint(np.asarray(first["probs"][0]) * payload["scale"]).astype(int).tolist()
    n_all = sum(len(t["tokens"]) for t in report["token_view"]["texts"])
    assert payload["n_tokens"] == n_all
    capped = token_view_payload(report, max_values=7 * L * E)
    assert capped["n_tokens"] == 7 == sum(len(t["tokens"]) for t in capped["texts"])
    assert capped["texts"][0]["tokens"] == payload["texts"][0]["tokens"][:5]  # corpus order kept
    bad = json.loads(json.dumps(report))
    bad["token_view"]["texts"][1]["probs"][0] = [[0.5, 0.5]] * L
    with pytest.raises(ValueError, match=r"text 1: .*probs \[T, 3, 6\]"):
        token_view_payload(bad)
    bad = json.loads(json.dumps(report))
    bad["token_view"]["texts"][0]["selected"][2][1] = [0, E]
    with pytest.raises(ValueError, match="text 0: expert ids outside"):
        token_view_payload(bad)
    assert token_view_payload({**report, "token_view": {"texts": []}}) is None


@pytest.mark.slow
def test_a_report_without_token_view_has_no_script(report):
    rep = {k: v for k, v in report.items() if k != "token_view"}
    page = render_html(rep)
    assert "<script" not in page and "id='token_view'" not in page and "href='#token_view'" not in page


def compare_report(a: dict, b: dict, labels=("<first>", "second")) -> dict:
    """Model A's report with model B's under ``compare`` (the schema of ``moee report --compare``)."""
    diff = [
        {"layer": i, "cv_load": 0.01 * i, "routing_entropy_normalized": -0.02, "domain_jsd": None}
        for i in range(L)
    ]
    overlap = [
        {"layer": i, "top1": 0.5, "topk": 0.6, "top1_permutation": 0.2, "topk_permutation": 0.35}
        for i in range(L)
    ]
    return {
        **a,
        "compare": {
            "labels": list(labels),
            "b": {k: v for k, v in b.items() if k != "meta"},
            "same_shape": True,
            "differences": {"by_layer": diff},
            "selection_overlap": {
                "available": True,
                "reason": None,
                "by_layer": overlap,
                "random_baseline": {"top1": 1 / E, "topk": K / E},
            },
        },
    }


@pytest.mark.slow
def test_compare_page_has_both_reports_in_columns_with_unique_ids():
    a, b = make_report(seed=0, model="model-a"), make_report(n_texts=4, seed=1, model="model-b")
    page = render_html(compare_report(a, b))
    for section in SECTIONS:
        assert page.count(f"<section id='{section.id}'>") == 1
    assert page.count("<div class='cols'>") == len(SECTIONS)
    assert "<section id='compare'>" in page and "href='#compare'" in page
    assert "&lt;first&gt;" in page and "<first>" not in page
    ids = re.findall(r"\bid='([^']+)'", page)
    assert len(ids) == len(set(ids))
    first, second = embedded_payloads(page)
    assert first["n_tokens"] == sum(len(t["tokens"]) for t in a["token_view"]["texts"])
    assert second["n_tokens"] == sum(len(t["tokens"]) for t in b["token_view"]["texts"])
    bad = compare_report(a, b)
    del bad["compare"]["b"]
    with pytest.raises(ValueError, match="model B's report under 'b'"):
        render_html(bad)


def test_page_assets_ship_with_the_package():
    """A non-editable install must carry the inlined CSS/JS (setuptools package-data)."""
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    config = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert "analysis/specialization/page_assets/*" in config["tool"]["setuptools"]["package-data"]["moee"]
    assert any(dep.startswith("playwright") for dep in config["project"]["optional-dependencies"]["dev"])


def _byte_level_bpe():
    """A byte-level BPE (the GPT-2 / Llama-3 / SmolLM2 kind) trained here on a few sentences."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["the national executive of the strike met", "naïve café über straße", "executive orders"] * 20
    tok.train_from_iterator(
        corpus, trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok)


@pytest.mark.parametrize("kind", ["wordpiece", "byte_level_bpe"])
def test_the_token_view_shows_word_boundaries_as_the_tokenizer_marks_them(kind):
    """Token by token, the view reads as the text: WordPiece words are not glued together
    ("thenationalexecutive"), and byte-level BPE shows no half characters (an emoji is 4 byte
    tokens here) nor its markers."""
    from transformers import AutoTokenizer

    from moee.analysis.specialization.report import _decoder
    from moee.analysis.specialization.sections.token_view import surface_pieces
    from moee.models.bundled import bundled

    if kind == "wordpiece":
        tokenizer, text = (
            AutoTokenizer.from_pretrained(bundled("minilm-moe").config_dir),
            "the national executive met",
        )
    else:
        tokenizer, text = _byte_level_bpe(), "the national executive met \U0001f642 naïve"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    decode = _decoder(tokenizer)
    pieces = surface_pieces(decode, ids)
    assert len(pieces) == len(ids) and "".join(pieces) == decode(ids) == text
    assert sum(p.startswith(" ") for p in pieces) == text.count(" "), (
        pieces
    )  # each word starts with its space
    assert not any("Ġ" in p or "##" in p or "\ufffd" in p for p in pieces), pieces
    alone = "".join(decode([i]) for i in ids)  # one token at a time: glued words or broken bytes
    assert alone != text
