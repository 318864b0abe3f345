"""Expert importance, router swap and steering (moee.analysis.expert_importance) with known answers.

The planted model is a one-layer tiny OLMoE whose weights are set so that expert 0 alone carries one
function: the router sends exactly the tokens of domain "a" (ids 10-19) to it, and its output points
the LM head at those same tokens, so domain "a" is predictable only through expert 0.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from moee.analysis.expert_importance import (
    LossCorpus,
    baseline,
    build_corpus,
    expert_importance,
    null_biases,
    router_swap,
    steering_effect,
)
from moee.capture.tiny import tiny_model

A_TOKENS = range(10, 20)
B_TOKENS = range(20, 30)


def planted_olmoe() -> torch.nn.Module:
    model = tiny_model("olmoe", n_layers=1, n_experts=8, top_k=2)
    q, _ = torch.linalg.qr(torch.randn(64, 64, generator=torch.Generator().manual_seed(0)))
    u, v, d = q[:, 0], q[:, 1], q[:, 2]  # domain a, domain b, the planted output direction
    layer = model.model.layers[0]
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb[list(A_TOKENS)] = u
        emb[list(B_TOKENS)] = v
        layer.mlp.gate.weight[0] = 20.0 * (u - v)  # logit ~ +160 on a tokens, ~ -160 on b tokens
        experts = layer.mlp.experts
        inner = experts.down_proj.shape[-1]
        experts.gate_up_proj[0].zero_()
        experts.down_proj[0].zero_()
        experts.gate_up_proj[0, 0] = 10.0 * u
        experts.gate_up_proj[0, inner] = u
        experts.down_proj[0, :, 0] = d * (50.0 / 640.0)
        model.lm_head.weight[list(A_TOKENS)] = 5.0 * d
    return model


def planted_corpus(n: int = 8, length: int = 12) -> LossCorpus:
    gen = torch.Generator().manual_seed(1)
    ids, domains = [], []
    for i in range(n):
        pool = A_TOKENS if i % 2 == 0 else B_TOKENS
        ids.append(torch.tensor(list(pool))[torch.randint(len(pool), (length,), generator=gen)])
        domains.append("a" if i % 2 == 0 else "b")
    return LossCorpus(ids, domains)


@pytest.fixture(scope="module")
def planted():
    model, corpus = planted_olmoe(), planted_corpus()
    return model, corpus, baseline(model, corpus, batch_size=4)


def test_the_planted_premise_holds(planted) -> None:
    _, _, base = planted
    assert base.load[0, 0] == pytest.approx(0.5)  # exactly the a tokens
    losses = base.by_domain(base.losses)
    assert losses["a"] < 2.4 < 4.0 < losses["b"]  # a: uniform over its 10 tokens, log 10


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["reselect", "zero"])
def test_the_planted_expert_ranks_first_for_its_domain_and_nowhere_else(planted, mode) -> None:
    model, corpus, base = planted
    result = expert_importance(model, corpus, mode=mode, batch_size=4, base=base)
    rows = {r["expert"]: r for r in result["experts"]}
    planted_row = rows[0]
    assert planted_row["importance_rank"] == 1
    assert planted_row["delta_by_domain"]["a"] > 1.5
    assert planted_row["delta_by_domain"]["b"] == pytest.approx(0.0, abs=1e-6)  # never selected there
    assert all(abs(r["delta_by_domain"]["a"]) < 0.05 for e, r in rows.items() if e != 0)
    # the load-matched null removes as many assignments, spread over the experts: far less
    assert planted_row["null"] < planted_row["delta"] / 2 and planted_row["excess"] > 0.5
    assert result["spearman_importance_load"]["pooled"] is not None
    json.dumps(result)  # JSON-ready


def test_a_never_selected_expert_scores_zero(planted) -> None:
    model, corpus, base = planted
    with torch.no_grad():
        gate = model.model.layers[0].mlp.gate.weight
        saved = gate[7].clone()
        gate[7] = -30.0 * (model.model.embed_tokens.weight[10] + model.model.embed_tokens.weight[20])
    try:
        fresh = baseline(model, corpus, batch_size=4)
        assert fresh.load[0, 7] == 0
        result = expert_importance(model, corpus, experts=[(0, 7)], batch_size=4, base=fresh)
    finally:
        with torch.no_grad():
            gate[7] = saved
    row = result["experts"][0]
    assert row["delta"] == pytest.approx(0.0, abs=1e-6)
    assert row["null"] == 0.0  # load 0: the null disables nothing


@pytest.mark.slow
def test_the_nulls_sit_at_their_baseline_on_a_random_router() -> None:
    """On a random model the experts are exchangeable: the mean importance of the experts and the
    mean of their load-matched nulls agree to within the spread of the importances."""
    model = tiny_model("olmoe", n_layers=2)
    gen = torch.Generator().manual_seed(3)
    corpus = LossCorpus([torch.randint(4, 120, (24,), generator=gen) for _ in range(8)], ["x"] * 8)
    result = expert_importance(model, corpus, batch_size=8)
    deltas = torch.tensor([r["delta"] for r in result["experts"]])
    nulls = torch.tensor([r["null"] for r in result["experts"]])
    assert abs(float(deltas.mean() - nulls.mean())) < float(deltas.std())
    # and the null is no intervention at all at rate 0, a full one at rate 1: it scales with load
    assert float(nulls.abs().mean()) > 0


@pytest.mark.slow
def test_an_identical_router_swap_changes_nothing_another_does(planted) -> None:
    model, corpus, base = planted
    same = router_swap(model, copy.deepcopy(model), corpus, batch_size=4, base=base)
    assert [r["layer"] for r in same["swaps"]] == [0, "all"]
    assert all(r["delta"] == 0.0 and r["recovered"] == 1.0 for r in same["swaps"])
    # the permuted-router null: the planted expert's a tokens go to other experts, b tokens lose nothing
    null = same["swaps"][0]
    assert null["null_by_domain"]["a"] > 1.5 and abs(null["null_by_domain"]["b"]) < 0.05
    assert null["null"] > 0.5 and len(same["swaps"]) == 2 and same["null_draws"] == 3
    other = router_swap(model, tiny_model("olmoe", n_layers=1), corpus, batch_size=4, base=base)
    assert other["swaps"][0]["delta_by_domain"]["a"] > 1.5  # the planted routing is lost
    assert other["swaps"][0]["recovered"] < 0.5  # no better than a scrambled router
    assert other["swaps"][0]["null"] == pytest.approx(null["null"])  # the null is the model's own
    json.dumps(other)


def test_the_swap_null_is_reproducible_and_skippable(planted) -> None:
    model, corpus, base = planted
    donor = copy.deepcopy(model)
    one = router_swap(model, donor, corpus, batch_size=4, base=base, null_draws=2, seed=4)
    two = router_swap(model, donor, corpus, batch_size=4, base=base, null_draws=2, seed=4)
    assert one["swaps"] == two["swaps"]
    plain = router_swap(model, donor, corpus, batch_size=4, base=base, null=False)
    assert plain["null"] is None and "null" not in plain["swaps"][0]


def test_the_steering_null_draws_other_experts_of_the_same_layers_from_its_seed() -> None:
    biases = {(0, 1): 2.0, (0, 3): -1.0, (1, 0): 5.0}
    draws = null_biases(biases, [8, 8], draws=6, seed=0)
    assert draws == null_biases(biases, [8, 8], draws=6, seed=0)  # the documented seed: reproducible
    assert null_biases(biases, [8, 8], draws=1, seed=1)[0] == draws[1]  # draw j is seeded seed + j
    for draw in draws:
        assert sorted(draw.values()) == sorted(biases.values())
        assert (
            sum(1 for layer, _ in draw if layer == 0) == 2 and sum(1 for layer, _ in draw if layer == 1) == 1
        )
        assert not set(draw) & {(0, 1), (0, 3), (1, 0)}  # never a steered expert
    assert len({tuple(sorted(d)) for d in draws}) > 1
    with pytest.raises(ValueError, match="too few others"):
        null_biases({(0, e): 1.0 for e in range(5)}, [8])


@pytest.mark.slow
def test_steering_moves_selection_distribution_and_embedding(tiny_embedder) -> None:
    texts = ["the cat sat on the mat", "a dog ran in the park", "the bird sang"]
    corpus = build_corpus([(t, "x") for t in texts], tiny_embedder.tokenizer)
    none = steering_effect(tiny_embedder, corpus, texts, {(0, 1): 0.0}, null=False)
    assert none["kl_next_token"] == pytest.approx(0.0, abs=1e-9)
    assert none["embedding_cosine"]["min"] == pytest.approx(1.0, abs=1e-6)
    steered = steering_effect(tiny_embedder, corpus, texts, {(0, 1): 1e4}, null_draws=2, seed=3)
    rate = steered["selection_rate"][0]
    assert rate["after"] == 1.0 and rate["before"] < 1.0
    assert steered["selection_shift"] == pytest.approx(1.0 - rate["before"])
    assert steered["kl_next_token"] > 0
    assert steered["embedding_cosine"]["mean"] < 1.0
    # the null: the same forced expert elsewhere in layer 0, also always selected after
    null = steered["null"]
    assert [d["biases"] for d in null["draws"]] == [
        [{"layer": i, "expert": e, "bias": 1e4} for (i, e) in draw]
        for draw in null_biases({(0, 1): 1e4}, [8, 8], draws=2, seed=3)
    ]
    assert all(d["selection_rate"][0]["after"] == 1.0 for d in null["draws"])
    assert null["kl_next_token"]["mean"] > 0 and len(null["kl_next_token"]["draws"]) == 2
    again = steering_effect(tiny_embedder, corpus, texts, {(0, 1): 1e4}, null_draws=2, seed=3)
    assert again["null"] == null
    json.dumps(steered)


@pytest.mark.slow
def test_the_command_writes_json_csv_and_a_reading(tiny_model_dir, tmp_path) -> None:
    from moee.cli import main

    corpus = tmp_path / "c.jsonl"
    words = "the cat sat on the mat and a dog ran in the park".split()
    corpus.write_text(
        "".join(
            json.dumps({"text": " ".join(words[i:] + words[:i]), "d": "pq"[i % 2]}) + "\n" for i in range(6)
        )
    )
    out = tmp_path / "out"
    argv = [
        "ablate",
        "--model",
        tiny_model_dir,
        "--corpus",
        str(corpus),
        "--domain-field",
        "d",
        "--layers",
        "1",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    result = json.loads((out / "importance.json").read_text())
    assert {r["layer"] for r in result["experts"]} == {1} and len(result["experts"]) == 8
    assert set(result["domains"]) == {"p", "q"}
    assert "moee ablate" in (out / "README.md").read_text()
    assert (out / "experts.csv").read_text().startswith("layer,expert,")
    assert main(argv) == 2  # results there: --overwrite needed
    assert main([*argv, "--overwrite", "--swap-from", tiny_model_dir, "--null-draws", "1"]) == 0
    swap = json.loads((out / "swap.json").read_text())
    assert all(r["delta"] == 0.0 for r in swap["swaps"])
    assert swap["meta"]["weights_digest"] == swap["donor_digest"]  # the donor is the model itself
    assert swap["null_draws"] == 1 and all(r["null"] > 0 for r in swap["swaps"])
    reading = (out / "README.md").read_text()
    assert "# Router swap" in reading and "--swap-from" in reading and swap["donor_digest"] in reading
    assert main([*argv, "--overwrite", "--steer", "1:2=2", "--null-draws", "2"]) == 0
    steering = json.loads((out / "steering.json").read_text())
    assert steering["meta"]["weights_digest"] == swap["meta"]["weights_digest"]
    assert len(steering["null"]["draws"]) == 2 and steering["null"]["seed"] == 0
    reading = (out / "README.md").read_text()
    assert "# Expert steering" in reading and "1:2 +2" in reading and "of 2 null draws" in reading
    # the recorded command re-runs: --steer and --experts as typed, not as parsed Python tuples
    import shlex

    command = shlex.split(steering["meta"]["command"])
    assert command[command.index("--steer") + 1] == "1:2=2.0"
    assert main([*argv, "--overwrite", "--experts", "1:3", "1:5"]) == 0
    command = shlex.split(json.loads((out / "importance.json").read_text())["meta"]["command"])
    at = command.index("--experts")
    assert command[at + 1 : at + 3] == ["1:3", "1:5"]
    assert main([*command[1:], "--overwrite"]) == 0  # the line itself runs


def test_build_corpus_caps_tokens_overall_and_per_domain(tiny_embedder) -> None:
    texts = [("the cat sat on the mat " * 4, "a")] * 5 + [("a dog ran in the park " * 4, "b")] * 5
    plain = build_corpus(texts, tiny_embedder.tokenizer, seq_len=8, max_tokens=60)
    assert sum(len(c) for c in plain.ids) == 60 and set(plain.domains) == {"a"}  # sorted corpus: one domain
    capped = build_corpus(texts, tiny_embedder.tokenizer, seq_len=8, max_tokens=60, per_domain_tokens=30)
    per = {d: sum(len(c) for c, x in zip(capped.ids, capped.domains) if x == d) for d in ("a", "b")}
    assert per == {"a": 30, "b": 30} and max(len(c) for c in capped.ids) <= 8


def test_routing_table_round_trips_through_parquet_and_pandas(tiny_embedder, tmp_path) -> None:
    import pyarrow.parquet as pq

    from moee.analysis.routing_export import routing_table, write_routing_parquet

    texts = ["the cat sat", "a dog ran in the park"]
    table = routing_table(tiny_embedder, texts, ids=["t0", "t1"], dense=True)
    frame = table.to_pandas()
    routes = list(tiny_embedder.iter_token_routes(texts, prompt=None))
    assert len(frame) == sum(len(r.input_ids) for r in routes)
    second = frame[frame.text_id == "t1"]
    assert second.position.tolist() == list(range(len(routes[1].input_ids)))
    assert list(second.layer1_experts.iloc[2]) == routes[1].selection[2, 1].tolist()
    probs = routes[1].probs[2, 1]
    assert list(second.layer1_weights.iloc[2]) == pytest.approx(probs[routes[1].selection[2, 1]].tolist())
    assert len(second.layer0_probs.iloc[0]) == tiny_embedder.n_experts
    path = write_routing_parquet(table, tmp_path / "routes.parquet")
    assert pq.read_table(path).equals(table)


def test_recovered_is_only_a_share_of_a_null_above_its_noise() -> None:
    from moee.analysis.expert_importance import _above_noise, _spread

    assert _above_noise(_spread([0.0121 - 0.006, 0.0121, 0.0121 + 0.006]))  # mean 2.5 standard errors up
    assert not _above_noise(_spread([-0.004, 0.0002, 0.0044]))  # indistinguishable from zero
    assert not _above_noise(_spread([0.01, 0.02, -0.03]))  # negative
    assert _above_noise(_spread([0.003]))  # one draw: positive is all that can be asked
    assert not _above_noise(_spread([0.0]))
    # two draws: the standard error is the population sd over sqrt(1)
    assert not _above_noise(_spread([0.0, 2.0]))  # mean 1, standard error 1: below 2
    assert _above_noise(_spread([1.5, 2.0]))  # mean 1.75, standard error 0.25
    assert not _above_noise(_spread([1.0, 3.0]))  # mean 2 = exactly two standard errors: not above
    assert _above_noise(_spread([1.0, 2.5]))  # mean 1.75, 2.33 standard errors (0.75)
    # three draws: the standard error is the population sd over sqrt(2), not sqrt(4)
    assert not _above_noise(_spread([0.0, 1.0, 2.0]))  # mean 1, standard error 0.577
