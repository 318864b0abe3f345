"""The report's added analyses on routes with known answers: token specialization three ways,
router entropy / KL, cross-layer pairs, domain JSD, co-activation baselines, selection overlap
(saturation / comparison), the predicted-token hook, the token view and the CLI end to end."""

import json

import numpy as np
import pytest

from moee.analysis.specialization import BaselineDraws, SpecializationAccumulator
from moee.analysis.specialization.sections.cross_layer import _transition_stats
from moee.analysis.specialization.sections.domains import _generalized_jsd
from moee.analysis.specialization.sections.token_specialization import _token_specialization_stats
from moee.analysis.specialization.statistics import _overlap


def one_hot(experts, E):
    """Dense probabilities ``[T, L, E]`` putting 0.9 on each listed expert (first choice)."""
    experts = np.asarray(experts)
    p = np.full((*experts.shape, E), 0.1 / (E - 1))
    np.put_along_axis(p, experts[..., None], 0.9, axis=2)
    return p


def decode(ids):
    return " ".join(f"w{i}" for i in ids)


# ----------------------------------------------------------------- token specialization
def test_next_token_routing_is_found_by_the_next_key_only():
    """Layer 0 routes each position to the expert of the NEXT token (expert = next id mod 2): the
    next-token key is perfectly specialised (1.0); the input key is not; predicted = the given ids."""
    ids = np.array([0, 1, 0, 0, 1, 1, 0, 1, 0, 0, 1, 1] * 4)
    nxt = np.append(ids[1:], 0)
    acc = SpecializationAccumulator(1, 2, 1, draws=BaselineDraws(permutations=20))
    acc.update(ids, one_hot(nxt[:, None] % 2, 2), text_index=0, predicted=nxt)
    ts = acc.result(decode, min_token_count=2)["token_specialization"]
    assert ts["keys"] == ["input", "next", "predicted"] and ts["random_baseline"] == 0.5
    nxt_layer = ts["by_key"]["next"]["by_layer"][0]
    assert nxt_layer["weighted_max_fraction"] == pytest.approx(1.0)
    assert ts["by_key"]["next"]["n_tokens"] == ids.size - 1  # the last position has no next token
    assert ts["by_key"]["input"]["by_layer"][0]["weighted_max_fraction"] < 0.8
    # the predicted key got the true next ids except the padded last one: nearly perfect
    assert ts["by_key"]["predicted"]["by_layer"][0]["weighted_max_fraction"] > 0.95
    assert nxt_layer["weighted_max_fraction_baseline"] < 0.8  # shuffled routes lose it
    top = ts["by_key"]["next"]["experts"][0][1]["top"]
    assert top[0]["token_id"] == 1 and top[0]["fraction"] == 1.0  # expert 1 takes every "next = w1"


def test_predicted_key_is_unavailable_without_predictions():
    acc = SpecializationAccumulator(1, 2, 1, draws=BaselineDraws(permutations=2))
    acc.update(np.array([1, 2, 1]), one_hot([[0], [1], [0]], 2), text_index=0)
    pred = acc.result(decode, min_token_count=1)["token_specialization"]["by_key"]["predicted"]
    assert pred["available"] is False and pred["reason"]
    assert pred["by_layer"][0]["weighted_max_fraction"] is None


def test_expert_specialization_is_the_mean_of_its_top_n_fractions_with_missing_as_zero():
    # one layer, 3 experts; token types of sizes 4, 2; counts per expert
    counts = np.array([[[4, 0, 0]], [[1, 1, 0]]])  # type 0 all to e0; type 1 split e0 / e1
    sizes = np.array([4, 2])
    weighted, spec = _token_specialization_stats(iter([(0, 2, counts)]), sizes, n_top=2)
    assert weighted[0] == pytest.approx((4 * 1.0 + 2 * 0.5) / 6)
    np.testing.assert_allclose(spec[0], [(1.0 + 0.5) / 2, (0.5 + 0.0) / 2, 0.0])
    # fewer types than n_top: the missing slots count 0 (sum / n_top, not the mean of what exists)
    _, spec = _token_specialization_stats(iter([(0, 2, counts)]), sizes, n_top=4)
    np.testing.assert_allclose(spec[0], [(1.0 + 0.5) / 4, 0.5 / 4, 0.0])
    # blocks merge: the same answer when the types arrive in two blocks
    _, split = _token_specialization_stats(iter([(0, 1, counts[:1]), (1, 2, counts[1:])]), sizes, n_top=4)
    np.testing.assert_allclose(split, spec)


def test_token_specialization_baseline_is_the_exact_permutation_expectation():
    """w5 w5 w6 w6 routed e0 e0 e1 e1: shuffled, each type keeps both of one expert in 2 of 6
    arrangements, so E[weighted max] = 2/3 (the known vocabulary answer), for the input key."""
    acc = SpecializationAccumulator(1, 2, 1, draws=BaselineDraws(permutations=2000, seed=3))
    acc.update(np.array([5, 5, 6, 6]), one_hot([[0], [0], [1], [1]], 2), text_index=0)
    layer = acc.result(decode, min_token_count=1)["token_specialization"]["by_key"]["input"]["by_layer"][0]
    assert layer["weighted_max_fraction"] == pytest.approx(1.0)
    assert layer["weighted_max_fraction_baseline"] == pytest.approx(2 / 3, abs=0.02)


# ----------------------------------------------------------------- router entropy
def test_router_entropy_and_kl_on_known_distributions():
    p = np.array([[[0.6, 0.2, 0.1, 0.1]], [[0.25, 0.25, 0.25, 0.25]]])  # T=2, L=1, E=4
    acc = SpecializationAccumulator(1, 4, 2, draws=BaselineDraws(permutations=1))
    acc.update(np.array([1, 2]), p, text_index=0, selected=np.array([[[0, 1]], [[2, 3]]]))
    ent = acc.result(decode, min_token_count=1)["router_entropy"]
    row = ent["by_layer"][0]
    h0 = -(p[0, 0] * np.log(p[0, 0])).sum()
    assert row["dense_entropy"] == pytest.approx((h0 + np.log(4)) / 2)
    assert row["dense_kl_uniform"] == pytest.approx(np.log(4) - (h0 + np.log(4)) / 2)
    # the selection renormalised: token 0 weighs its picks 0.75 / 0.25, token 1 equally
    w = np.array([0.75, 0.25])
    sel_h = (-(w * np.log(w)).sum() + np.log(2)) / 2
    assert row["selection_entropy"] == pytest.approx(sel_h)
    assert row["selection_kl_uniform"] == pytest.approx(np.log(2) - sel_h)
    assert row["load_kl_uniform"] == pytest.approx(0.0, abs=1e-12)  # every expert once
    assert ent["baseline"]["dense_entropy"] == pytest.approx(np.log(4))


# ----------------------------------------------------------------- cross-layer pairs
def test_cross_layer_pairs_find_a_deterministic_successor():
    """Layer 1's expert is (layer 0's + 1) mod 4 on every token: each such pair has lift E = 4."""
    rng = np.random.default_rng(0)
    e0 = rng.permutation(np.arange(400) % 4)  # equal loads: lift exactly N / load = 4
    acc = SpecializationAccumulator(2, 4, 1, draws=BaselineDraws(permutations=5))
    acc.update(np.arange(400) % 7, one_hot(np.stack([e0, (e0 + 1) % 4], 1), 4), text_index=0)
    pair = acc.result(decode, min_token_count=1)["cross_layer"]["pairs"][0]
    assert pair["layers"] == [0, 1]
    assert pair["max_lift"] == pytest.approx(4.0)
    assert pair["excess"] == pytest.approx(0.75)  # TV of a permutation matrix vs uniform
    assert pair["excess_baseline"] < 0.1 and pair["max_lift_baseline"] < 1.6
    assert {(p["a"], (p["a"] + 1) % 4) == (p["a"], p["b"]) for p in pair["top_pairs"][:4]} == {True}


def test_cross_layer_excess_of_repeated_top2_sets_is_one_half():
    """k = 2: half the tokens select {0, 1} in both layers, half {2, 3}. C is N/2 on the 8 in-block
    cells, 0 elsewhere; X = N/4 everywhere: TV = 16 (N/4) / (2 N k^2) = 1/2."""
    sets = np.array([[0, 1], [2, 3]] * 50)
    sel = np.stack([sets, sets], axis=1)  # [N, L=2, k=2]
    acc = SpecializationAccumulator(2, 4, 2, draws=BaselineDraws(permutations=3))
    acc.update(np.arange(100) % 5, np.full((100, 2, 4), 0.25), text_index=0, selected=sel)
    pair = acc.result(decode, min_token_count=1)["cross_layer"]["pairs"][0]
    assert pair["excess"] == pytest.approx(0.5) and pair["max_lift"] == pytest.approx(2.0)
    assert pair["top_pairs"][0]["p_b_given_a"] == pytest.approx(1.0)


def test_transition_stats_of_an_independent_table_are_zero():
    joint = np.outer([10, 30], [20, 20]) // 40  # C = X exactly (N = 40 tokens, k = 1)
    st = _transition_stats(joint, n_tokens=40, k=1)
    assert st["excess"] == pytest.approx(0.0) and st["max_lift"] == pytest.approx(1.0)


# ----------------------------------------------------------------- domains, co-activation
def test_domain_jsd_known_values():
    assert _generalized_jsd(np.array([[1.0, 0.0], [0.0, 1.0]]), np.array([1, 1])) == pytest.approx(np.log(2))
    assert _generalized_jsd(np.array([[0.3, 0.7], [0.3, 0.7]]), np.array([2, 5])) == pytest.approx(0.0)
    # disjoint supports: the JSD is the entropy of the weights
    w = np.array([0.25, 0.75])
    assert _generalized_jsd(np.array([[1.0, 0.0], [0.0, 1.0]]), np.array([1, 3])) == pytest.approx(
        -(w * np.log(w)).sum()
    )
    # ten texts a domain (the null deals whole texts out to the domains; with one text each, any
    # dealing would give log 2 again)
    acc = SpecializationAccumulator(1, 2, 1, draws=BaselineDraws(permutations=50))
    for i in range(10):
        acc.update(np.arange(20), one_hot(np.zeros((20, 1), int), 2), text_index=2 * i, domain="a")
        acc.update(np.arange(20), one_hot(np.ones((20, 1), int), 2), text_index=2 * i + 1, domain="b")
    doms = acc.result(decode, min_token_count=1)["domains"]
    row = doms["specialization_by_layer"][0]
    assert doms["names"] == ["a", "b"]
    assert row["jsd"] == pytest.approx(np.log(2)) and row["jsd_baseline"] < 0.1
    acc = SpecializationAccumulator(1, 2, 1, draws=BaselineDraws(permutations=5))
    acc.update(np.arange(20), one_hot(np.zeros((20, 1), int), 2), text_index=0, domain="a")
    acc.update(np.arange(20), one_hot(np.ones((20, 1), int), 2), text_index=1, domain="b")
    row = acc.result(decode, min_token_count=1)["domains"]["specialization_by_layer"][0]
    assert row["jsd"] == pytest.approx(np.log(2)) and row["jsd_baseline"] == pytest.approx(np.log(2))


def test_coactivation_independent_baseline_matches_uniform_reference_on_equal_loads():
    E, k = 4, 2
    sel = np.array([[[a, b]] for a in range(E) for b in range(E) if a < b])  # every pair once
    acc = SpecializationAccumulator(1, E, k, draws=BaselineDraws(permutations=1))
    acc.update(np.arange(sel.shape[0]), np.full((sel.shape[0], 1, E), 1 / E), text_index=0, selected=sel)
    co = acc.result(decode, min_token_count=1)["coactivation"]
    assert co["by_layer"][0]["max_ratio_baseline"] == pytest.approx((k - 1) / (E - 1))
    assert co["by_layer"][0]["mean_lift"] == pytest.approx(1.0)
    assert len(co["top_experts"][0]) == E and np.shape(co["heatmaps"][0]) == (E, E)


# ----------------------------------------------------------------- selection overlap
def test_overlap_known_answers():
    ref = np.array([[[0, 1]], [[2, 3]]])  # N=2, L=1, k=2
    first = ref[:, :, 0]
    top1, topk, top1_null, topk_null = _overlap(ref, ref, first, first)
    assert top1[0] == 1.0 and topk[0] == 1.0
    other = np.array([[[0, 2]], [[1, 3]]])
    assert top1_null[0] == pytest.approx(0.5)  # first choices 0, 2 against themselves
    top1, topk, top1_null, topk_null = _overlap(ref, other, first, other[:, :, 0])
    assert top1[0] == 0.5 and topk[0] == pytest.approx(0.5)  # {0} and {3} shared
    # null: product of marginals; every expert in half the sets of both: sum_e (1/2)(1/2) / k
    assert topk_null[0] == pytest.approx(4 * 0.25 / 2)
    assert top1_null[0] == pytest.approx(0.25)  # ref first choices {0, 2}, other's {0, 1}: only 0 shared


# ----------------------------------------------------------------- with a model
@pytest.fixture(scope="module")
def tiny():
    pytest.importorskip("torch")
    from moee.capture.tiny import tiny_model, tiny_tokenizer
    from moee.embed.embedder import MoEEmbedder

    return MoEEmbedder(tiny_model("olmoe", n_layers=2), tiny_tokenizer())


TEXTS = ["the cat sat on the mat", "a dog ran up the hill and the cat", "old river and quiet mill"]


def test_predicted_tokens_are_the_lm_argmax_of_the_same_forward(tiny):
    import torch

    from moee.analysis.specialization import ReportOptions, build_report, lm_head

    assert lm_head(tiny.model, tiny._backbone) is tiny.model.lm_head
    assert lm_head(tiny._backbone, tiny._backbone.layers[0]) is None  # no output embedding
    options = ReportOptions(min_token_count=1, token_view_texts=2, token_view_tokens=9)
    rep = build_report(tiny, TEXTS, progress=False, options=options)
    view = rep["token_view"]
    assert view["n_texts"] == 2 and view["n_tokens"] == 9
    first = view["texts"][0]
    ids = tiny.tokenizer(TEXTS[0])["input_ids"]
    with torch.no_grad():
        expect = tiny.model(torch.tensor([ids])).logits[0].argmax(-1).tolist()
    assert first["token_ids"] == ids and first["predicted"] == [tiny.tokenizer.decode([i]) for i in expect]
    assert np.shape(first["selected"]) == (len(ids), 2, 2) and np.shape(first["probs"]) == (len(ids), 2, 8)
    # selected experts listed highest probability first
    for t, layers in enumerate(first["selected"]):
        for layer, (a, b) in enumerate(layers):
            assert first["probs"][t][layer][a] >= first["probs"][t][layer][b]
    assert rep["token_specialization"]["by_key"]["predicted"]["available"] is True
    assert (
        view["texts"][1]["tokens"] == tiny.tokenizer(TEXTS[1])["input_ids"][:3]
        or len(view["texts"][1]["tokens"]) == 3
    )


def test_predictions_are_the_same_when_the_head_runs_in_slices(tiny, monkeypatch):
    """The LM head runs over slices of positions (bounded logits): one position per slice gives
    the predictions of the whole batch at once."""
    import moee.analysis.specialization.report as report
    from moee.analysis.specialization import ReportOptions, build_report

    whole = build_report(tiny, TEXTS, progress=False, options=ReportOptions(min_token_count=1))["token_view"][
        "texts"
    ]
    monkeypatch.setattr(report, "PREDICTION_LOGITS", 1)
    sliced = report._Predictions(tiny)
    assert sliced.rows == 1
    one = build_report(tiny, TEXTS, progress=False, options=ReportOptions(min_token_count=1))["token_view"][
        "texts"
    ]
    assert [t["predicted"] for t in one] == [t["predicted"] for t in whole]
    monkeypatch.setattr(report, "PREDICTION_LOGITS", 10**9)
    assert report._Predictions(tiny).rows == 10**9 // tiny.model.get_output_embeddings().weight.shape[0]


def test_routing_overlap_of_a_model_with_itself_is_one_and_another_seed_is_lower(tiny):
    from moee.analysis.specialization import routing_overlap
    from moee.capture.tiny import tiny_model
    from moee.embed.embedder import MoEEmbedder

    other = MoEEmbedder(tiny_model("olmoe", n_layers=2, seed=5), tiny.tokenizer)
    same, diff = routing_overlap(tiny, [tiny, lambda: other], TEXTS * 3, top_k=2, progress=False)
    assert same["top1"] == [1.0, 1.0] and same["topk"] == [1.0, 1.0]
    assert max(diff["topk"]) < 1.0
    assert 0 < same["topk_permutation"][0] < 1


@pytest.mark.slow
def test_report_cli_with_checkpoints_and_compare(tmp_path, tiny):
    from moee.capture.tiny import tiny_model
    from moee.cli import main

    ckpts = []
    for step, seed in ((40, 0), (10, 1), (20, 2)):  # given out of order: sorted by step
        path = tmp_path / f"step_{step:08d}"
        tiny_model("olmoe", n_layers=2, seed=seed).save_pretrained(path)
        tiny.tokenizer.save_pretrained(path)
        ckpts.append(str(path))
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(
        "".join(json.dumps({"text": t, "d": f"d{i % 2}"}) + "\n" for i, t in enumerate(TEXTS * 4))
    )
    out = tmp_path / "out"
    args = [
        "report",
        "--corpus",
        str(corpus),
        "--domain-field",
        "d",
        "--out",
        str(out),
        "--permutations",
        "2",
    ]
    assert main([*args, "--checkpoints", *ckpts, "--compare", ckpts[1]]) == 0
    rep = json.loads((out / "report.json").read_text())
    sat = rep["saturation"]
    assert sat["available"] and [c["step"] for c in sat["checkpoints"]] == [10, 20, 40]
    assert [c["fraction_of_training"] for c in sat["checkpoints"]] == pytest.approx([0.25, 0.5, 1.0])
    assert sat["final"] == ckpts[0] and sat["mean_topk"][-1] == 1.0 and sat["mean_topk"][0] < 1.0
    assert sat["random_baseline"] == {"top1": 1 / 8, "topk": 2 / 8}
    assert rep["summary"]["model"] == ckpts[0]  # without --model: the final checkpoint's report
    cmp = rep["compare"]
    assert cmp["labels"] == [ckpts[0], ckpts[1]] and cmp["same_shape"]
    assert cmp["selection_overlap"]["by_layer"][0]["topk"] == pytest.approx(sat["by_layer"][0]["topk"][0])
    assert "meta" not in cmp["b"] and cmp["b"]["summary"]["model"] == ckpts[1]
    diff = cmp["differences"]["by_layer"][0]
    assert diff["cv_load"] == pytest.approx(cmp["b"]["layers"][0]["cv_load"] - rep["layers"][0]["cv_load"])
    assert (out / "report.html").is_file()


def test_checkpoint_step_parsing(tmp_path):
    from moee.analysis.specialization import checkpoint_step

    assert checkpoint_step("allenai/OLMoE-1B-7B-0924@step1220000-tokens5117B") == 1220000
    assert checkpoint_step(str(tmp_path / "step_00000042")) == 42
    assert checkpoint_step("some/model") is None
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "trainer_state.json").write_text(json.dumps({"step": 7}))
    assert checkpoint_step(str(d)) == 7


def test_streaming_state_does_not_grow_with_the_corpus():
    """Twice the texts over the same vocabulary: every accumulator array keeps its size; with the
    vocabulary size given, the token tables hold it whole from the first text."""
    rng = np.random.default_rng(0)

    def state(n_texts):
        acc = SpecializationAccumulator(
            2, 4, 2, vocab_size=20, draws=BaselineDraws(permutations=1, sample=64)
        )
        for i in range(n_texts):
            ids = rng.integers(0, 20, 30)
            acc.update(ids, rng.dirichlet(np.ones(4), size=(30, 2)), text_index=i, predicted=ids)
        acc._sample.compact()
        sizes = {k: v.nbytes for k, v in vars(acc).items() if isinstance(v, np.ndarray)}
        for section, tally in acc.tallies.items():  # what each section keeps (a dict: its arrays)
            for k, v in vars(tally).items():
                items = v.items() if isinstance(v, dict) else [("", v)]
                sizes |= {f"{section}.{k}{n}": a.nbytes for n, a in items if isinstance(a, np.ndarray)}
        tables = acc._types
        sizes |= {k: v.nbytes for k, v in vars(tables).items() if isinstance(v, np.ndarray)}
        sizes |= {f"{k}-counts": v.nbytes for k, v in tables.counts.items()}
        sizes |= {f"{k}-occurrences": v.nbytes for k, v in tables.occurrences.items()}
        sizes["sample"] = acc._sample.sel.nbytes
        sizes["state_bytes"] = acc.state_bytes()
        return sizes

    small, large = state(40), state(80)
    small.pop("last_selection"), large.pop("last_selection")  # the last text's, for checks
    small.pop("last_first"), large.pop("last_first")
    assert small == large
    assert small["input-counts"] == 20 * 2 * 4 * 4  # the whole vocabulary, int32
    # what it reports holding: every array counted once (tables, sample buffers, contexts, ...)
    held = sum(v for k, v in small.items() if k not in ("state_bytes", "sample"))
    sample = SpecializationAccumulator(2, 4, 2, draws=BaselineDraws(sample=64))._sample
    held += sum(getattr(sample, n).nbytes for n in ("priority", "text", "pos", "sel", "tok"))
    assert small["state_bytes"] == held


@pytest.mark.slow
def test_report_sizes_its_tables_by_the_vocabulary_and_shows_a_cap(tiny):
    """build_report sizes the token tables to the model's vocabulary (whole, exact); with a cap the
    page says how many tokens went uncounted."""
    from moee.analysis.specialization import ReportOptions, build_report, render_html
    from moee.analysis.specialization.report import vocab_size

    V = vocab_size(tiny)
    assert V == max(tiny.model.config.vocab_size, len(tiny.tokenizer))
    whole = build_report(tiny, TEXTS, progress=False, options=ReportOptions(min_token_count=1))
    ts = whole["token_specialization"]
    assert ts["max_token_types"] == V and all(v["untracked_tokens"] == 0 for v in ts["by_key"].values())
    L, E = whole["summary"]["n_layers"], whole["summary"]["n_experts"]
    assert whole["summary"]["state_bytes"] > 3 * V * L * E * 4  # the three tables and the rest
    assert "not counted here" not in render_html(whole)
    capped = build_report(
        tiny, TEXTS, progress=False, options=ReportOptions(min_token_count=1, max_token_types=2)
    )
    untracked = capped["token_specialization"]["by_key"]["input"]["untracked_tokens"]
    assert capped["token_specialization"]["n_token_types"] == 2 and untracked > 0
    assert f"input {untracked:,} of" in render_html(capped)


def test_free_heap_is_released_after_every_chunk(tiny, monkeypatch):
    """The report hands freed heap pages back once per batch (flat memory over a long corpus),
    the last batch of a chunk included; the release itself is safe to call anywhere."""
    import moee.analysis.specialization.report as report
    from moee.analysis.specialization import ReportOptions, build_report

    report.release_free_heap()
    calls = []
    monkeypatch.setattr(report, "release_free_heap", lambda: calls.append(1))
    build_report(tiny, TEXTS, progress=False, options=ReportOptions(min_token_count=1), chunk_size=1)
    assert len(calls) == len(TEXTS)
    calls.clear()
    build_report(
        tiny, TEXTS * 3, progress=False, options=ReportOptions(min_token_count=1), batch_size=4, chunk_size=5
    )
    assert len(calls) == 2 + 1  # chunks of 5 and 4 texts: batches 4 + 1, then 4
