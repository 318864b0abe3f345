"""Training-free recipes (moee/embed/recipes.py, moee/embed/reference.py): each one on a case with a
known answer, batch invariance for every recipe on a representative set of architectures, and their
configuration, CLI and evaluation plumbing."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from moee.capture import supported_architectures
from moee.capture.registry import _decoder_layers
from moee.capture.tiny import tiny_config, tiny_model, tiny_tokenizer
from moee.embed.config import EmbeddingConfig
from moee.embed.embedder import MoEEmbedder
from moee.embed.methods import METHODS
from moee.embed.prompts import PROMPTEOL, STABILITY_PROMPTS, prepare_text, render_prompt
from moee.embed.recipes import (
    ECHO_PREFIX,
    RECIPE_NAMES,
    TokenPrepending,
    parse_hs_layer,
    parse_rw_layers,
    placeholder_id,
    select_rw,
    token_prepending_layers,
)
from moee.embed.reference import Reference, reference_paths

TEXTS = ["the cat sat on the mat", "a dog ran under the big green tree", "music", "", "the bird flew"]
ATOL = 1e-5


@pytest.fixture(scope="module")
def emb() -> MoEEmbedder:
    return MoEEmbedder(tiny_model("olmoe", n_layers=3), tiny_tokenizer())


def _final_states(emb: MoEEmbedder, ids: list[int]) -> np.ndarray:
    """The backbone's final-norm states ``[T, d]`` of one sequence, without moee's hooks."""
    with torch.inference_mode():
        out = emb._backbone(input_ids=torch.tensor([ids]), use_cache=False)
    return out.last_hidden_state[0].numpy()


# ---------------------------------------------------------------------------- echo
def test_echo_pools_only_the_second_copy(emb):
    text = "the cat sat on the mat"
    (tok,) = emb._tokenize_recipe([text], "prompteol", "echo")
    rendered = render_prompt(text, ECHO_PREFIX + PROMPTEOL)
    assert tok.ids == emb.tokenizer(rendered)["input_ids"]
    second = emb.tokenizer(render_prompt(text, "prompteol"))["input_ids"]
    assert tok.ids[tok.pool_from :] == second  # exactly the second (prompted) copy is pooled
    states = _final_states(emb, tok.ids)
    mean = emb.encode([text], method="hs", prompt="prompteol", recipe="echo", pooling="mean", normalize=False)
    last = emb.encode([text], method="hs", prompt="prompteol", recipe="echo", normalize=False)
    np.testing.assert_allclose(mean[0], states[tok.pool_from :].mean(0), atol=ATOL)
    np.testing.assert_allclose(last[0], states[-1], atol=ATOL)
    assert not np.allclose(mean[0], states.mean(0), atol=1e-3)  # the first copy would change the mean


def test_echo_without_prompt_repeats_the_text_as_given(emb):
    """No prompt: both copies are the text exactly as given (no full stop added, quotes kept)."""
    for text in ("the dog ran", 'the "dog" ran'):
        (tok,) = emb._tokenize_recipe([text], None, "echo")
        assert tok.ids[tok.pool_from :] == emb.tokenizer(text)["input_ids"]
        assert tok.ids == emb.tokenizer(ECHO_PREFIX.replace("{text}", text) + text)["input_ids"]
    assert prepare_text("the dog ran") != "the dog ran"  # a prepared copy would differ


def test_echo_truncation_keeps_the_second_copy_whole():
    short = MoEEmbedder(tiny_model("olmoe", n_layers=2), tiny_tokenizer(), max_length=14)
    text = "the cat sat on the mat under the big green tree"
    with pytest.warns(UserWarning, match="cut") as caught:
        (tok,) = short._tokenize_recipe([text], None, "echo")
    assert len(tok.ids) <= 14
    second = tok.ids[tok.pool_from :]
    lost = len(text.split()) - len(second)  # the words the text lost (each a token here), once
    assert f"by {lost}-{lost} tokens ({lost} in all)" in str(caught[0].message)
    words = short.tokenizer.convert_ids_to_tokens(second)
    assert words and words[0] == "the"  # the second copy starts with the text's first word
    prefix = short.tokenizer.convert_ids_to_tokens(tok.ids[: tok.pool_from])
    assert words[:-1] == prefix[3 : 3 + len(words) - 1]  # both copies hold the same kept words


# ---------------------------------------------------------------------------- token prepending
def test_token_prepending_layers_are_the_first_quarter():
    assert token_prepending_layers(32) == list(range(1, 9))
    assert token_prepending_layers(8) == [1, 2]
    assert token_prepending_layers(2) == [1]
    with pytest.raises(ValueError, match="at least 2 decoder layers"):
        token_prepending_layers(1)


def test_token_prepending_inserts_one_placeholder_before_the_text(emb):
    text, template = "the cat sat", "a big {text} on the mat"
    (tok,) = emb._tokenize_recipe([text], template, "token_prepending")
    plain = emb.tokenizer(render_prompt(text, template))["input_ids"]
    prefix = emb.tokenizer("a big", add_special_tokens=False)["input_ids"]
    assert tok.ids == [*plain[: tok.placeholder], placeholder_id(emb.tokenizer), *plain[tok.placeholder :]]
    assert tok.placeholder == len(prefix)  # right before the text's first token


def _layer_inputs(
    emb: MoEEmbedder, ids: list[int], layer: int, prepend: TokenPrepending | None
) -> torch.Tensor:
    seen = {}
    module = [m for _, m in _decoder_layers(emb.model)][layer]

    def grab(mod, args, kwargs):
        seen["h"] = (args[0] if args else kwargs["hidden_states"]).clone()

    with torch.inference_mode():
        if prepend is not None:
            prepend.__enter__()
            prepend.set_batch(torch.tensor([1]), torch.tensor([len(ids) - 1]))
        handle = module.register_forward_pre_hook(grab, with_kwargs=True)  # runs after the recipe's hook
        try:
            emb._backbone(input_ids=torch.tensor([ids]), use_cache=False)
        finally:
            handle.remove()
            if prepend is not None:
                prepend.__exit__()
    return seen["h"][0]


def test_token_prepending_replaces_only_the_placeholder_state(emb):
    ids = emb.tokenizer("[BOS] the cat sat on the mat")["input_ids"]  # placeholder at position 1
    plain0 = _layer_inputs(emb, ids, 1, None)
    tp = _layer_inputs(emb, ids, 1, TokenPrepending(emb.model, layers=[1]))
    changed = (tp != plain0).any(dim=1)
    assert changed.tolist() == [i == 1 for i in range(len(ids))]  # one row only: the placeholder
    torch.testing.assert_close(tp[1], plain0[-1])  # ... which holds the previous layer's last-token state


def test_token_prepending_disabled_changes_nothing(emb):
    text = ["the cat sat on the mat"]
    (tok,) = emb._tokenize_recipe(text, None, "token_prepending")
    states = _final_states(emb, tok.ids)
    with TokenPrepending(emb.model, layers=()) as off:
        off.set_batch(torch.tensor([tok.placeholder]), torch.tensor([len(tok.ids) - 1]))
        with torch.inference_mode():
            out = emb._backbone(input_ids=torch.tensor([tok.ids]), use_cache=False).last_hidden_state[0]
    np.testing.assert_allclose(out.numpy(), states, atol=1e-6)
    on = emb.encode(text, method="hs", recipe="token_prepending", normalize=False)
    assert not np.allclose(on[0], states[-1], atol=1e-4)  # enabled, it does change the vector
    np.testing.assert_allclose(_final_states(emb, tok.ids), states, atol=1e-6)  # and leaves no hook behind


def test_token_prepending_never_pools_the_placeholder(emb):
    text = ["the cat sat on the mat"]
    (tok,) = emb._tokenize_recipe(text, None, "token_prepending")
    with TokenPrepending(emb.model) as prepend:  # the recipe's forward, by hand
        prepend.set_batch(torch.tensor([tok.placeholder]), torch.tensor([len(tok.ids) - 1]))
        states = _final_states(emb, tok.ids)
    keep = [i for i in range(len(tok.ids)) if i != tok.placeholder]
    got = emb.encode(text, method="hs", recipe="token_prepending", pooling="mean", normalize=False)
    np.testing.assert_allclose(got[0], states[keep].mean(0), atol=ATOL)
    last = emb.encode(text, method="hs", recipe="token_prepending", normalize=False)
    np.testing.assert_allclose(last[0], states[-1], atol=ATOL)


def test_token_prepending_refuses_a_model_without_decoder_layers():
    with pytest.raises(ValueError, match="cannot find the decoder layers"):
        TokenPrepending(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="must be in 1"):
        TokenPrepending(tiny_model("olmoe", n_layers=2), layers=[0])


# ---------------------------------------------------------------------------- ensembles
@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_ensemble_is_the_mean_of_the_single_prompt_embeddings(emb, method):
    prompts = ["prompteol", "meaning", "style"]
    singles = [emb.encode(TEXTS, method=method, prompt=p, normalize=False) for p in prompts]
    got = emb.encode(TEXTS, method=method, prompt=prompts, normalize=False)
    np.testing.assert_allclose(got, np.mean(singles, axis=0), atol=ATOL)
    units = [emb.encode(TEXTS, method=method, prompt=p) for p in prompts]
    mean = np.mean(units, axis=0)
    np.testing.assert_allclose(
        emb.encode(TEXTS, method=method, prompt=prompts),
        mean / np.linalg.norm(mean, axis=1, keepdims=True),
        atol=ATOL,
    )


@pytest.mark.slow
def test_stability_ensemble_is_the_nine_prompts(emb):
    config = EmbeddingConfig(prompt="stability")
    assert config.prompt_templates == tuple(STABILITY_PROMPTS.values()) and config.is_ensemble
    np.testing.assert_allclose(
        emb.encode(TEXTS[:2], method="rw", prompt="stability"),
        emb.encode(TEXTS[:2], method="rw", prompt=list(STABILITY_PROMPTS)),
        atol=ATOL,
    )


# ---------------------------------------------------------------------------- layer choice
def test_hs_layer_reads_a_decoder_layer_or_the_mean_of_a_range(emb):
    trace = emb.trace(TEXTS, hs_layers=True)
    for layer, want in (
        (1, trace.hs_all_layers[:, 1]),
        (-1, trace.hs_all_layers[:, 2]),
        ((0, 2), trace.hs_all_layers[:, :2].mean(1)),
    ):
        got = emb.encode(TEXTS, method="hs", hs_layer=layer, normalize=False)
        np.testing.assert_allclose(got, want, atol=ATOL)
    with pytest.raises(ValueError, match="out of range"):
        emb.encode(TEXTS, method="hs", hs_layer=3)


def test_rw_layers_select_and_weigh_moe_layers(emb):
    rw = emb.trace(TEXTS).rw
    np.testing.assert_allclose(
        emb.encode(TEXTS, method="rw", rw_layers=[2, 0], normalize=False),
        rw[:, [0, 2]].reshape(5, -1),
        atol=ATOL,
    )
    weighted = emb.encode(TEXTS, method="rw", rw_layers={0: 0.5, 2: 2.0}, normalize=False)
    np.testing.assert_allclose(weighted, np.concatenate([0.5 * rw[:, 0], 2.0 * rw[:, 2]], axis=1), atol=ATOL)
    assert emb.encode(TEXTS, method="moee_sum", rw_layers=[1]).shape[1] == emb.hidden_size + emb.n_experts
    with pytest.raises(ValueError, match="out of range"):
        select_rw(rw, (3,))


def test_layer_options_parse_their_cli_forms():
    assert (
        parse_hs_layer("4") == 4 and parse_hs_layer("2:6") == (2, 6) and parse_hs_layer(range(1, 3)) == (1, 3)
    )
    assert parse_rw_layers("2,0") == (0, 2) and parse_rw_layers("0:0.5,3:2") == ((0, 0.5), (3, 2.0))
    for bad, match in (("a", "hs_layer"), ((3, 1), "empty")):
        with pytest.raises(ValueError, match=match):
            parse_hs_layer(bad)
    for bad, match in (([0, 0], "twice"), ({0: -1}, ">= 0"), ({0: 0.0}, "all 0"), ([], "at least one")):
        with pytest.raises(ValueError, match=match):
            parse_rw_layers(bad)


# ---------------------------------------------------------------------------- reference standardisation
@pytest.mark.slow
def test_reference_gives_a_text_alone_its_corpus_vector(emb, tmp_path):
    corpus = TEXTS * 2 + ["the red house", "a small blue bird sat on the tree"]
    path = emb.fit_reference(corpus, tmp_path / "ref", prompt="prompteol")
    assert path == tmp_path / "ref.safetensors" and reference_paths(path)[1].is_file()
    for method in METHODS:
        together = emb.encode(TEXTS, method=method, prompt="prompteol", reference=path, batch_size=2)
        alone = np.stack(
            [emb.encode([t], method=method, prompt="prompteol", reference=path)[0] for t in TEXTS]
        )
        np.testing.assert_allclose(together, alone, atol=ATOL)
    trace = emb.trace(corpus, prompt="prompteol")
    mean, std = trace.hs.astype(np.float64).mean(0), trace.hs.astype(np.float64).std(0)
    z = emb.encode(TEXTS, method="hs", prompt="prompteol", reference=path, normalize=False)
    np.testing.assert_allclose(z, (emb.trace(TEXTS, prompt="prompteol").hs - mean) / std, atol=1e-4)
    meta = json.loads((tmp_path / "ref.json").read_text())
    assert meta["n_texts"] == len(corpus) and meta["model"]["revision"] == emb.weights_digest
    assert meta["features"]["prompt_templates"] == [EmbeddingConfig(prompt="prompteol").prompt_template]


def test_reference_of_another_model_or_configuration_is_refused(emb, tmp_path):
    path = emb.fit_reference(TEXTS, tmp_path / "ref")
    with pytest.raises(ValueError, match="fitted under another configuration .*prompt_templates"):
        emb.encode(TEXTS, prompt="prompteol", reference=path)
    other = MoEEmbedder(tiny_model("olmoe", n_layers=3, seed=1), tiny_tokenizer())
    with pytest.raises(ValueError, match="not on this model"):
        other.encode(TEXTS, reference=path)
    with pytest.raises(FileNotFoundError, match="fit-reference"):
        emb.encode(TEXTS, reference=tmp_path / "missing")
    (tmp_path / "ref.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(ValueError, match="not a moee reference"):
        Reference.load(path)


@pytest.mark.slow
def test_reference_fitted_under_another_recipe_is_refused(emb, tmp_path):
    plain = emb.fit_reference(TEXTS, tmp_path / "plain", prompt="prompteol")
    echo = emb.fit_reference(TEXTS, tmp_path / "echo", prompt="prompteol", recipe="echo")
    for path, recipe, fitted in ((plain, "echo", "None"), (echo, None, "'echo'")):
        with pytest.raises(ValueError, match=f"another configuration .*recipe: reference {fitted}"):
            emb.encode(TEXTS, prompt="prompteol", recipe=recipe, reference=path)
    emb.encode(TEXTS, prompt="prompteol", recipe="echo", reference=echo)  # its own recipe is fine


def test_reference_fitted_at_another_max_length_is_refused(emb, tmp_path):
    path = emb.fit_reference(TEXTS, tmp_path / "ref")
    assert json.loads((tmp_path / "ref.json").read_text())["features"]["max_length"] == emb.max_length
    short = MoEEmbedder(emb.model, emb.tokenizer, max_length=6)
    with pytest.raises(ValueError, match=f"max_length: reference {emb.max_length} vs now 6"):
        short.encode(TEXTS, reference=path)
    with pytest.warns(UserWarning, match="longer than 6 tokens"):
        short.fit_reference(TEXTS, tmp_path / "short")
        short.encode(TEXTS, reference=tmp_path / "short.safetensors")


@pytest.mark.parametrize("saved", [False, True], ids=["in-memory", "from-files"])
def test_reference_is_refused_once_the_weights_change_in_memory(tmp_path, tiny_model_dir, saved):
    """The weights digest follows the live parameters: a weight changed after loading (or after the
    reference was fitted) is not the model the reference belongs to, also when loaded from files."""
    from moee.capture import find_routers

    if saved:
        fresh = MoEEmbedder.from_pretrained(tiny_model_dir, device="cpu")
    else:
        fresh = MoEEmbedder(tiny_model("olmoe", n_layers=2), tiny_tokenizer())
    before = fresh.weights_digest
    path = fresh.fit_reference(TEXTS, tmp_path / "ref")
    weight = find_routers(fresh.model)[0].module.weight
    with torch.no_grad():
        weight.mul_(2.0)
    assert fresh.weights_digest != before
    with pytest.raises(ValueError, match="not on this model"):
        fresh.encode(TEXTS, reference=path)
    if not saved:  # the live digest is the weights' content: the same values give it back
        with torch.no_grad():
            weight.div_(2.0)
        assert fresh.weights_digest == before
        fresh.encode(TEXTS, reference=path)


# ---------------------------------------------------------------------------- every recipe, batch invariant
def _moee_lm():
    from test_moe_lm import tiny_config as moee_lm_config

    from moee.moe.lm import MoEEForCausalLM

    torch.manual_seed(0)
    model = MoEEForCausalLM(moee_lm_config(pad_token_id=0, eos_token_id=3))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "router" in name or "gate" in name:
                p.normal_(0, 0.5)
    return model.eval()


def _upcycled():
    from transformers import AutoModelForCausalLM, LlamaConfig

    from moee.moe.upcycle import upcycle

    torch.manual_seed(0)
    dense = AutoModelForCausalLM.from_config(
        LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        ),
        dtype=torch.float32,
    ).eval()
    return upcycle(dense, n_experts=4, top_k=2, mode="split", router_std=1.0).eval()


ARCHITECTURES = {
    "olmoe": lambda: tiny_model("olmoe"),
    "qwen2_moe": lambda: tiny_model("qwen2_moe"),
    "mixtral": lambda: tiny_model("mixtral"),
    "deepseek_v3": lambda: tiny_model("deepseek_v3"),
    "moee_lm": _moee_lm,
    "upcycled_llama": _upcycled,
}
RECIPE_CONFIGS = [
    EmbeddingConfig(recipe="echo", prompt="prompteol"),
    EmbeddingConfig(recipe="echo", pooling="mean"),
    EmbeddingConfig(recipe="token_prepending", prompt="prompteol"),
    EmbeddingConfig(prompt=["prompteol", "meaning"]),
    EmbeddingConfig(hs_layer=(0, 2), rw_layers={0: 1.0, -1: 0.5}),
]


@pytest.mark.slow
@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_every_recipe_is_batch_invariant(arch, tmp_path):
    emb = MoEEmbedder(ARCHITECTURES[arch](), tiny_tokenizer())
    reference = emb.fit_reference(TEXTS, tmp_path / "ref", prompt="prompteol")
    for config in [*RECIPE_CONFIGS, EmbeddingConfig(prompt="prompteol", reference=str(reference))]:
        hs, rw = emb.features(TEXTS, config, batch_size=3)
        alone = [emb.features([t], config) for t in TEXTS]
        # z-scores divide float32 noise by a reference std fitted on five texts: compare relatively
        tol = {"atol": 1e-4, "rtol": 1e-4} if config.reference else {"atol": ATOL}
        for got, want in ((hs, [a[0] for a in alone]), (rw, [a[1] for a in alone])):
            np.testing.assert_allclose(got, np.concatenate(want), **tol, err_msg=str(config))
        assert np.isfinite(hs).all() and np.isfinite(rw).all()
        for method in METHODS:
            vectors = emb.encode(TEXTS, config=config.replace(method=method), batch_size=3)
            assert vectors.shape == (len(TEXTS), emb.config_dim(config.replace(method=method)))


def test_every_registered_recipe_is_covered():
    assert set(RECIPE_NAMES) == {c.recipe for c in RECIPE_CONFIGS if c.recipe}


# ---------------------------------------------------------------------------- configuration and defaults
def test_recipe_options_name_their_own_result_folder_and_round_trip(tmp_path, emb):
    plain = EmbeddingConfig(prompt="prompteol")
    assert list(plain.to_dict()) == [
        "method",
        "pooling",
        "prompt",
        "prompt_template",
        "score",
        "alpha",
        "normalize",
    ]
    ref = emb.fit_reference(TEXTS, tmp_path / "r", prompt="prompteol")
    seen = {tuple(sorted(plain.experiment_kwargs().items()))}
    for config in [*RECIPE_CONFIGS, plain.replace(reference=str(ref))]:
        kwargs = config.experiment_kwargs()
        assert tuple(sorted(kwargs.items())) not in seen
        seen.add(tuple(sorted(kwargs.items())))
        assert EmbeddingConfig.from_dict(config.to_dict()) == config
        json.dumps(config.to_dict())
    assert (
        EmbeddingConfig(prompt="prompteol", reference=str(ref)).experiment_kwargs()["reference"]
        == (json.loads((tmp_path / "r.json").read_text())["sha256"])
    )
    assert "echo" in RECIPE_CONFIGS[0].label and "hs_layer=0:2" in RECIPE_CONFIGS[4].label
    with pytest.raises(ValueError, match="unknown recipe"):
        EmbeddingConfig(recipe="repeat")


def test_paper_configuration_is_one_call():
    paper = EmbeddingConfig.paper()
    assert (paper.method, paper.prompt, paper.pooling, paper.score, paper.recipe) == (
        "moee_sum",
        "prompteol",
        "last",
        "softmax",
        None,
    )


@pytest.mark.slow
def test_a_keyword_given_overrides_only_itself_over_the_models_configuration(monkeypatch, emb):
    monkeypatch.setattr(emb, "model_config", EmbeddingConfig(recipe="echo", method="hs"))
    np.testing.assert_allclose(
        emb.encode(TEXTS), emb.encode(TEXTS, config=EmbeddingConfig(recipe="echo", method="hs"))
    )
    np.testing.assert_allclose(  # a keyword given overrides only itself
        emb.encode(TEXTS, method="rw"), emb.encode(TEXTS, config=EmbeddingConfig(recipe="echo", method="rw"))
    )
    with pytest.raises(TypeError, match="pass recipe inside config"):
        emb.encode(TEXTS, config=EmbeddingConfig(), recipe="echo")


# ---------------------------------------------------------------------------- evaluation and CLI
@pytest.mark.slow
def test_mteb_encoder_runs_a_recipe_like_encode(emb):
    from moee.evaluation.adapter import MoEEMTEBEncoder, TraceCache

    config = EmbeddingConfig(method="moee_concat", recipe="echo", prompt=["prompteol", "meaning"])
    enc = MoEEMTEBEncoder(emb, config=config)
    np.testing.assert_allclose(enc.embed_texts(TEXTS), emb.encode(TEXTS, config=config), atol=ATOL)
    assert enc.mteb_model_meta.experiment_kwargs["recipe"] == "echo"
    with pytest.raises(ValueError, match="belongs to another"):
        MoEEMTEBEncoder(emb, config=config, trace_cache=TraceCache(emb, config=config.replace(recipe=None)))


@pytest.mark.slow
def test_cli_fit_reference_then_embed_with_recipes(tmp_path, tiny_model_dir):
    from moee.cli import main
    from moee.io import read_metadata

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(TEXTS * 2) + "\n")
    ref = tmp_path / "ref"
    assert (
        main(
            [
                "fit-reference",
                str(corpus),
                "--out",
                str(ref),
                "--model",
                tiny_model_dir,
                "--recipe",
                "echo",
                "--prompt",
                "prompteol,meaning",
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    out = tmp_path / "e.npy"
    args = [
        "embed",
        str(corpus),
        "--out",
        str(out),
        "--model",
        tiny_model_dir,
        "--device",
        "cpu",
        "--recipe",
        "echo",
        "--prompt",
        "prompteol,meaning",
        "--reference",
        str(ref) + ".safetensors",
        "--overwrite",
        "--hs-layer",
        "-1",
    ]
    assert main(args) == 2  # fitted without --hs-layer: refused, naming the difference
    # a subset of the MoE layers it was fitted on (all): their statistics, then the weights
    assert main(args[:-2] + ["--method", "rw", "--rw-layers", "0:1,1:0.5"]) == 0
    assert main(args[:-2]) == 0
    meta = read_metadata(out)
    assert meta["recipe"] == "echo" and meta["prompt"] == ["prompteol", "meaning"]
    emb = MoEEmbedder.from_pretrained(tiny_model_dir, device="cpu")
    want = emb.encode(
        TEXTS * 2, recipe="echo", prompt=["prompteol", "meaning"], reference=str(ref) + ".safetensors"
    )
    np.testing.assert_allclose(np.load(out), want, atol=ATOL)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", supported_architectures())
def test_token_prepending_and_echo_on_every_supported_architecture(model_type):
    """The decoder layers are found generically on every architecture capture supports, and both
    recipes stay batch-invariant there (hybrids with Mamba / linear-attention layers included)."""
    # Sparse-attention indexers (DeepSeek-V3.2-style) pick their top-k keys before the padding mask,
    # so no embedding is batch-invariant beyond index_topk tokens (2,048 in the released models, 8
    # in the tiny configs): give the tiny ones the released models' headroom.
    extra = {"index_topk": 2048} if hasattr(tiny_config(model_type), "index_topk") else {}
    emb = MoEEmbedder(tiny_model(model_type, **extra), tiny_tokenizer())
    assert TokenPrepending(emb.model).layers  # found, at least one layer hooked
    for config in (
        EmbeddingConfig(recipe="token_prepending"),
        EmbeddingConfig(recipe="echo", pooling="mean"),
    ):
        hs, rw = emb.features(TEXTS, config, batch_size=3)
        alone = [emb.features([t], config) for t in TEXTS]
        np.testing.assert_allclose(hs, np.concatenate([a[0] for a in alone]), atol=ATOL, err_msg=str(config))
        np.testing.assert_allclose(rw, np.concatenate([a[1] for a in alone]), atol=ATOL, err_msg=str(config))


# ---------------------------------------------------------------------------- the small pieces, exactly
class _Tokenizer:
    """The tiny tokenizer behind a proxy: ``fast=False`` hides its offsets; ``drift=True`` gives other
    ids when offsets are asked for (a tokenizer that is not deterministic)."""

    def __init__(self, inner, *, fast: bool = True, drift: bool = False) -> None:
        self.inner, self.is_fast, self.drift = inner, fast, drift

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, *args, **kwargs):
        out = self.inner(*args, **kwargs)
        if self.drift and kwargs.get("return_offsets_mapping") and "special_tokens_mask" in out:
            out["input_ids"] = [[*ids[:-1], 1] for ids in out["input_ids"]]
        return out


def _with_tokenizer(emb: MoEEmbedder, tokenizer, max_length: int | None = None) -> MoEEmbedder:
    return MoEEmbedder(emb.model, tokenizer, max_length=max_length or emb.max_length)


def test_placeholder_is_bos_then_eos_then_pad():
    from types import SimpleNamespace

    assert placeholder_id(SimpleNamespace(bos_token_id=7, eos_token_id=8, pad_token_id=9)) == 7
    assert placeholder_id(SimpleNamespace(bos_token_id=None, eos_token_id=8, pad_token_id=9)) == 8
    assert placeholder_id(SimpleNamespace(eos_token_id=None, pad_token_id=9)) == 9  # no bos attribute
    with pytest.raises(ValueError, match=r"^token_prepending needs a BOS, EOS or pad token to use as"):
        placeholder_id(SimpleNamespace())


def test_token_prepending_fits_max_length_and_places_the_placeholder(emb):
    with pytest.raises(ValueError, match=r"^token_prepending needs max_length >= 2 \(one position"):
        _with_tokenizer(emb, emb.tokenizer, 1)._tokenize_recipe(["a dog"], None, "token_prepending")
    (two,) = _with_tokenizer(emb, emb.tokenizer, 2)._tokenize_recipe(["a"], None, "token_prepending")
    assert two.ids == [placeholder_id(emb.tokenizer), *emb.tokenizer("a")["input_ids"]]
    long = "a dog ran under the big green tree"
    with pytest.warns(UserWarning, match="cut on the right"):
        (cut,) = _with_tokenizer(emb, emb.tokenizer, 5)._tokenize_recipe([long], None, "token_prepending")
    assert len(cut.ids) == 5 and cut.placeholder == 0  # the text cut to 4 tokens, then the placeholder
    assert cut.ids[1:] == emb.tokenizer("a dog ran under")["input_ids"]
    left = _with_tokenizer(emb, emb.tokenizer, 5)
    emb.tokenizer.truncation_side = "left"
    try:
        with pytest.warns(UserWarning, match="cut on the left"):
            (end,) = left._tokenize_recipe([long], None, "token_prepending")
    finally:
        emb.tokenizer.truncation_side = "right"
    assert end.ids[1:] == emb.tokenizer("the big green tree")["input_ids"]
    (twice,) = emb._tokenize_recipe(["dog"], "a {text} and {text}", "token_prepending")
    assert twice.placeholder == 1  # before the first copy of the text
    (empty,) = emb._tokenize_recipe([""], None, "token_prepending")
    assert empty.ids == [*emb.empty_ids, placeholder_id(emb.tokenizer)]
    assert empty.placeholder == len(emb.empty_ids)


def test_plain_tokenization_renders_the_prompt_and_cuts_on_the_tokenizer_side(emb):
    text = "the cat sat on the mat"
    (tok,) = emb._tokenize_recipe([text], "a {text} big", None)
    assert tok.ids == emb.tokenizer(render_prompt(text, "a {text} big"))["input_ids"]
    short = _with_tokenizer(emb, emb.tokenizer, 3)
    emb.tokenizer.truncation_side = "left"
    try:
        with pytest.warns(UserWarning, match="cut on the left"):
            (end,) = short._tokenize_recipe([text], None, None)
    finally:
        emb.tokenizer.truncation_side = "right"
    assert end.ids == emb.tokenizer("on the mat")["input_ids"]


@pytest.mark.parametrize("recipe", ["echo", "token_prepending"])
def test_recipes_refuse_slow_and_drifting_tokenizers_by_name(emb, recipe):
    slow = _with_tokenizer(emb, _Tokenizer(emb.tokenizer, fast=False))
    with pytest.raises(ValueError, match=rf"^recipe '{recipe}' needs a fast tokenizer \(character offsets\)"):
        slow._tokenize_recipe(["a dog"], None, recipe)
    drifting = _with_tokenizer(emb, _Tokenizer(emb.tokenizer, drift=True))
    what = "echo text" if recipe == "echo" else "text"
    with pytest.raises(RuntimeError, match=rf"^the tokenizer gave different ids for the same {what}$"):
        drifting._tokenize_recipe(["a dog"], None, recipe)


def test_layer_choice_bounds_and_types():
    from moee.embed.recipes import rw_layer_count, select_hs

    with pytest.raises(TypeError, match=r"^hs_layer must be an int, got True$"):
        parse_hs_layer(True)
    hs = np.arange(2 * 3 * 2, dtype=np.float32).reshape(2, 3, 2)
    np.testing.assert_array_equal(select_hs(hs, -3), hs[:, 0])
    np.testing.assert_array_equal(select_hs(hs, (-3, 3)), hs.mean(axis=1))
    np.testing.assert_array_equal(select_hs(hs, (-3, 1)), hs[:, 0])
    for bad in ((0, 4), (-4, 2)):
        with pytest.raises(
            ValueError, match=rf"^hs_layer range {bad[0]}:{bad[1]} is out of range for 3 decoder"
        ):
            select_hs(hs, bad)
    wide = np.array([[[16777216.0], [1.0], [1.0]]], dtype=np.float32)  # float32 sums would lose the 1s
    out = select_hs(wide, (0, 3))
    assert out.dtype == np.float32 and out[0, 0] == np.float32(16777218 / 3)
    assert select_hs(hs.astype(np.float64), 0).dtype == np.float32
    rw = np.arange(2 * 3 * 2, dtype=np.float64).reshape(2, 3, 2)
    np.testing.assert_array_equal(select_rw(rw, (-3,)), rw[:, [0]])
    assert select_rw(rw, (0,)).dtype == np.float32
    np.testing.assert_array_equal(select_rw(rw, ((0, 2.0),)), 2 * rw[:, [0]])
    with pytest.raises(ValueError, match=r"twice once negative indices are resolved: \[0, -3\]$"):
        select_rw(rw, (0, -3))
    assert rw_layer_count(None, 5) == 5 and rw_layer_count((0, 2), 5) == 2


def test_ensemble_vectors_are_the_renormalised_float64_mean():
    from moee.embed.methods import combine
    from moee.embed.recipes import combine_ensemble, combine_features

    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(3, 4)).astype(np.float32), rng.normal(size=(3, 4)).astype(np.float32)
    b[1] = -a[1]  # this row's mean is zero: it stays zero, no NaN
    mean = (a.astype(np.float64) + b) / 2
    norms = np.linalg.norm(mean, axis=1, keepdims=True)
    want = np.divide(mean, norms, out=np.zeros_like(mean), where=norms > 0)
    got = combine_ensemble([a, b], True)
    assert got.dtype == np.float32 and got.flags.c_contiguous
    np.testing.assert_allclose(got, want, atol=1e-7)
    assert (got[1] == 0).all()
    wide = [
        np.array([[16777216.0]], np.float32),
        np.array([[1.0]], np.float32),
        np.array([[1.0]], np.float32),
    ]
    assert combine_ensemble(wide, False)[0, 0] == np.float32(16777218 / 3)
    hs, rw = rng.normal(size=(3, 2, 4)), rng.random(size=(3, 2, 2, 3))
    for p in range(2):  # the defaults: alpha 1, L2-normalised rows (HS alone shows the norm)
        one = combine_features(hs[:, p : p + 1], rw[:, p : p + 1], "hs")
        np.testing.assert_allclose(one, combine(hs[:, p], rw[:, p], "hs", alpha=1.0, normalize=True))
        assert np.allclose(np.linalg.norm(one, axis=1), 1.0)
        one = combine_features(hs[:, p : p + 1], rw[:, p : p + 1], "moee_sum")
        np.testing.assert_allclose(one, combine(hs[:, p], rw[:, p], "moee_sum", alpha=1.0, normalize=True))
    two = combine_features(hs, rw, "moee_sum", alpha=0.3, normalize=False)
    parts = [combine(hs[:, p], rw[:, p], "moee_sum", alpha=0.3, normalize=False) for p in range(2)]
    np.testing.assert_allclose(two, np.mean(parts, axis=0), atol=1e-6)
    assert not np.allclose(two, combine_features(hs, rw, "moee_sum", normalize=False), atol=1e-3)


def test_token_prepending_hook_needs_its_batch_and_reads_keyword_states(emb):
    prepend = TokenPrepending(emb.model)
    layer = [m for _, m in _decoder_layers(emb.model)][1]
    hidden = torch.arange(2 * 3 * 2, dtype=torch.float32).reshape(2, 3, 2)
    with pytest.raises(RuntimeError, match=r"^call TokenPrepending\.set_batch\(\) before the forward pass$"):
        prepend._hook(layer, (hidden,), {})
    prepend.set_batch(torch.tensor([0, 1]), torch.tensor([2, 2]))
    args, kwargs = prepend._hook(layer, (), {"hidden_states": hidden, "other": 1})
    assert args == () and kwargs["other"] == 1
    want = hidden.clone()
    want[0, 0], want[1, 1] = hidden[0, 2], hidden[1, 2]
    assert torch.equal(kwargs["hidden_states"], want)
    (new, *rest), _ = prepend._hook(layer, (hidden, "mask"), {})
    assert torch.equal(new, want) and rest == ["mask"]


def test_reference_apply_refuses_features_of_another_width():
    ref = Reference(np.full(4, 1.0), np.full(4, 2.0), np.full(6, 0.5), np.full(6, 4.0), meta={})
    hs, rw = np.full((2, 4), 3.0, np.float32), np.full((2, 2, 3), 2.5, np.float32)
    z_hs, z_rw = ref.apply(hs, rw)
    assert z_hs.shape == hs.shape and z_rw.shape == rw.shape
    assert z_hs.dtype == z_rw.dtype == np.float32
    assert (z_hs == 1.0).all() and (z_rw == 0.5).all()  # (3 - 1) / 2 and (2.5 - 0.5) / 4
    assert ref.apply(hs.reshape(2, 2, 2), rw)[0].shape == (2, 2, 2)  # any HS shape comes back as given
    message = r"^reference has HS width 4 and RW width 6, the features have {} and {}$"
    with pytest.raises(ValueError, match=message.format(4, 4)):
        ref.apply(hs, np.ones((2, 2, 2), np.float32))  # RW alone too narrow
    with pytest.raises(ValueError, match=message.format(3, 6)):
        ref.apply(np.ones((2, 3), np.float32), rw)  # HS alone too narrow


def test_reference_centres_constant_dimensions_and_names_a_missing_model():
    from moee.embed.reference import MIN_STD

    ref = Reference(np.array([1.0, 1.0]), np.array([0.0, MIN_STD]), np.zeros(1), np.ones(1), meta={})
    z, _ = ref.apply(np.array([[3.0, 2.0]], np.float32), np.ones((1, 1, 1), np.float32))
    assert z.tolist() == [[2.0, 1.0]]  # std 0 or at the floor: only centred, divided by 1
    with pytest.raises(ValueError, match=r"^reference  was fitted on model None with weights None, not on"):
        ref.check("abc", {})
