"""`upcycle()` itself, `_load_dense` and `save_upcycled` (moee/moe/upcycle.py) on tiny models built
here: every refusal by its message, the defaults, the config written, the experts against the
dense neurons, the seeding, the calibration handed on and the start report, the collapse warning,
loading from a loaded model or a folder, and the staged save. Routers are not balanced unless a
test is about the balancing (the settling rounds are what make an upcycle slow)."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from test_moe_upcycle import D_FF, IDS, dense_config, dense_model, max_diff, outputs
from test_moe_upcycle_output import no_loading  # noqa: F401  (a fixture: fail if the dense model loads)
from test_moe_upcycle_start import SAMPLE
from transformers import (
    AutoModel,
    BertLMHeadModel,
    BertModel,
    GPTNeoXConfig,
    LlamaForCausalLM,
)

import moee.moe.upcycle as up
from moee.capture.tiny import tiny_tokenizer
from moee.moe.gate_registry import GATES
from moee.moe.upcycled import MoEEUpcycledForCausalLM, MoEEUpcycledModel, family_rule, moe_layers


def build(src=None, **kwargs):
    """``upcycle(src)`` (default a fresh tiny BERT) into 4 experts, top-1, calibrated on ``SAMPLE``
    without balancing, the start warnings silenced; ``kwargs`` override any of that."""
    args = {"n_experts": 4, "top_k": 1, "balance_router": False, "calibration": SAMPLE, **kwargs}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", up.UpcycleWarning)
        return up.upcycle(dense_model("bert") if src is None else src, **args)


def dense_ffns(model):
    """The `DenseFFN` of every layer of a dense model (read before an upcycle replaces them)."""
    rule = family_rule(model.config.model_type)
    return [rule.read(layer) for layer in moe_layers(model.base_model, rule)]


def rows(model):
    """Every MoE layer's router weight ``[E, d]``."""
    return [ffn.router.gate.w_gate.weight.detach() for ffn in model.moe_ffns()]


@pytest.fixture
def bert_dir(tmp_path):
    """A tiny BERT saved with safetensors, no tokenizer."""
    dense_model("bert").save_pretrained(tmp_path / "bert")
    return tmp_path / "bert"


def spy(monkeypatch, name, result=None):
    """Record every call of ``up.<name>``; call the real function unless ``result`` is given."""
    real, calls = getattr(up, name), []

    def record(*args, **kwargs):
        calls.append((args, kwargs))
        return real(*args, **kwargs) if result is None else result

    monkeypatch.setattr(up, name, record)
    return calls


# ----------------------------------------------------------------- refusals before anything loads
KNOWN = (
    "router_noisy, router_bias_gamma, router_score_func, router_w_importance, router_w_load, "
    "router_n_groups, router_k_primary, router_w_threshold, router_capacity_factor, "
    "router_min_capacity, router_switch_alpha"
)
REFUSED = [
    ({"mode": "merge"}, "mode must be one of ('split', 'copy', 'lora'), got 'merge'"),
    ({"router_init": "kmeans"}, "router_init must be one of ('centroid', 'random', 'zero'), got 'kmeans'"),
    (
        {"mode": "copy", "router_init": "centroid"},
        "router_init='centroid' needs mode='split': copied experts are identical, there is nothing to cluster",
    ),
    (
        {"mode": "copy", "shared_neurons": 4},
        "shared_neurons is for mode='split'; use shared_copy=True for a copied shared expert "
        "(mode='lora' always keeps the whole FFN shared)",
    ),
    ({"shared_copy": True}, "shared_copy is for mode='copy'; use shared_neurons=N for split mode"),
    *(
        ({"n_experts": bad}, f"n_experts must be a positive int, got {bad!r}")
        for bad in (True, 4.0, "4", 0, -1)
    ),
    *(
        ({"top_k": bad}, f"top_k must be an int in [1, n_experts=4], got {bad!r}")
        for bad in (True, 1.0, "1", 0, 5, -1)
    ),
    *(
        ({name: bad}, f"{name} must be a finite number >= 0, got {bad!r}")
        for name in ("router_std", "router_bias_gamma")
        for bad in (True, "0.1", None, float("inf"), float("nan"), -0.01)
    ),
    (
        {"router_bias_gamma": 0.5, "router_options": {"router_bias_gamma": -1.0}},
        "router_bias_gamma must be a finite number >= 0, got -1.0",
    ),
    (
        {"router_options": {"router_typo": 1, "router_type": "switch", "b": 2}},
        f"unknown router option(s) b, router_type, router_typo; known: {KNOWN}",
    ),
    (
        {"router_type": "nope"},
        f"router_type must be one of {tuple(GATES)}, got 'nope'",
    ),
    (
        {"layer_order": []},
        "layer order must be a non-empty list of layer indices in [0, number of layers), got []",
    ),
    (
        {"layer_order": [0, -1]},
        "layer order must be a non-empty list of layer indices in [0, number of layers), got [0, -1]",
    ),
    *(
        ({"balance_router": bad}, f"balance_router must be True or False, got {bad!r}")
        for bad in (None, 1, "yes")
    ),
]


@pytest.mark.usefixtures("no_loading")
@pytest.mark.parametrize(("kwargs", "message"), REFUSED)
def test_bad_arguments_are_refused_by_name_before_the_dense_model_loads(kwargs, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        up.upcycle("unused", **{"n_experts": 4, "top_k": 1, **kwargs})


@pytest.mark.usefixtures("no_loading")
@pytest.mark.parametrize(
    "kwargs",
    [
        {"n_experts": 1, "top_k": 1},
        {"n_experts": 4, "top_k": 4},
        {"router_std": 0, "router_bias_gamma": 0},
        {"router_std": 0.0, "router_bias_gamma": 0.0, "router_options": {"router_noisy": True}},
        {"router_std": 3, "router_bias_gamma": 2.5},
        {"router_bias_gamma": -1.0, "router_options": {"router_bias_gamma": 0.5}},
        {"mode": "copy", "router_init": "zero", "shared_copy": True},
        {"mode": "split", "router_init": "random", "shared_neurons": 8},
        {"layer_order": (1, 0)},
        {"router_type": "hierarchical", "router_options": {"router_n_groups": 2}},
    ],
)
def test_accepted_arguments_reach_the_loading(kwargs):
    with pytest.raises(AssertionError, match="the dense model was loaded before"):
        up.upcycle("unused", **{"n_experts": 4, "top_k": 1, **kwargs})


def test_shared_neurons_out_of_range_or_not_dividing_are_refused_before_any_neuron_is_chosen(monkeypatch):
    """d_ff is 48: -1, 48 or 52 shared neurons are out of range, 2 leave 46 for 4 experts. upcycle()
    names them itself (the shared selection and the split would refuse some of them too, with
    other numbers)."""

    def refuse(*args, **kwargs):
        raise AssertionError("neurons were chosen before the widths were checked")

    monkeypatch.setattr(up, "select_shared_neurons", refuse)
    monkeypatch.setattr(up, "split_neurons", refuse)
    for bad in (-1, D_FF, D_FF + 4):
        with pytest.raises(ValueError, match=rf"^shared_neurons must be in \[0, d_ff=48\), got {bad}$"):
            build(shared_neurons=bad)
    with pytest.raises(
        ValueError,
        match="^d_ff=48 minus shared_neurons=2 is not divisible by n_experts=4: "
        "every expert must get the same number of neurons$",
    ):
        build(shared_neurons=2)
    with pytest.raises(ValueError, match="^d_ff=48 minus shared_neurons=0 is not divisible by n_experts=5"):
        build(n_experts=5)
    with pytest.raises(ValueError, match="^d_ff=48 minus shared_neurons=1 is not divisible by n_experts=7"):
        build(n_experts=7, shared_neurons=1)  # 48 + 1 would divide


def test_a_layer_order_beyond_a_loaded_models_layers_is_refused_before_its_causality():
    with pytest.raises(
        ValueError, match=r"^layer order must be a non-empty list of layer indices in \[0, 2\), got \[0, 2\]$"
    ):
        build(causal=True, layer_order=[0, 2])


def test_a_loaded_model_without_a_layer_count_is_refused_by_its_family():
    """CLIP's config has no ``num_hidden_layers`` (two towers): no layer order to check, the family
    is what refuses it."""
    from transformers import CLIPConfig, CLIPModel

    tower = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
    config = CLIPConfig(
        text_config={**tower, "vocab_size": 20, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 1},
        vision_config={**tower, "image_size": 8, "patch_size": 4},
        projection_dim=8,
    )
    clip = CLIPModel(config)
    assert not hasattr(clip.config, "num_hidden_layers") and up._load_dense(clip, None) is clip
    with pytest.raises(
        ValueError, match="^upcycling does not support model_type 'clip'; supported: bert, gpt2"
    ):
        build(clip)


# ----------------------------------------------------------------- defaults and the config written
@pytest.mark.slow
def test_the_defaults_split_with_centroid_routers_loss_free_and_seed_0():
    dense = dense_model("bert")
    plans = [up.split_neurons(ffn, 4, seed=0) for ffn in dense_ffns(dense)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", up.UpcycleWarning)
        moe = up.upcycle(dense, n_experts=4, top_k=2, balance_router=False, calibration=SAMPLE)
    config = moe.config
    assert (config.upcycle_mode, config.router_init, config.router_type) == (
        "split",
        "centroid",
        "loss_free",
    )
    assert config.router_bias_gamma == 1e-3 and config.shared_intermediate_size == 0
    assert config.expert_intermediate_size == D_FF // 4 and config.upcycled_from is None
    assert isinstance(moe, MoEEUpcycledModel) and moe.model is dense
    assert not dense.config.is_decoder and next(moe.parameters()).dtype == torch.float32
    for ffn, (groups, centroids), row in zip(moe.moe_ffns(), plans, rows(moe), strict=True):
        assert ffn.shared is None
        torch.testing.assert_close(row, centroids)
        assert [len(g) for g in groups] == [12] * 4


def test_copy_defaults_to_a_random_router_of_std_0_02_drawn_from_the_seed():
    moe = build(mode="copy")
    assert moe.config.router_init == "random" and moe.config.upcycle_mode == "copy"
    gen = torch.Generator().manual_seed(0)
    for row in rows(moe):
        assert torch.equal(row, torch.randn(4, 32, generator=gen) * 0.02)


@pytest.mark.parametrize("mode", ["split", "copy"])
def test_a_random_router_draws_row_after_row_from_the_seed_times_router_std(mode):
    moe = build(mode=mode, router_init="random", router_std=0.5, seed=3)
    gen = torch.Generator().manual_seed(3)
    for row in rows(moe):
        assert torch.equal(row, torch.randn(4, 32, generator=gen) * 0.5)
    assert moe.config.router_init == "random"


def test_random_rows_are_float32_draws_whatever_torchs_default_dtype():
    dense = dense_model("bert")
    torch.set_default_dtype(torch.float64)
    try:
        moe = build(dense, mode="copy")
    finally:
        torch.set_default_dtype(torch.float32)
    gen = torch.Generator().manual_seed(0)
    for row in rows(moe):
        assert torch.equal(row, torch.randn(4, 32, generator=gen) * 0.02)


def test_random_rows_reach_the_gate_in_the_models_dtype(bert_dir):
    """A float64 hierarchical gate: its primary rows are the group means of the float64 rows (a
    mean taken in float32 rounds differently)."""
    options = {"router_n_groups": 2, "router_k_primary": 1}
    moe = build(
        bert_dir, dtype=torch.float64, router_type="hierarchical", router_options=options, mode="copy"
    )
    gen = torch.Generator().manual_seed(0)
    for ffn in moe.moe_ffns():
        grouped = (torch.randn(4, 32, generator=gen) * 0.02).double().reshape(2, 2, 32)
        assert torch.equal(ffn.router.gate.w_gate.weight, grouped.mean(dim=1))
        assert torch.equal(ffn.router.gate.w_gate_secondary, grouped.transpose(1, 2))


def test_a_zero_router_starts_every_row_at_zero():
    moe = build(router_init="zero")
    assert moe.config.router_init == "zero"
    assert all(torch.equal(row, torch.zeros(4, 32)) for row in rows(moe))


@pytest.mark.parametrize(
    ("kwargs", "fields"),
    [
        (
            {"shared_neurons": 8, "top_k": 2, "router_init": "zero", "router_type": "loss_free"},
            {
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "upcycle_mode": "split",
                "expert_intermediate_size": 10,
                "shared_intermediate_size": 8,
                "router_init": "zero",
                "router_type": "loss_free",
            },
        ),
        (
            {"n_experts": 2, "mode": "copy", "shared_copy": True, "router_bias_gamma": 0.5},
            {
                "num_experts": 2,
                "num_experts_per_tok": 1,
                "upcycle_mode": "copy",
                "expert_intermediate_size": D_FF,
                "shared_intermediate_size": D_FF,
                "router_init": "random",
                "router_bias_gamma": 0.5,
            },
        ),
        ({"n_experts": 3, "top_k": 3, "mode": "copy"}, {"num_experts": 3, "shared_intermediate_size": 0}),
        (
            {"n_experts": 5, "shared_neurons": 8},
            {"expert_intermediate_size": 8, "shared_intermediate_size": 8},
        ),
        (
            {"router_bias_gamma": 0.5, "router_options": {"router_bias_gamma": 0.25, "router_noisy": True}},
            {"router_bias_gamma": 0.25, "router_noisy": True},
        ),
        (
            {"router_type": "hierarchical", "router_options": {"router_n_groups": 2, "router_k_primary": 1}},
            {"router_type": "hierarchical", "router_n_groups": 2, "router_k_primary": 1},
        ),
    ],
)
def test_the_config_records_how_the_model_was_built(kwargs, fields):
    config = build(**kwargs).config
    assert {key: getattr(config, key) for key in fields} == fields


def test_upcycled_from_names_the_folder_or_the_loaded_models_path(bert_dir):
    assert build(str(bert_dir)).config.upcycled_from == str(bert_dir)
    assert build(bert_dir).config.upcycled_from == str(bert_dir)
    assert build(AutoModel.from_pretrained(bert_dir)).config.upcycled_from == str(bert_dir)
    assert build().config.upcycled_from is None  # built from a config: no name


def test_the_result_is_in_eval_mode_on_the_loaded_model_itself_and_reproduces_it():
    dense = dense_model("llama")
    before = outputs(dense, IDS)
    moe = build(dense, top_k=4, calibration=None)
    assert isinstance(moe, MoEEUpcycledForCausalLM) and moe.model is dense
    assert not any(m.training for m in moe.modules())
    assert max_diff(outputs(moe, IDS), before) <= 1e-5


# ----------------------------------------------------------------- the experts
def test_split_experts_hold_the_seeds_neuron_groups_and_the_shared_expert_the_chosen_neurons():
    dense = dense_model("bert")
    ffns = dense_ffns(dense)
    chosen = [up.select_shared_neurons(ffn, 8, "central") for ffn in ffns]
    plans = [up.split_neurons(ffn, 4, shared, seed=3) for ffn, shared in zip(ffns, chosen)]
    w_act = [ffn.w_act.clone() for ffn in ffns]
    moe = build(dense, seed=3, shared_neurons=8, shared_select="central")
    assert not torch.equal(chosen[0], up.select_shared_neurons(ffns[0], 8, "norm"))
    for layer, shared, (groups, centroids), w, row in zip(moe.moe_ffns(), chosen, plans, w_act, rows(moe)):
        assert torch.equal(layer.shared.w_in[0], w[shared].t())
        for e, idx in enumerate(groups):
            assert torch.equal(layer.experts.w_in[e], w[idx].t())
        torch.testing.assert_close(row, centroids)


def test_shared_neurons_default_to_the_largest_by_norm():
    dense = dense_model("bert")
    ffns = dense_ffns(dense)
    chosen = [up.select_shared_neurons(ffn, 8, "norm") for ffn in ffns]
    w_act = [ffn.w_act.clone() for ffn in ffns]
    moe = build(dense, shared_neurons=8)
    for layer, shared, w in zip(moe.moe_ffns(), chosen, w_act, strict=True):
        assert torch.equal(layer.shared.w_in[0], w[shared].t())


@pytest.mark.parametrize("shared_copy", [False, True])
def test_copied_experts_and_the_shared_copy_hold_the_whole_ffn(shared_copy):
    dense = dense_model("bert")
    w_act = [ffn.w_act.clone() for ffn in dense_ffns(dense)]
    moe = build(dense, n_experts=3, mode="copy", shared_copy=shared_copy)
    for layer, w in zip(moe.moe_ffns(), w_act, strict=True):
        assert all(torch.equal(layer.experts.w_in[e], w.t()) for e in range(3))
        assert (layer.shared is not None) == shared_copy
        if shared_copy:
            assert torch.equal(layer.shared.w_in[0], w.t())


@pytest.mark.parametrize("order", [[1, 0, 1], (1,)])
def test_a_layer_order_rebuilds_the_layers_before_the_experts_are_read(order):
    dense = dense_model("bert")
    w_act = [ffn.w_act.clone() for ffn in dense_ffns(dense)]
    moe = build(dense, mode="copy", layer_order=order)
    assert len(moe.moe_ffns()) == len(order) == moe.config.text_config.num_hidden_layers
    for layer, i in zip(moe.moe_ffns(), order, strict=True):
        assert torch.equal(layer.experts.w_in[0], w_act[i].t())


def test_a_dtype_loads_and_builds_every_weight_in_it(bert_dir):
    moe = build(bert_dir, dtype=torch.float64)
    assert {p.dtype for p in moe.parameters()} == {torch.float64}


# ----------------------------------------------------------------- one seed for every draw
def test_one_seed_gives_one_model_whatever_the_callers_generator_and_leaves_it_alone(bert_dir):
    """A BERT folder as a causal LM, copy mode with random routers: its new LM head and the routers
    are drawn; the routers from their own generator, the head from torch's, seeded and restored."""

    def weights(seed, outer):
        torch.manual_seed(outer)
        expected = torch.rand(3)
        torch.manual_seed(outer)
        moe = build(bert_dir, causal=True, mode="copy", seed=seed)
        assert torch.equal(torch.rand(3), expected)  # the caller's generator is where it was
        return moe, moe.state_dict()

    (moe, a), (_, b), (_, c) = weights(5, 11), weights(5, 12), weights(6, 12)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    head = [k for k in a if k.endswith("cls.predictions.transform.dense.weight")]
    assert head and not torch.equal(a[head[0]], c[head[0]])
    gen = torch.Generator().manual_seed(5)
    for row in rows(moe):
        assert torch.equal(row, torch.randn(4, 32, generator=gen) * 0.02)


def test_only_the_cpu_generator_is_seeded(monkeypatch):
    """Every draw is made on the CPU; the fork restores only the CPU generator, so seeding the
    accelerators' (torch.manual_seed) would leave the caller's CUDA generator reset to the seed."""
    dense, seeded = dense_model("bert"), []  # (the test's dense model is built with torch.manual_seed)
    monkeypatch.setattr(torch.cuda, "manual_seed_all", seeded.append)
    monkeypatch.setattr(torch.cuda, "manual_seed", seeded.append)
    build(dense, mode="copy", seed=9)
    assert seeded == []


# ----------------------------------------------------------------- calibration, balancing, start report
def test_the_calibration_sample_is_asked_for_with_the_callers_ids_mask_seed_and_tokenizer(monkeypatch):
    calls = spy(monkeypatch, "_calibration_sample")
    mask, tokenizer = torch.ones_like(SAMPLE), tiny_tokenizer()
    moe = build(calibration_mask=mask, seed=4, tokenizer=tokenizer)
    [(args, kwargs)] = calls
    assert args[0] is moe and args[1] is SAMPLE and args[2] is mask and args[3:] == (4, tokenizer)
    assert kwargs == {}


def test_only_a_folder_without_calibration_or_tokenizer_lends_its_own_tokenizer(monkeypatch, bert_dir):
    tiny_tokenizer().save_pretrained(bert_dir)
    calls = spy(monkeypatch, "_calibration_sample", (SAMPLE, torch.ones_like(SAMPLE)))
    given = tiny_tokenizer()
    build(str(bert_dir), calibration=None)
    build(bert_dir, calibration=SAMPLE)
    build(bert_dir, calibration=None, tokenizer=given)
    build(AutoModel.from_pretrained(bert_dir), calibration=None)
    lent, *others = [args[4] for args, _ in calls]
    assert lent.get_vocab() == given.get_vocab() and lent is not given
    assert others == [None, given, None] and others[1] is given


@pytest.mark.parametrize(
    ("router_type", "balance", "called"),
    [
        ("noisy_top_k", None, True),
        ("loss_free", None, True),
        ("loss_free", False, False),
        ("switch", False, False),
    ],
)
def test_every_router_is_balanced_by_default_on_the_first_three_quarters(
    monkeypatch, router_type, balance, called
):
    calls = spy(monkeypatch, "balance_routers", result="not run")
    mask = torch.ones_like(SAMPLE)
    mask[:, 10:] = 0
    args = {
        "n_experts": 4,
        "top_k": 1,
        "router_type": router_type,
        "router_init": "zero",
        "calibration": SAMPLE,
    }
    if balance is not None:  # else upcycle()'s own default
        args["balance_router"] = balance
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", up.UpcycleWarning)
        moe = up.upcycle(dense_model("bert"), calibration_mask=mask, **args)
    assert len(calls) == int(called)
    if called:
        [((model, weights, ids, fit_mask), kwargs)] = calls
        assert model is moe and kwargs == {} and len(weights) == 2
        assert all(torch.equal(w, torch.zeros(4, 32)) for w in weights)
        assert torch.equal(ids, SAMPLE[:24]) and torch.equal(fit_mask, mask[:24])


def test_the_start_report_is_measured_on_the_last_quarter_without_its_padding():
    mask = torch.ones_like(SAMPLE)
    mask[24:, 4:] = 0
    moe = build(top_k=2, calibration_mask=mask)
    assert moe.router_load_report == up.router_load_report(moe, SAMPLE[24:], mask[24:])
    assert moe.router_load_report != up.router_load_report(moe, SAMPLE[24:])  # the padding matters


def test_a_real_collapse_warns_with_every_collapsed_layer():
    """A zero router ties: every token takes the same two of four experts in both layers."""
    message = (
        "the upcycled routers start collapsed in 2 of 2 layers on the calibration sample's unseen "
        "quarter: layer 0 (max/mean 2.00, 2 dead); layer 1 (max/mean 2.00, 2 dead) (ceiling 2.00 = "
        f"experts / top-k); {TRAINING}"
    )
    with pytest.warns(up.UpcycleWarning, match=f"^{re.escape(message)}$"):
        up.upcycle(dense_model("bert"), n_experts=4, top_k=2, router_init="zero", balance_router=False)


def _warnings_of(monkeypatch, report):
    """The `UpcycleWarning`s ``(text, stacklevel)`` of an upcycle whose start report is ``report``
    (``warnings.warn`` recorded: under a wrapper such as mutmut's the frame it names differs)."""
    spy(monkeypatch, "router_load_report", report)
    warned = []
    monkeypatch.setattr(
        warnings,
        "warn",
        lambda message, category, stacklevel=1: warned.append((message, category, stacklevel)),
    )
    moe = up.upcycle(dense_model("bert"), n_experts=4, top_k=1, balance_router=False, calibration=SAMPLE)
    assert moe.router_load_report is report
    return [(message, level) for message, category, level in warned if category is up.UpcycleWarning]


TRAINING = (
    "training reinforces a collapse: keep the router balancing on, balance on text like the model's own "
    "(calibration), and train with a loss_free router"
)


def test_the_warning_names_only_the_collapsed_layers_and_points_at_the_caller(monkeypatch):
    row = {"max_over_mean": 1.25, "dead": 0, "collapsed": False, "ceiling": 4.0}
    report = [
        {**row, "layer": 0},
        {**row, "layer": 1, "max_over_mean": 3.456, "dead": 1, "collapsed": True},
        {**row, "layer": 2, "max_over_mean": 2.0, "dead": 0, "collapsed": True},
    ]
    assert _warnings_of(monkeypatch, report) == [
        (
            "the upcycled routers start collapsed in 2 of 3 layers on the calibration sample's unseen quarter: "
            f"layer 1 (max/mean 3.46, 1 dead); layer 2 (max/mean 2.00, 0 dead) (ceiling 4.00 = experts / top-k); {TRAINING}",
            2,
        )
    ]
    monkeypatch.undo()
    assert _warnings_of(monkeypatch, report[:1]) == []
    monkeypatch.undo()
    one = [{**row, "layer": 0, "max_over_mean": 4.0, "dead": 3, "collapsed": True}]  # a one-layer model
    [(message, _)] = _warnings_of(monkeypatch, one)
    assert message.endswith(": layer 0 (max/mean 4.00, 3 dead) (ceiling 4.00 = experts / top-k); " + TRAINING)


# ----------------------------------------------------------------- loading the dense model
CAUSAL_ENCODER = (
    "causal=True needs a path or name (the causal LM class is built at load time); "
    "load the encoder with is_decoder=True yourself or pass its path"
)


def test_a_loaded_model_is_passed_through_after_its_layer_order_and_causality_are_checked():
    dense = dense_model("bert")
    assert up._load_dense(dense, None) is dense
    assert up._load_dense(dense, torch.float64, layer_order=[1, 1, 0]) is dense
    assert next(dense.parameters()).dtype == torch.float32  # a loaded model is not converted
    with pytest.raises(
        ValueError, match=r"^layer order must be a non-empty list of layer indices in \[0, 2\), got \[0, 2\]$"
    ):
        up._load_dense(dense, None, causal=True, layer_order=[0, 2])  # the order is checked first
    with pytest.raises(ValueError, match=f"^{re.escape(CAUSAL_ENCODER)}$"):
        up._load_dense(dense, None, True)
    decoder = dense_model("bert", is_decoder=True)
    llama = dense_model("llama")
    assert up._load_dense(decoder, None, True) is decoder and up._load_dense(llama, None, True) is llama


def test_a_folder_loads_as_saved_or_as_a_causal_lm_in_the_dtype_asked(bert_dir, tmp_path):
    plain = up._load_dense(bert_dir, None)
    assert type(plain) is BertModel and not plain.config.is_decoder
    assert {p.dtype for p in plain.parameters()} == {torch.float32}
    causal = up._load_dense(str(bert_dir), torch.float64, causal=True, layer_order=[1, 0, 1])
    assert type(causal) is BertLMHeadModel and causal.config.is_decoder
    assert {p.dtype for p in causal.parameters()} == {torch.float64}
    assert torch.equal(
        causal.bert.embeddings.word_embeddings.weight, plain.embeddings.word_embeddings.weight.double()
    )
    dense_model("llama").save_pretrained(tmp_path / "llama")
    assert [type(up._load_dense(tmp_path / "llama", None, causal)) for causal in (False, True)] == [
        LlamaForCausalLM
    ] * 2


def test_a_folder_is_checked_before_its_weights_load(bert_dir, tmp_path):
    """The layer order against the saved layer count; the family before the order (a GPT-NeoX
    folder with only its config); a missing local folder by name; weights other than safetensors."""
    with pytest.raises(ValueError, match=r"in \[0, 2\), got \[0, 2\]$"):
        up._load_dense(bert_dir, None, layer_order=[0, 2])
    GPTNeoXConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4
    ).save_pretrained(tmp_path / "neox")
    with pytest.raises(
        ValueError,
        match="^upcycling does not support model_type 'gpt_neox'; "
        "supported: bert, gpt2, llama, mistral, qwen2, qwen3, roberta$",
    ):
        up._load_dense(tmp_path / "neox", None, layer_order=[5])
    missing = tmp_path / "missing"
    with pytest.raises(
        FileNotFoundError, match=f"^model directory {re.escape(repr(str(missing)))} not found"
    ):
        up._load_dense(missing, None)
    pickled = tmp_path / "pickled"
    dense_config("bert").save_pretrained(pickled)
    torch.save(dense_model("bert").state_dict(), pickled / "pytorch_model.bin")
    with pytest.raises(OSError, match="no file named model.safetensors"):
        up._load_dense(pickled, None)


# ----------------------------------------------------------------- saving
@pytest.mark.slow
def test_save_writes_the_model_staged_and_replaces_a_non_empty_folder_only_when_told(tmp_path):
    moe = build(top_k=2)
    out = tmp_path / "moe"
    files = ["config.json", "model.safetensors"]
    assert up.save_upcycled(moe, str(out)) == out
    assert [p.name for p in tmp_path.iterdir()] == ["moe"]  # no staging folder left beside it
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == files
    refused = f"^output folder {re.escape(str(out))} exists and is not empty; pass --overwrite to replace it$"
    with pytest.raises(FileExistsError, match=refused):
        up.save_upcycled(moe, out)
    (out / "notes.txt").write_text("by hand")
    assert up.save_upcycled(moe, out, overwrite=True) == out
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == [*files, "notes.txt"]
    assert torch.equal(outputs(AutoModel.from_pretrained(out), IDS), outputs(moe, IDS))
    with pytest.raises(NotADirectoryError, match="^output folder .* is a file"):
        up.save_upcycled(moe, out / "config.json", overwrite=True)


def test_save_writes_the_given_tokenizer_else_the_one_of_tokenizer_from(tmp_path):
    from transformers import AutoTokenizer

    moe = build()
    source, given = tiny_tokenizer(), tiny_tokenizer()
    source.model_max_length, given.model_max_length = 9, 7
    source.save_pretrained(tmp_path / "tok")
    up.save_upcycled(moe, tmp_path / "from", tokenizer_from=tmp_path / "tok")
    up.save_upcycled(moe, tmp_path / "both", tokenizer=given, tokenizer_from=tmp_path / "tok")
    up.save_upcycled(moe, tmp_path / "given", tokenizer=given)
    saved = [AutoTokenizer.from_pretrained(tmp_path / name) for name in ("from", "both", "given")]
    assert [tok.model_max_length for tok in saved] == [9, 7, 7]
    assert all(tok.get_vocab() == given.get_vocab() for tok in saved)


@pytest.mark.slow
def test_the_calibration_forward_covers_every_row_in_batches_with_the_attention_mask():
    """An unpadded token's FFN input does not depend on what the padding holds: the mask reaches
    the base model, each batch of 16 rows with its own mask rows (row r padded from column 6 + r % 6)."""
    moe = build()
    mask = torch.ones_like(SAMPLE)
    for r in range(len(SAMPLE)):
        mask[r, 6 + r % 6 :] = 0
    refilled = torch.where(mask.bool(), SAMPLE, 4)

    def ffn_inputs(ids):
        seen = []
        hooks = [
            ffn.register_forward_pre_hook(lambda _m, args, i=i: seen.append((i, args[0].detach())))
            for i, ffn in enumerate(moe.moe_ffns())
        ]
        try:
            with torch.no_grad():
                up._forward_base(moe, ids, mask)
        finally:
            for hook in hooks:
                hook.remove()
        return [torch.cat([x for j, x in seen if j == i]) for i in range(2)]

    assert not torch.equal(refilled, SAMPLE)
    for x, y in zip(ffn_inputs(SAMPLE), ffn_inputs(refilled), strict=True):
        assert x.shape[:2] == SAMPLE.shape
        torch.testing.assert_close(x[mask.bool()], y[mask.bool()], rtol=1e-5, atol=1e-6)
