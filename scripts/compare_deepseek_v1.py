"""Check moee's native DeepSeekMoE v1 against the original modeling code, on tiny random checkpoints.

Two steps in two environments (``scripts/compare_deepseek_v1.sh`` runs both and builds the first):

``reference --out DIR``  (transformers 4.45, the vendored original code in
    ``scripts/deepseek_v1_reference``): builds tiny random DeepSeekMoE v1 models with the original
    classes, saves each as a checkpoint in the original layout (``save_pretrained``: safetensors,
    original weight names, ``config.json`` with ``model_type="deepseek"`` and the hub's ``auto_map``,
    the modeling files next to it, a byte-level tokenizer that adds BOS), and records the original
    forward's final-norm hidden state and softmax routing scores at the last token, for texts of
    different lengths with and without PromptEOL, **left padded in one batch** (positions counting
    real tokens), plus each text alone unpadded.
``compare --dir DIR``  (this project's environment, transformers 5): loads every checkpoint with
    ``moee.MoEEmbedder.from_pretrained`` (no remote code), checks the routers come from the declared
    registry path (no pattern fallback; dense layers skipped; shared experts not routers), embeds the
    same texts (``trace``: HS last token, RW softmax) in one batch and in batches of two, and fails
    when any max abs difference exceeds ``--atol`` (1e-4). Writes ``DIR/comparison.json``.

Run:

    bash scripts/compare_deepseek_v1.sh            # builds /tmp/ds-venv once, then both steps
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
REFERENCE_CODE = ROOT / "deepseek_v1_reference"

#: Texts of different lengths (bytes = tokens with the byte-level tokenizer), one empty.
TEXTS = [
    "A cat.",
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "",
    "Mixture-of-experts routers pick a few experts per token; their softmax scores are an embedding.",
    "Ünïcödé text — with non-ASCII bytes.",
    "ok",
]


def _render(texts: list[str], prompt: str | None) -> list[str]:
    """moee's own prompt rendering (``moee/embed/prompts.py``, standard library only), loaded by path so
    the reference step needs no moee install: both sides must feed the same tokens, checked in ``compare``."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "_moee_prompts", ROOT.parent / "moee" / "embed" / "prompts.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.render_prompts(texts, prompt)


#: The tiny models: one shaped like deepseek-moe-16b (dense first layer, 2 shared experts, top-k
#: without renormalisation), one covering the other options (MoE every 2nd layer, no shared
#: experts, renormalised top-k, attention bias, grouped keys/values, linear RoPE scaling, eager).
VARIANTS: dict[str, dict] = {
    "like_16b": {
        "hidden_size": 64,
        "intermediate_size": 96,
        "moe_intermediate_size": 24,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_shared_experts": 2,
        "n_routed_experts": 8,
        "num_experts_per_tok": 3,
        "moe_layer_freq": 1,
        "first_k_dense_replace": 1,
        "norm_topk_prob": False,
        "scoring_func": "softmax",
        "aux_loss_alpha": 0.001,
        "seq_aux": True,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "max_position_embeddings": 512,
        "_attn_implementation": "sdpa",
    },
    "options": {
        "hidden_size": 48,
        "intermediate_size": 80,
        "moe_intermediate_size": 16,
        "num_hidden_layers": 5,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "n_shared_experts": None,
        "n_routed_experts": 6,
        "num_experts_per_tok": 2,
        "moe_layer_freq": 2,
        "first_k_dense_replace": 1,
        "norm_topk_prob": True,
        "scoring_func": "softmax",
        "rope_theta": 5000.0,
        "rope_scaling": {"type": "linear", "factor": 2.0},
        "attention_bias": True,
        "max_position_embeddings": 512,
        "_attn_implementation": "eager",
    },
}
AUTO_MAP = {
    "AutoConfig": "configuration_deepseek.DeepseekConfig",
    "AutoModel": "modeling_deepseek.DeepseekModel",
    "AutoModelForCausalLM": "modeling_deepseek.DeepseekForCausalLM",
}
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"


def _byte_tokenizer(out: Path):
    """A byte-level tokenizer (one token per byte, ids 0-255) that adds BOS, saved to ``out``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    vocab[BOS], vocab[EOS] = len(vocab), len(vocab) + 1
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, vocab[BOS])]
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=BOS, eos_token=EOS, model_max_length=512
    )
    tok.save_pretrained(out)
    return tok


def _randomise(model, seed: int) -> None:
    """Weights large enough that routing is peaked (top-k matters) and every layer changes the state."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * noise)
            elif name.endswith("mlp.gate.weight"):
                param.copy_(0.5 * noise)
            elif name.endswith("bias"):
                param.copy_(0.05 * noise)
            else:
                param.copy_(0.08 * noise)


def reference(out: Path) -> int:
    """Build the checkpoints with the original code and record its outputs (transformers 4.x)."""
    import torch
    import transformers
    from safetensors.torch import save_file

    sys.path.insert(0, str(ROOT))
    from deepseek_v1_reference.configuration_deepseek import DeepseekConfig
    from deepseek_v1_reference.modeling_deepseek import DeepseekForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    meta = {"transformers": transformers.__version__, "torch": torch.__version__, "variants": {}}
    for seed, (variant, settings) in enumerate(VARIANTS.items()):
        target = out / variant
        if target.exists():
            shutil.rmtree(target)
        tok = _byte_tokenizer(target)
        settings = dict(settings)
        attn = settings.pop("_attn_implementation")
        config = DeepseekConfig(
            vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, **settings
        )
        config._attn_implementation = attn
        torch.manual_seed(seed)
        model = DeepseekForCausalLM(config).eval()
        _randomise(model, seed)
        model.save_pretrained(target, safe_serialization=True)
        saved = json.loads((target / "config.json").read_text())
        saved["auto_map"] = AUTO_MAP  # as on the hub: moee must ignore it without trust_remote_code
        saved.pop("_attn_implementation", None)
        (target / "config.json").write_text(json.dumps(saved, indent=2))
        for name in ("modeling_deepseek.py", "configuration_deepseek.py"):
            shutil.copy(REFERENCE_CODE / name, target / name)

        tensors = {}
        tok.padding_side = "left"
        tok.pad_token = tok.eos_token
        for prompt in ("none", "prompteol"):
            rendered = _render(TEXTS, None if prompt == "none" else "prompteol")
            batch = tok(rendered, padding=True, return_tensors="pt")
            mask = batch["attention_mask"]
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            with torch.no_grad():
                outputs, scores = model.model(
                    input_ids=batch["input_ids"], attention_mask=mask, position_ids=positions, use_cache=False
                )
            tensors[f"{prompt}/hs"] = outputs.last_hidden_state[:, -1].float().contiguous()
            tensors[f"{prompt}/rw"] = scores[:, :, -1, :].float().contiguous()  # [n, moe layers, experts]
            alone_hs, alone_rw = [], []
            for text in rendered:  # each text alone, no padding, default positions
                ids = tok([text], return_tensors="pt")["input_ids"]
                with torch.no_grad():
                    o, s = model.model(input_ids=ids, use_cache=False)
                alone_hs.append(o.last_hidden_state[0, -1])
                alone_rw.append(s[0, :, -1, :])
            tensors[f"{prompt}/hs_alone"] = torch.stack(alone_hs).float().contiguous()
            tensors[f"{prompt}/rw_alone"] = torch.stack(alone_rw).float().contiguous()
            for i, text in enumerate(rendered):
                tensors[f"{prompt}/ids/{i}"] = torch.tensor(tok(text)["input_ids"], dtype=torch.long)
        model.to(torch.bfloat16)  # informational: the dtype the 16B model is run in
        for prompt in ("none", "prompteol"):
            batch = tok(
                _render(TEXTS, None if prompt == "none" else "prompteol"), padding=True, return_tensors="pt"
            )
            mask = batch["attention_mask"]
            with torch.no_grad():
                outputs, scores = model.model(
                    input_ids=batch["input_ids"],
                    attention_mask=mask,
                    position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                    use_cache=False,
                )
            tensors[f"bf16/{prompt}/hs"] = outputs.last_hidden_state[:, -1].float().contiguous()
            tensors[f"bf16/{prompt}/rw"] = scores[:, :, -1, :].float().contiguous()
        save_file(tensors, str(target / "reference.safetensors"))
        moe_layers = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate")]
        meta["variants"][variant] = {
            "moe_layers": moe_layers,
            "n_layers": config.num_hidden_layers,
            "attn_implementation": attn,
        }
        print(f"{variant}: saved {target} (MoE layers {moe_layers})", file=sys.stderr)
    (out / "reference.json").write_text(json.dumps(meta, indent=2))
    return 0


def compare(directory: Path, atol: float) -> int:
    """Embed with moee (transformers 5, no remote code) and compare against the recorded outputs."""
    import warnings

    import numpy as np
    import torch
    import transformers
    from safetensors.torch import load_file

    sys.path.insert(0, str(ROOT.parent))
    import moee
    from moee.capture import router_report
    from moee.embed.prompts import render_prompts, resolve_prompt
    from moee.models.deepseek_v1 import DeepseekV1ForCausalLM

    meta = json.loads((directory / "reference.json").read_text())
    results = {
        "reference": {"transformers": meta["transformers"], "torch": meta["torch"]},
        "moee": {"transformers": transformers.__version__, "torch": torch.__version__},
        "atol": atol,
        "variants": {},
    }
    worst = 0.0
    for variant, info in meta["variants"].items():
        path = directory / variant
        ref = load_file(str(path / "reference.safetensors"))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # e.g. the pattern-finder warning must not appear
            emb = moee.MoEEmbedder.from_pretrained(path, device="cpu")
        assert isinstance(emb.model, DeepseekV1ForCausalLM), type(emb.model)
        report = router_report(emb.model)
        assert [r.kind for r in emb.routers] == ["mlp"] * len(emb.routers), "routers not from the registry"
        assert [r.layer_index for r in emb.routers] == info["moe_layers"], report
        assert report["dense_layers"] == [i for i in range(info["n_layers"]) if i not in info["moe_layers"]]
        assert all(r.name.endswith(".mlp.gate") for r in emb.routers), [r.name for r in emb.routers]
        diffs: dict[str, float] = {}
        for prompt in ("none", "prompteol"):
            p = None if prompt == "none" else "prompteol"
            rendered = render_prompts(TEXTS, resolve_prompt(p))
            ids = emb.tokenizer(rendered, add_special_tokens=True)["input_ids"]
            for i, row in enumerate(ids):
                assert row == ref[f"{prompt}/ids/{i}"].tolist(), (
                    f"{variant}/{prompt}: tokens of text {i} differ"
                )
            for batch_size in (len(TEXTS), 2):
                trace = emb.trace(TEXTS, prompt=p, score="softmax", pooling="last", batch_size=batch_size)
                for key, got in (("hs", trace.hs), ("rw", trace.rw)):
                    for suffix in ("", "_alone"):
                        want = ref[f"{prompt}/{key}{suffix}"].numpy()
                        assert got.shape == want.shape, (key, got.shape, want.shape)
                        diffs[f"{prompt}/{key}/batch{batch_size}/vs_original{suffix or '_padded'}"] = float(
                            np.abs(got - want).max()
                        )
        # bfloat16 on both sides, same attention kernel, one batch: reported, not held to atol (the
        # original also rounds its softmax scores to bfloat16; moee takes the softmax in float32).
        emb16 = moee.MoEEmbedder.from_pretrained(
            path, device="cpu", dtype=torch.bfloat16, attn_implementation=info["attn_implementation"]
        )
        bf16: dict[str, float] = {}
        for prompt in ("none", "prompteol"):
            trace = emb16.trace(
                TEXTS, prompt=None if prompt == "none" else "prompteol", batch_size=len(TEXTS)
            )
            for key, got in (("hs", trace.hs), ("rw", trace.rw)):
                want = ref[f"bf16/{prompt}/{key}"].numpy()
                bf16[f"{prompt}/{key}"] = float(np.abs(got - want).max())
                bf16[f"{prompt}/{key}/reference_max_abs"] = float(np.abs(want).max())
        ref_self = max(
            float((ref[f"{p}/{k}"] - ref[f"{p}/{k}_alone"]).abs().max())
            for p in ("none", "prompteol")
            for k in ("hs", "rw")
        )
        results["variants"][variant] = {
            "max_abs_diff": diffs,
            "worst_hs": max(v for k, v in diffs.items() if "/hs/" in k),
            "worst_rw": max(v for k, v in diffs.items() if "/rw/" in k),
            "original_padded_vs_alone": ref_self,
            "bfloat16_max_abs_diff": bf16,
            "moe_layers": info["moe_layers"],
            "dense_layers": report["dense_layers"],
            "n_experts": emb.n_experts,
        }
        worst = max(worst, *diffs.values())
        print(
            f"{variant}: max abs diff HS {results['variants'][variant]['worst_hs']:.2e}, "
            f"RW {results['variants'][variant]['worst_rw']:.2e} (original padded vs alone {ref_self:.2e}); "
            f"bfloat16 HS {max(v for k, v in bf16.items() if k.endswith('/hs')):.2e}, "
            f"RW {max(v for k, v in bf16.items() if k.endswith('/rw')):.2e}; "
            f"MoE layers {info['moe_layers']}, dense {report['dense_layers']}",
            file=sys.stderr,
        )
    results["worst"] = worst
    (directory / "comparison.json").write_text(json.dumps(results, indent=2))
    ok = worst <= atol
    print(f"{'OK' if ok else 'FAILED'}: worst max abs diff {worst:.2e} (atol {atol:g})", file=sys.stderr)
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="step", required=True)
    ref = sub.add_parser(
        "reference", help="build checkpoints and outputs with the original code (transformers 4.x)"
    )
    ref.add_argument("--out", type=Path, required=True)
    cmp_ = sub.add_parser("compare", help="compare moee against the recorded outputs (transformers 5)")
    cmp_.add_argument("--dir", type=Path, required=True)
    cmp_.add_argument("--atol", type=float, default=1e-4)
    args = parser.parse_args()
    if args.step == "reference":
        return reference(args.out)
    return compare(args.dir, args.atol)


if __name__ == "__main__":
    sys.exit(main())
