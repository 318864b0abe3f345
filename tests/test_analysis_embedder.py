"""Analyses end to end through the real MoEEmbedder on a tiny randomly initialised OLMoE."""

import base64
import json
from html.parser import HTMLParser

import numpy as np
import pytest

pytest.importorskip("tokenizers")
torch = pytest.importorskip("torch")

from moee.analysis.overlap import clustering_overlap  # noqa: E402
from moee.analysis.specialization import REPORT_SECTIONS, ReportOptions, build_report, write_report  # noqa: E402
from moee.analysis.stability import plot_stability_heatmap, prompt_stability  # noqa: E402
from moee.cli import main  # noqa: E402

TOPICS = ["the river runs past the old mill", "stocks fell as markets closed", "the choir sang a quiet hymn"]
CORPUS = [
    f"{TOPICS[i % 3]} on day {i} while {['rain', 'sun', 'wind', 'snow'][i % 4]} fell" for i in range(20)
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from moee.capture.tiny import tiny_model
    from moee.embed.embedder import MoEEmbedder

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        CORPUS + ["this sentence means in one word describe"],
        trainers.WordLevelTrainer(special_tokens=["[PAD]", "[UNK]", "[BOS]"]),
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", bos_token="[BOS]"
    )
    model = tiny_model(
        "olmoe",
        n_layers=3,
        vocab_size=fast.vocab_size,
        hidden_size=32,
        intermediate_size=16,
        num_key_value_heads=4,
        max_position_embeddings=128,
        eos_token_id=2,
    )
    path = tmp_path_factory.mktemp("tiny-olmoe-report")  # conftest's folder is tiny-olmoe0
    model.save_pretrained(path)
    fast.save_pretrained(path)
    return MoEEmbedder(model, fast), path


class _Collect(HTMLParser):
    def __init__(self):
        super().__init__()
        self.ids, self.imgs, self.stack = set(), [], []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if "id" in attrs:
            self.ids.add(attrs["id"])
        if tag == "img":
            self.imgs.append(attrs["src"])


@pytest.mark.slow
def test_report_on_a_tiny_olmoe_and_a_20_line_corpus(tiny, tmp_path):
    embedder, _ = tiny
    corpus = [(t, f"topic{i % 3}") for i, t in enumerate(CORPUS)]
    report = build_report(
        embedder, corpus, batch_size=4, progress=False, options=ReportOptions(min_token_count=2)
    )
    report["meta"] = {"command": "test"}
    paths = write_report(report, tmp_path)
    saved = json.loads(paths["json"].read_text())
    assert set(REPORT_SECTIONS) <= set(saved)
    s = saved["summary"]
    assert (s["n_texts"], s["n_layers"], s["n_experts"], s["top_k"]) == (20, 3, 8, 2)
    assert s["top_k_source"] == "config.num_experts_per_tok"
    n_tokens = sum(len(embedder.tokenizer(t)["input_ids"]) for t in CORPUS)
    assert s["n_tokens"] == n_tokens
    for layer in saved["layers"]:
        assert sum(layer["load_fraction"]) == pytest.approx(1.0, abs=1e-4)
        assert sum(layer["importance_fraction"]) == pytest.approx(1.0, abs=1e-4)
    assert set(saved["domains"]["domains"]) == {"topic0", "topic1", "topic2"}
    assert len(saved["experts"]) == 3 and len(saved["experts"][0]) == 8
    context_tokens = [c["token"] for row in saved["experts"] for e in row for c in e["top_contexts"]]
    assert context_tokens and all(isinstance(t, str) and t for t in context_tokens)
    parser = _Collect()
    parser.feed(paths["html"].read_text())
    assert set(REPORT_SECTIONS[1:]) <= parser.ids
    assert len(parser.imgs) >= 5
    for src in parser.imgs:
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1])[:4] == b"\x89PNG"


@pytest.mark.slow
def test_cli_report_with_domain_field(tiny, tmp_path, capsys):
    _, model_dir = tiny
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(
        "".join(json.dumps({"text": t, "source": f"s{i % 2}"}) + "\n" for i, t in enumerate(CORPUS))
    )
    out = tmp_path / "out"
    rc = main(
        ["report", "--model", str(model_dir), "--corpus", str(corpus), "--domain-field", "source",
         "--device", "cpu", "--out", str(out)]
    )  # fmt: skip
    assert rc == 0
    saved = json.loads((out / "report.json").read_text())
    assert set(saved["domains"]["domains"]) == {"s0", "s1"}
    assert saved["meta"]["domain_field"] == "source" and "report" in saved["meta"]["command"]
    assert (out / "report.html").stat().st_size > 10_000
    assert "wrote" in capsys.readouterr().out
    assert (
        main(["report", "--model", str(model_dir), "--corpus", str(tmp_path / "nope.txt"), "--out", str(out)])
        == 2
    )


def test_prompt_stability_on_tiny_model(tiny, tmp_path):
    embedder, _ = tiny
    pairs = [
        (CORPUS[i], CORPUS[j]) for i, j in [(0, 3), (1, 4), (2, 5), (0, 1), (6, 7), (8, 12), (9, 10), (3, 3)]
    ]
    prompts = {
        "meaning": "This sentence: {text} means in one word:",
        "describe": "In one word, describe {text}:",
        "plain": "{text}",
    }
    gold = np.linspace(0, 1, len(pairs))
    out = prompt_stability(embedder, pairs, prompts=prompts, gold=gold, progress=False)
    assert out["n_pairs"] == 8 and out["n_texts"] == 12
    rho = np.asarray(out["spearman"])
    assert rho.shape == (6, 6)
    np.testing.assert_allclose(np.diag(rho), 1.0)
    assert out["names"][:3] == ["hs:meaning", "hs:describe", "hs:plain"]
    hs_block = rho[:3, :3][np.triu_indices(3, 1)]
    assert out["summary"]["hs_hs"] == pytest.approx(hs_block.mean())
    assert out["summary"]["rw_hs"] == pytest.approx(rho[3:, :3].mean())
    assert set(out["gold"]) == set(out["names"])
    plot_stability_heatmap(out, tmp_path / "h.png")
    assert (tmp_path / "h.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="gold"):
        prompt_stability(embedder, pairs, prompts=prompts, gold=gold[:3], progress=False)


def test_clustering_overlap_on_traced_embeddings(tiny):
    embedder, _ = tiny
    trace = embedder.trace(CORPUS)
    labels = [i % 3 for i in range(len(CORPUS))]
    out = clustering_overlap(trace.rw, trace.hs, 3, labels=labels)
    for key in ("rw_vs_hs", "rw_vs_hs_chance", "rw_vs_gold", "hs_vs_gold"):
        assert set(out[key]) == {"ami", "nmi", "jaccard", "exact_match"}
        assert all(np.isfinite(v) for v in out[key].values())
