"""Encoders made causal LMs, depth up-scaling, the loss-free router and the training outputs of
upcycled models (moee/moe/upcycle.py, moee/moe/upcycled.py): the route of the bundled model."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, BertConfig, BertLMHeadModel

from moee.moe.gates import LossFreeBalancedGate
from moee.moe.upcycle import save_upcycled, upcycle
from moee.moe.upcycled import MoEEUpcycledForCausalLM, is_causal, reorder_layers

VOCAB, D_FF = 40, 48
IDS = torch.randint(5, VOCAB, (2, 7), generator=torch.Generator().manual_seed(3))


def bert_dir(tmp_path, layers: int = 3):
    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=D_FF,
        num_hidden_layers=layers,
        num_attention_heads=4,
        max_position_embeddings=32,
    )
    from transformers import BertModel

    BertModel(cfg).eval().save_pretrained(tmp_path / "bert")
    return tmp_path / "bert"


def hidden(model, ids=IDS):
    with torch.no_grad():
        return model.base_model(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state


@pytest.mark.slow
def test_causal_encoder_is_a_causal_lm_whose_prefix_ignores_later_tokens(tmp_path):
    src = bert_dir(tmp_path)
    moe = upcycle(src, n_experts=4, top_k=4, causal=True)
    assert isinstance(moe, MoEEUpcycledForCausalLM) and isinstance(moe.model, BertLMHeadModel)
    assert is_causal(moe.config.text_config)
    changed = IDS.clone()
    changed[:, -1] = (changed[:, -1] + 1 - 5) % (VOCAB - 5) + 5
    a, b = hidden(moe, IDS), hidden(moe, changed)
    assert torch.allclose(a[:, :-1], b[:, :-1], atol=1e-6)  # no position sees a later token
    assert not torch.allclose(a[:, -1], b[:, -1])
    # the LM head is tied to the (dense) input embeddings
    head = moe.get_output_embeddings().weight
    assert head.data_ptr() == moe.get_input_embeddings().weight.data_ptr()
    # with top_k = E the split MoE equals the dense causal BERT
    dense_cfg = BertConfig.from_pretrained(src)
    dense_cfg.is_decoder = True
    dense = BertLMHeadModel.from_pretrained(src, config=dense_cfg).eval()
    assert float((hidden(dense) - a).abs().max()) <= 1e-5
    save_upcycled(moe, tmp_path / "moe")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "moe").eval()
    assert float((hidden(loaded) - a).abs().max()) == 0.0


@pytest.mark.slow
def test_without_causal_an_encoder_attends_both_ways(tmp_path):
    moe = upcycle(bert_dir(tmp_path), n_experts=4, top_k=4)
    changed = IDS.clone()
    changed[:, -1] = (changed[:, -1] + 1 - 5) % (VOCAB - 5) + 5
    assert not torch.allclose(hidden(moe)[:, 0], hidden(moe, changed)[:, 0])


def test_layer_order_copies_layers_and_reindexes_them(tmp_path):
    from transformers import BertModel

    dense = BertModel.from_pretrained(bert_dir(tmp_path))
    originals = [layer.attention.self.query.weight.clone() for layer in dense.encoder.layer]
    reorder_layers(dense, [0, 1, 1, 2])
    assert dense.config.num_hidden_layers == 4 and len(dense.encoder.layer) == 4
    for pos, src in enumerate([0, 1, 1, 2]):
        assert torch.equal(dense.encoder.layer[pos].attention.self.query.weight, originals[src])
    # copies, not shared modules: training one leaves the other
    assert (
        dense.encoder.layer[1].attention.self.query.weight
        is not dense.encoder.layer[2].attention.self.query.weight
    )
    idx = [m.layer_idx for m in dense.encoder.layer.modules() if hasattr(m, "layer_idx")]
    assert sorted(set(idx)) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match=r"layer indices in \[0, 4\)"):
        reorder_layers(dense, [0, 4])


@pytest.mark.slow
def test_depth_upscaled_causal_model_runs_with_cache_and_counts_layers(tmp_path):
    moe = upcycle(bert_dir(tmp_path), n_experts=4, top_k=2, causal=True, layer_order=[0, 1, 2, 1, 2])
    assert len(moe.moe_ffns()) == 5
    out = moe(input_ids=IDS, use_cache=True)
    assert out.logits.shape == (2, 7, VOCAB)
    step = moe(input_ids=IDS[:, :1], use_cache=True)
    assert step.logits.shape == (2, 1, VOCAB)


@pytest.mark.slow
def test_loss_free_router_selects_with_a_bias_and_training_balances(tmp_path):
    moe = upcycle(bert_dir(tmp_path), n_experts=4, top_k=1, causal=True, router_type="loss_free")
    gates = [f.router.gate for f in moe.moe_ffns()]
    assert all(isinstance(g, LossFreeBalancedGate) and g.score_func == "softmax" for g in gates)
    # the bias changes the choice, never the output weights (split: every selected expert weighs 1)
    ffn = moe.moe_ffns()[0]
    x = torch.randn(50, 32)
    before = ffn.router(x)[2]
    ffn.router.gate.bias.copy_(torch.tensor([10.0, 0.0, 0.0, 0.0]))
    assert (ffn.router(x)[2] == 0).all() and not (before == 0).all()
    ffn.router.gate.bias.zero_()
    # training-mode forwards move the bias towards balanced load
    moe.train()
    ids = torch.randint(5, VOCAB, (8, 16), generator=torch.Generator().manual_seed(0))
    out = moe(input_ids=ids, labels=ids)
    assert len(out.moe_aux) == 3 and float(out.aux_loss) == 0.0
    assert torch.allclose(out.loss, out.lm_loss)
    assert any(g.bias.abs().sum() > 0 for g in gates)
    assert float(out.moe_aux[0]["load"].sum()) == 8 * 16  # top-1: one selection per token


def test_upcycled_config_rejects_an_unknown_router(tmp_path):
    with pytest.raises(ValueError, match="router_type must be one of"):
        upcycle(bert_dir(tmp_path), n_experts=4, top_k=1, router_type="switchy")


@pytest.mark.slow
def test_cli_causal_depth_loss_free_and_trimmed_vocabulary(tmp_path, capsys):
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from moee.cli import main

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [chr(ord("a") + i) for i in range(26)]
    words += ["the", "cat", "dog", "sat", "ran", "mat", "sun", "moon", "star"]
    assert len(words) == VOCAB
    tok = Tokenizer(models.WordPiece({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
    )
    src = bert_dir(tmp_path)
    fast.save_pretrained(src)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(
        "".join(json.dumps({"text": t}) + "\n" for t in ["the cat sat", "the dog ran", "the cat"])
    )
    argv = ["upcycle", str(src), "--out", str(tmp_path / "moe"), "--experts", "4", "--top-k", "2"]
    argv += ["--causal", "--layer-order", "0,1,1,2", "--router", "loss_free", "--trim-vocab", str(corpus)]
    assert main(argv + ["--min-count", "2"]) == 0
    assert "4 MoE layers x 4 experts" in capsys.readouterr().out
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "moe")
    new_tok = AutoTokenizer.from_pretrained(tmp_path / "moe")
    # kept: 5 specials + 26 letters + 'the', 'cat' (seen twice); dropped: dog, sat, ran (once) and unseen words
    assert len(new_tok) == 33 and model.get_input_embeddings().weight.shape[0] == 33
    assert new_tok.convert_ids_to_tokens(new_tok("the cat").input_ids) == ["[CLS]", "the", "cat"]
    assert model.config.router_type == "loss_free" and model.config.text_config.num_hidden_layers == 4
    assert main(argv[:-2] + ["--layer-order", "0,x", "--overwrite"]) == 2
    assert "--layer-order must be comma-separated integers" in capsys.readouterr().err
