"""The mteb adapter with a real MoEEmbedder over a tiny random OLMoE, end to end through mteb."""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import replace

import mteb
import numpy as np
import pytest
from mteb.models import EncoderProtocol
from scipy.stats import spearmanr

from moee.capture.tiny import tiny_model, tiny_tokenizer
from moee.cli import main as cli_main
from moee.data.offline_tasks import load_task_data
from moee.embed.embedder import MoEEmbedder
from moee.embed.methods import DEFAULT_SCORE
from moee.evaluation.adapter import MoEEMTEBEncoder, TraceCache, model_identity
from moee.evaluation.alpha import pair_similarities
from moee.evaluation.runner import EvalSettings, run_evaluation
from moee.evaluation.tasks import offline_tasks

N_VOCAB_WORDS = 400


def _vocabulary() -> list[str]:
    """The most frequent lower-cased words of two offline tasks (deterministic)."""
    counts: Counter[str] = Counter()
    for name, key in (("lee_sts", "sentence1"), ("fortunes_classification", "text")):
        for row in load_task_data(name)["test"]:
            counts.update(re.findall(r"\w+|[^\w\s]", row[key].lower()))
    return [w for w, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:N_VOCAB_WORDS]]


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1, "[BOS]": 2, "[EOS]": 3}
    for word in _vocabulary() + ['"', ":"]:
        vocab.setdefault(word, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.normalizer = normalizers.Lowercase()
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]", bos_token="[BOS]", eos_token="[EOS]"
    )


def _tiny_olmoe(vocab_size: int, seed: int):
    return tiny_model(
        "olmoe", n_layers=2, seed=seed, vocab_size=vocab_size, intermediate_size=32, num_key_value_heads=4
    )


@pytest.fixture(scope="module")
def embedder(tokenizer):
    return MoEEmbedder(_tiny_olmoe(len(tokenizer), seed=0), tokenizer, name_or_path="tiny-olmoe")


TEXTS = ["The cat sat on the mat.", "Stocks fell sharply today", "", 'He said "no" twice.', "The cat sat."]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["olmoe", "qwen2_moe"])
def test_mteb_meta_is_zero_shot_and_counts_the_active_parameters(arch):
    """Training-free: zero-shot on every task (an empty training set, not the unknown ``None``); an
    MoE model's active parameters are all of them less the idle routed experts of each MoE layer
    (Qwen2-MoE's shared expert always runs, so it stays in)."""
    from moee.capture import find_routers

    model = tiny_model(arch, n_layers=2)
    meta = MoEEMTEBEncoder(MoEEmbedder(model, tiny_tokenizer()), config={"method": "hs"}).mteb_model_meta
    assert meta.training_datasets == set() and meta.is_zero_shot_on(["STS12", "Banking77Classification"])
    c = model.config
    width = c.moe_intermediate_size if arch == "qwen2_moe" else c.intermediate_size
    per_expert = 3 * c.hidden_size * width  # gate, up and down projections
    idle = len(find_routers(model)) * (c.num_experts - c.num_experts_per_tok) * per_expert
    assert meta.n_parameters == sum(p.numel() for p in model.parameters())
    assert meta.n_active_parameters_override == meta.n_parameters - idle > 0


def test_adapter_satisfies_the_encoder_protocol(embedder):
    enc = MoEEMTEBEncoder(embedder, config={"method": "moee_sum", "prompt": "prompteol", "alpha": 0.5})
    assert isinstance(enc, EncoderProtocol)
    meta = enc.mteb_model_meta
    assert meta.name == "moee/tiny-olmoe" and meta.similarity_fn_name.value == "cosine"
    assert meta.embed_dim == embedder.hidden_size + embedder.n_moe_layers * embedder.n_experts
    assert dict(meta.experiment_kwargs) == {
        "method": "moee_sum",
        "pooling": "last",
        "prompt": "prompteol",
        "score": DEFAULT_SCORE,
        "alpha": 0.5,
    }


def test_cache_paths_never_collide(embedder, tokenizer, tmp_path):
    cache = mteb.ResultCache(tmp_path)
    paths = {}
    for method in ("hs", "rw", "moee_concat", "moee_sum"):
        for prompt in (None, "prompteol"):
            for pooling in ("last", "mean"):
                for score in ("softmax", "logits"):
                    for alpha in (0.5, 1.0, "auto"):
                        config = dict(method=method, prompt=prompt, pooling=pooling, score=score, alpha=alpha)
                        enc = MoEEMTEBEncoder(embedder, config=config)
                        path = cache.get_task_result_path("lee_sts", enc.mteb_model_meta)
                        paths.setdefault(path, set()).add((method, prompt, pooling, score, alpha))
    # one folder per configuration; alpha only separates MoEE(sum) configurations
    assert len(paths) == 3 * 2 * 2 * 2 + 3 * 2 * 2 * 2
    for configs in paths.values():
        assert len({c[:4] for c in configs}) == 1
    other = MoEEmbedder(_tiny_olmoe(len(tokenizer), seed=1), tokenizer, name_or_path="tiny-olmoe")
    assert model_identity(other)[1] != model_identity(embedder)[1]  # other weights, other revision


@pytest.mark.parametrize("prompt", [None, "prompteol"])
@pytest.mark.parametrize("method", ["hs", "rw", "moee_concat", "moee_sum"])
def test_adapter_matches_embedder_encode(embedder, method, prompt):
    enc = MoEEMTEBEncoder(embedder, config={"method": method, "prompt": prompt, "alpha": 0.7})
    got = enc.embed_texts(TEXTS, task_name="any")
    want = embedder.encode(TEXTS, method=method, prompt=prompt, alpha=0.7)
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_trace_cache_one_forward_per_distinct_text(embedder):
    cache = TraceCache(embedder, prompt="prompteol")
    encoders = [
        MoEEMTEBEncoder(embedder, config={"method": m, "prompt": "prompteol"}, trace_cache=cache)
        for m in ("hs", "rw")
    ]
    encoders[0].embed_texts(TEXTS + TEXTS)
    encoders[1].embed_texts(TEXTS[:2])
    assert cache.forward_texts == len(TEXTS) == len(cache)
    with pytest.raises(ValueError, match="belongs to another"):
        MoEEMTEBEncoder(embedder, config={"method": "hs", "prompt": None}, trace_cache=cache)


def test_bad_configuration_is_rejected(embedder):
    with pytest.raises(ValueError, match="unknown method"):
        MoEEMTEBEncoder(embedder, config={"method": "cls"})
    with pytest.raises(ValueError, match="unknown prompt|template"):
        MoEEMTEBEncoder(embedder, config={"prompt": "promptEOL"})
    with pytest.raises(ValueError, match="alpha must be"):
        MoEEMTEBEncoder(embedder, config={"alpha": "best"})
    enc = MoEEMTEBEncoder(embedder, config={"alpha": "auto"})
    with pytest.raises(ValueError, match="no weight was chosen for task 'lee_sts'"):
        enc.embed_texts(["a"], task_name="lee_sts")


@pytest.mark.slow
def test_offline_sts_task_end_to_end(embedder, tmp_path):
    """lee_sts through mteb.evaluate; the cached score equals the similarity sum's Spearman."""
    (task,) = offline_tasks(["lee_sts"])
    alpha = 0.5
    enc = MoEEMTEBEncoder(embedder, config={"method": "moee_sum", "alpha": alpha})
    cache = mteb.ResultCache(tmp_path)
    result = mteb.evaluate(enc, [task], cache=cache, show_progress_bar=False, co2_tracker=False)
    score = result.task_results[0].get_score()
    assert cache.get_task_result_path("lee_sts", enc.mteb_model_meta).is_file()

    rows = load_task_data("lee_sts")["test"]
    texts = list(dict.fromkeys([r["sentence1"] for r in rows] + [r["sentence2"] for r in rows]))
    idx = {t: i for i, t in enumerate(texts)}
    hs, rw = TraceCache(embedder).get(texts)
    c_h, c_r = pair_similarities(
        hs, rw, np.array([idx[r["sentence1"]] for r in rows]), np.array([idx[r["sentence2"]] for r in rows])
    )
    expected = spearmanr([r["score"] for r in rows], (c_h + alpha * c_r) / (1 + alpha))[0]
    assert score == pytest.approx(expected, abs=1e-6)
    assert enc.trace_cache.forward_texts == 50  # 1,225 pairs of 50 documents: 50 forward passes


@pytest.mark.slow
def test_offline_classification_task_end_to_end(embedder, tmp_path):
    (task,) = offline_tasks(["fortunes_classification"])
    enc = MoEEMTEBEncoder(embedder, config={"method": "moee_concat", "prompt": "prompteol"})
    result = mteb.evaluate(
        enc, [task], cache=mteb.ResultCache(tmp_path), show_progress_bar=False, co2_tracker=False
    )
    scores = result.task_results[0].scores["test"][0]
    assert 0.0 <= scores["accuracy"] <= 1.0 and scores["main_score"] == scores["accuracy"]
    assert len(scores["scores_per_experiment"]) == 10


@pytest.mark.slow
@pytest.mark.parametrize("method", ["rw", "moee_sum"])
def test_offline_pair_task_scores_the_similarity_the_method_defines(embedder, tmp_path, method):
    """The pair task's score is the AP of the cosine (for MoEE sum: the similarity sum), never the
    best of cosine / Manhattan / Euclidean / dot that mteb's max_ap picks on the test labels."""
    from sklearn.metrics import average_precision_score

    (task,) = offline_tasks(["bible_pair_classification_quick"])
    enc = MoEEMTEBEncoder(embedder, config={"method": method, "alpha": 0.5})
    assert enc.mteb_model_meta.similarity_fn_name == "cosine"
    result = mteb.evaluate(
        enc, [task], cache=mteb.ResultCache(tmp_path), show_progress_bar=False, co2_tracker=False
    )
    scores = result.task_results[0].scores["test"][0]
    task.load_data()
    rows = task.dataset["default"]["test"]
    a = enc.embed_texts(list(rows["sentence1"]), task_name=task.metadata.name)
    b = enc.embed_texts(list(rows["sentence2"]), task_name=task.metadata.name)
    cosine = np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    if method == "moee_sum":  # the cosine of the emitted vector is the paper's similarity sum
        hs, rw = enc.trace_cache.get(list(rows["sentence1"]) + list(rows["sentence2"]))
        n = len(rows)
        c_h, c_r = pair_similarities(hs, rw, np.arange(n), np.arange(n, 2 * n))
        np.testing.assert_allclose(cosine, (c_h + 0.5 * c_r) / 1.5, atol=1e-5)
    expected = average_precision_score(list(rows["labels"]), cosine)
    # mteb takes the cosine in torch, this test in numpy: RW cosines of near-identical verse pairs agree
    # to ~1e-7, and the order of such near-ties follows the summation order (thread count, kernels),
    # which moves the AP by up to ~4e-5; max_ap picking another similarity moves it far more
    assert scores["main_score"] == pytest.approx(expected, abs=2e-4)
    assert scores["main_score"] == pytest.approx(scores["cosine_ap"], abs=2e-4)  # the same near-ties
    assert task.metadata.main_score == "similarity_ap"


@pytest.mark.slow
def test_run_evaluation_auto_alpha_tables_and_resume(embedder, tmp_path):
    settings = EvalSettings(
        methods=("hs", "moee_sum"),
        prompts=(None,),
        config={"alpha": "auto"},
        tasks="lee_sts,fortunes_clustering",
        out=tmp_path,
        baseline=False,
        command="test",
    )
    summary = run_evaluation(settings, embedder=embedder, log=lambda m: None)
    doc = json.loads(summary["tables_json"].read_text())
    assert [r["label"] for r in doc["systems"]] == ["HS", "MoEE sum (alpha=auto)"]
    for row in doc["systems"]:
        assert set(row["tasks"]) == {"lee_sts", "fortunes_clustering"}
        assert row["avg"] == pytest.approx(
            (row["tasks"]["lee_sts"] + row["tasks"]["fortunes_clustering"]) / 2
        )
    (key, by_prompt), *others = json.loads(summary["alpha_choices"].read_text()).items()
    assert (
        not others
        and key == f"moee/tiny-olmoe@{model_identity(embedder)[1]} pooling=last score={DEFAULT_SCORE}"
    )
    choices = by_prompt["none"]
    assert doc["run"]["alpha_choices"]["none"]["lee_sts"] == choices["lee_sts"]["alpha"]
    assert set(choices) == {"lee_sts", "fortunes_clustering"} and choices["lee_sts"]["n_texts"] == 50
    assert doc["run"]["versions"]["mteb"] == mteb.__version__ and doc["run"]["command"] == "test"

    # a rerun finds every (configuration, task) and the alpha choices on disk: no forward pass
    calls = []
    original = embedder._trace  # every forward pass of features() and trace()

    def counting_trace(texts, *args, **kwargs):
        calls.append(len(texts))
        return original(texts, *args, **kwargs)

    timings = json.loads(summary["timings"].read_text())
    assert set(timings) == {
        f"{m}/none/{t}" for m in ("hs", "moee_sum") for t in ("lee_sts", "fortunes_clustering")
    }
    embedder._trace = counting_trace
    try:
        run_evaluation(settings, embedder=embedder, log=lambda m: None)
        assert calls == []
        # the cached cells keep the seconds measured when they ran
        assert json.loads(summary["timings"].read_text()) == timings
        settings = replace(
            settings, config={"alpha": 1.0}
        )  # a new MoEE(sum) configuration: only it is computed
        summary = run_evaluation(settings, embedder=embedder, log=lambda m: None)
        assert sum(calls) == 50 + 320  # each distinct text once
    finally:
        del embedder._trace
    labels = [r["label"] for r in json.loads(summary["tables_json"].read_text())["systems"]]
    assert labels == ["HS", "MoEE sum (alpha=1.0)", "MoEE sum (alpha=auto)"]


def test_cli_paper_suite_offline_fails_with_a_clear_message(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    code = cli_main(["evaluate", "--tasks", "paper", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2
    assert "moee evaluate: error: could not load the data of these tasks" in err
    assert "STS12" in err and "Traceback" not in err


@pytest.mark.slow
def test_quickstart_end_to_end_with_a_saved_tiny_model(embedder, tmp_path, capsys, monkeypatch):
    """`moee quickstart` on a saved tiny model: embeddings, quick suite, tables, report, paths, all
    under the model's saved configuration."""
    from moee.embed.config import EmbeddingConfig

    model_dir = tmp_path / "tiny-model"
    own = MoEEmbedder(
        embedder.model, embedder.tokenizer, model_config=EmbeddingConfig(pooling="mean", prompt="prompteol")
    )
    own.save_pretrained(model_dir)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    forwards: dict[tuple, list[str]] = {}  # feature configuration -> every text the model ran on
    features = MoEEmbedder.features

    def counting(self, texts, config, **kwargs):
        forwards.setdefault(config.feature_key(), []).extend(texts)
        return features(self, texts, config, **kwargs)

    monkeypatch.setattr(MoEEmbedder, "features", counting)
    out = tmp_path / "qs"
    code = cli_main(
        ["quickstart", "--model", str(model_dir), "--out", str(out), "--no-baseline", "--device", "cpu"]
    )
    printed = capsys.readouterr().out
    assert code == 0
    # two configurations (the model's, the paper's), each text through the model once under each
    own_key = EmbeddingConfig(pooling="mean", prompt="prompteol").feature_key()
    paper_key = EmbeddingConfig.paper().feature_key()
    assert set(forwards) == {own_key, paper_key}
    for texts in forwards.values():
        assert len(texts) == len(set(texts)) > 100
    assert set(forwards[own_key]) == set(forwards[paper_key])
    for method in ("hs", "rw", "moee_concat", "moee_sum"):
        vectors = np.load(out / "embeddings" / f"{method}.npy")
        sidecar = json.loads((out / "embeddings" / f"{method}.npy.json").read_text())
        assert vectors.shape[0] == len(json.loads((out / "embeddings" / "texts.json").read_text())["rows"])
        assert sidecar["method"] == method and sidecar["prompt"] == "prompteol"
        assert sidecar["pooling"] == "mean"
    doc = json.loads((out / "mteb" / "tables.json").read_text())
    assert len(doc["systems"]) == 5 and {t["family"] for t in doc["tasks"]} == {
        "STS",
        "Classification",
        "Clustering",
        "PairClassification",
        "Retrieval",
    }
    assert (out / "report" / "report.html").is_file()
    report = json.loads((out / "report" / "report.json").read_text())
    worst = max(report["layers"], key=lambda layer: layer["max_over_mean_load"])["layer"]
    assert f"(layer {worst})" in printed and "small sample" in printed  # the imbalance is read in context
    rows = printed.replace("moee/tiny-model | ", "")
    assert "| MoEE sum + PromptEOL (alpha=auto, pooling=mean) |" in rows  # the model's configuration
    assert "| MoEE sum + PromptEOL (alpha=auto, score=softmax) |" in rows  # the paper's, beside it
    assert (
        doc["run"]["extra_cells"][0]["pooling"] == "last"
        and doc["run"]["extra_cells"][0]["score"] == "softmax"
    )
    assert str(out / "mteb" / "tables.md") in printed and "quickstart finished" in printed


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--methods", "hs,cls"], "unknown method 'cls'"),
        (["--alpha", "-1"], "alpha must be >= 0"),
        (["--prompts", "none,promptEOL"], "promptEOL"),
        (["--tasks", "nope"], "unknown task 'nope'"),
    ],
)
def test_cli_rejects_bad_arguments_before_any_work(flags, message, tmp_path, capsys):
    code = cli_main(["evaluate", "--out", str(tmp_path), *flags])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err
