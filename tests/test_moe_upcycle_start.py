"""How an upcycled model starts (moee/moe/upcycle.py, moee upcycle): RoBERTa made causal from the
CLI, one seed for every random draw, balanced routers with a load report, experts in neuron
order, and the loss-free bias surviving a save."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from safetensors.torch import load_file
from test_moe_upcycle import IDS, dense_model, outputs
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedTokenizerFast,
    RobertaConfig,
    RobertaModel,
)

from moee.cli import main
from moee.moe.upcycle import (
    UpcycleWarning,
    router_load_report,
    save_upcycled,
    split_neurons,
    upcycle,
)
from moee.moe.upcycled import family_rule, moe_layers

SPECIALS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]


def roberta_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer over the 256 byte symbols (no merges), RoBERTa's layout."""
    vocab = {t: i for i, t in enumerate(SPECIALS + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        cls_token="<s>",
        sep_token="</s>",
        mask_token="<mask>",
    )


def roberta_dir(tmp_path, with_tokenizer: bool):
    torch.manual_seed(0)
    cfg = RobertaConfig(
        vocab_size=len(SPECIALS) + 256,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=40,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
    )
    where = tmp_path / ("roberta_tok" if with_tokenizer else "roberta")
    RobertaModel(cfg).eval().save_pretrained(where)
    if with_tokenizer:
        roberta_tokenizer().save_pretrained(where)
    return where


def cli(src, out, *extra: str) -> list[str]:
    return ["upcycle", str(src), "--out", str(out), "--experts", "4", "--top-k", "2", *extra]


@pytest.mark.slow
def test_cli_makes_a_roberta_without_a_tokenizer_a_causal_lm(tmp_path, capsys):
    assert main(cli(roberta_dir(tmp_path, False), tmp_path / "moe", "--causal")) == 0
    out = capsys.readouterr().out
    assert "has no tokenizer" in out
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "moe")
    assert model.config.text_config.is_decoder
    assert outputs(model, IDS).shape == (*IDS.shape, len(SPECIALS) + 256)


@pytest.mark.slow
def test_cli_makes_a_roberta_with_its_bpe_tokenizer_a_causal_lm_with_a_bos_only_template(tmp_path, capsys):
    assert main(cli(roberta_dir(tmp_path, True), tmp_path / "moe", "--causal")) == 0
    tok = AutoTokenizer.from_pretrained(tmp_path / "moe")
    assert tok.convert_ids_to_tokens(tok("ab").input_ids) == ["<s>", "a", "b"]
    assert tok.bos_token == "<s>" and tok.eos_token == "</s>"


def _weights(folder) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


@pytest.mark.slow
def test_one_seed_covers_every_random_draw_of_a_causal_upcycle(tmp_path, capsys):
    src = roberta_dir(tmp_path, False)
    torch.manual_seed(123)  # a different global state before each run must not matter
    assert main(cli(src, tmp_path / "a", "--causal", "--seed", "5")) == 0
    torch.manual_seed(456)
    assert main(cli(src, tmp_path / "b", "--causal", "--seed", "5")) == 0
    assert main(cli(src, tmp_path / "c", "--causal", "--seed", "6")) == 0
    a, b, c = (_weights(tmp_path / x) for x in "abc")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    la, lb, lc = (outputs(AutoModelForCausalLM.from_pretrained(tmp_path / x), IDS) for x in "abc")
    assert torch.equal(la, lb)
    assert not torch.allclose(la, lc)
    # the new LM head's transform is drawn too: it differs between seeds
    head = [k for k in a if "lm_head.dense.weight" in k]
    assert head and not torch.equal(a[head[0]], c[head[0]])


@pytest.mark.slow
def test_upcycle_restores_the_callers_generator_state(tmp_path):
    src = roberta_dir(tmp_path, False)
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    upcycle(src, n_experts=4, top_k=2, causal=True, mode="copy")
    assert torch.equal(torch.rand(3), expected)


def skewed_bert():
    """A BERT whose FFN inputs share a large common component (big LayerNorm biases), as trained
    encoders' do: a raw centroid router sends nearly every token to the same experts."""
    model = dense_model("bert")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm.bias" in name:
                p.copy_(3.0 * torch.randn(p.shape, generator=gen))
    return model


SAMPLE = torch.randint(4, 48, (32, 12), generator=torch.Generator().manual_seed(2))


def test_balanced_routers_start_evenly_loaded_and_raw_centroids_warn():
    with pytest.warns(UpcycleWarning, match="start collapsed"):
        raw = upcycle(skewed_bert(), n_experts=4, top_k=1, balance_router=False, calibration=SAMPLE)
    raw_worst = max(r["max_over_mean"] for r in raw.router_load_report)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UpcycleWarning)
        balanced = upcycle(skewed_bert(), n_experts=4, top_k=1, calibration=SAMPLE)
    report = balanced.router_load_report
    assert raw_worst > 2.0
    assert all(r["max_over_mean"] <= 2.0 and r["dead"] == 0 and not r["collapsed"] for r in report)
    assert report[0]["ceiling"] == 4.0 and abs(sum(report[0]["load"]) - 1.0) < 1e-3
    # the report is the measured statistic on the quarter the balancing did not see
    assert router_load_report(balanced, SAMPLE[24:]) == report


def _worst(model, ids):
    return max(r["max_over_mean"] for r in router_load_report(model, ids))


@pytest.mark.slow
def test_settled_offsets_balance_the_sample_far_better_than_removing_the_mean_alone(monkeypatch):
    """8 experts top-1 on a BERT with a strong shared input component: removing the mean alone
    leaves the load uneven (max/mean 1.58 on the rows balanced on); the settled offsets bring every
    layer's load on those rows close to even, and the sample's unseen quarter with it."""
    import moee.moe.upcycle as up

    fit, held = SAMPLE[:24], SAMPLE[24:]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UpcycleWarning)
        monkeypatch.setattr(up, "_SETTLE_ROUNDS", 0)
        mean_only = upcycle(skewed_bert(), n_experts=8, top_k=1, calibration=SAMPLE)
        monkeypatch.undo()
        settled = upcycle(skewed_bert(), n_experts=8, top_k=1, calibration=SAMPLE)
    assert _worst(settled, fit) <= 1.1 < 1.5 < _worst(mean_only, fit)
    assert _worst(settled, held) < _worst(mean_only, held)


@pytest.mark.slow
@pytest.mark.parametrize(
    "router_type, options", [("hierarchical", {"router_n_groups": 2, "router_k_primary": 1}), ("switch", {})]
)
def test_offsets_settle_through_each_gates_own_selection(router_type, options):
    """Groups first (hierarchical) or one expert (switch): the offsets are settled on what the
    gate itself selects, so its load is even too."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UpcycleWarning)
        raw, settled = (
            upcycle(
                skewed_bert(),
                n_experts=4,
                top_k=1,
                router_type=router_type,
                router_options=options,
                balance_router=balance,
                calibration=SAMPLE,
            )
            for balance in (False, True)
        )
    assert _worst(settled, SAMPLE[:24]) <= 1.25 < _worst(raw, SAMPLE[:24])


def test_the_sample_splits_into_three_quarters_to_balance_and_a_quarter_to_report():
    from moee.moe.upcycle import _split_sample

    assert _split_sample(32) == (slice(None, 24), slice(24, None))
    assert _split_sample(5) == (slice(None, 4), slice(4, None))
    assert _split_sample(3) == (slice(None), slice(None))


def test_router_load_report_counts_selection_fractions_and_dead_experts():
    with pytest.warns(UpcycleWarning):
        model = upcycle(dense_model("bert"), n_experts=4, top_k=2, router_init="zero", balance_router=False)
    report = router_load_report(model, SAMPLE)
    # a zero router ties: every token takes the same two experts
    assert sorted(report[0]["load"]) == [0.0, 0.0, 0.5, 0.5]
    assert report[0]["max_over_mean"] == 2.0 and report[0]["dead"] == 2 and report[0]["collapsed"]
    mask = torch.ones_like(SAMPLE)
    mask[:, 6:] = 0  # padding is not counted
    assert router_load_report(model, SAMPLE, mask)[0]["load"] == report[0]["load"]


@pytest.mark.slow
def test_cli_prints_the_per_layer_start_load_with_the_ceiling(tmp_path, capsys):
    src = tmp_path / "bert"
    skewed_bert().save_pretrained(src)
    with pytest.warns(UpcycleWarning):
        assert main(cli(src, tmp_path / "raw", "--no-router-balance")) == 0
    raw = capsys.readouterr().out
    assert "ceiling 2.00 = experts / top-k" in raw and "COLLAPSED" in raw
    assert "calibration sample: seeded random token ids (the model has no tokenizer)" in raw
    assert main(cli(src, tmp_path / "moe")) == 0
    out = capsys.readouterr().out
    assert "layer 0: max/mean" in out and "layer 1: max/mean" in out


def test_expert_e_gets_neuron_group_e_and_router_row_e_its_centroid():
    dense = dense_model("bert")
    rule = family_rule("bert")
    ffns = [rule.read(layer) for layer in moe_layers(dense.base_model, rule)]
    plans = [split_neurons(ffn, 4, seed=3) for ffn in ffns]
    w_act = [ffn.w_act.clone() for ffn in ffns]
    moe = upcycle(dense, n_experts=4, top_k=2, seed=3, balance_router=False)
    for layer, (groups, centroids), rows in zip(moe.moe_ffns(), plans, w_act, strict=True):
        for e, idx in enumerate(groups):
            assert torch.equal(layer.experts.w_in[e], rows[idx].t())
            assert torch.equal(layer.router.gate.w_gate.weight[e], centroids[e])


@pytest.mark.slow
def test_the_loss_free_bias_survives_save_and_reload(tmp_path):
    moe = upcycle(dense_model("llama"), n_experts=4, top_k=1, router_type="loss_free")
    bias = torch.tensor([2.0, -1.0, 0.5, -1.5])
    for ffn in moe.moe_ffns():
        ffn.router.gate.bias.copy_(bias)
    save_upcycled(moe, tmp_path / "moe")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "moe")
    for ffn in back.moe_ffns():
        assert torch.equal(ffn.router.gate.bias, bias)
    assert torch.equal(outputs(back, IDS), outputs(moe, IDS))


def test_a_calibrate_corpus_is_checked_before_loading(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"txt": "x"}) + "\n")
    assert main(cli(tmp_path / "missing", tmp_path / "moe", "--calibrate", str(bad))) == 2
    assert "needs a string 'text' field" in capsys.readouterr().err


def test_calibration_texts_are_documents_of_many_kinds_shipped_with_the_package():
    from moee.embed.embedder import MINILM_MOE_DIR
    from moee.moe.upcycle import calibration_texts

    rows = [json.loads(line) for line in (MINILM_MOE_DIR / "heldout.jsonl").read_text().splitlines()]
    texts = calibration_texts()
    assert texts == [r["text"] for r in rows[:256]] and len(set(texts)) == 256
    assert len({r["source"] for r in rows[:256]}) >= 8
    assert calibration_texts(5) == texts[:5]


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json", "vocab.txt"])
def test_a_local_folder_lends_its_tokenizer_to_the_calibration(tmp_path, monkeypatch, name):
    import transformers

    from moee.moe.upcycle import _local_tokenizer

    assert _local_tokenizer(tmp_path) is None
    (tmp_path / "other.json").write_text("{}")
    assert _local_tokenizer(tmp_path) is None
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda folder: ("loaded", folder))
    (tmp_path / name).write_text("{}")
    assert _local_tokenizer(tmp_path) == ("loaded", tmp_path)


def test_select_shared_neurons_takes_zero_and_names_a_bad_selection():
    from moee.moe.upcycle import select_shared_neurons

    rule = family_rule("bert")
    ffn = rule.read(moe_layers(dense_model("bert").base_model, rule)[0])
    assert select_shared_neurons(ffn, 0).numel() == 0
    with pytest.raises(
        ValueError, match=r"shared-neuron selection must be one of \('norm', 'central'\), got 'x'"
    ):
        select_shared_neurons(ffn, 1, "x")
    with pytest.raises(ValueError, match=r"^shared_neurons must be in \[0, d_ff=48\), got 48$"):
        select_shared_neurons(ffn, ffn.d_ff)
