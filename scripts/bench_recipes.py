"""Benchmark (BENCHMARKS.md, "Recipes"): throughput of every training-free recipe against the plain one.

Every recipe of ``moee.embed.recipes`` (plus the nine-prompt ensemble, a mid-layer HS and a reference
standardisation) embeds the same length-mixed texts with the same model and batch size, timed
**interleaved** in one process (``moee.benchmarking.time_interleaved``), so load changes hit every
variant alike. Reported per variant: texts/s, model tokens/s (the tokens the recipe actually feeds
the model: echo about doubles them, the ensemble multiplies them by nine, token prepending adds one
per text) and the median per-repetition time ratio to ``plain``.

    nice -n 10 env OMP_NUM_THREADS=1 python scripts/bench_recipes.py [--model minilm-moe|PATH] [--texts 256]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from moee.benchmarking import length_mix_texts, paired_ratio, summarize, time_interleaved, write_result
from moee.embed.config import EmbeddingConfig
from moee.embed.recipes import RECIPE_NAMES
from moee.provenance import model_label

#: The variants timed: name -> configuration (``{reference}`` is filled with a fitted reference).
VARIANTS: dict[str, dict] = {
    "plain": {"prompt": "prompteol"},
    **{name: {"prompt": "prompteol", "recipe": name} for name in RECIPE_NAMES},
    "ensemble_stability": {"prompt": "stability"},
    "hs_layer_mid": {"prompt": "prompteol", "hs_layer": "mid"},
    "reference": {"prompt": "prompteol", "reference": "{reference}"},
}


def model_tokens(embedder, texts: list[str], config: EmbeddingConfig) -> int:
    """Tokens the configuration feeds the model for ``texts`` (every ensemble prompt, recipe included)."""
    return sum(
        len(t.ids)
        for template in config.prompt_templates
        for t in embedder._tokenize_recipe(texts, template, config.recipe)
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="minilm-moe", help="model name or path (default: minilm-moe)")
    parser.add_argument("--texts", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--method", default="moee_sum", help="the method embedded (recipes cost the same for all)"
    )
    parser.add_argument("--name", default="recipes")
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args(argv)

    from moee.capture.registry import _decoder_layers
    from moee.embed.embedder import MoEEmbedder

    emb = MoEEmbedder.from_pretrained(args.model, device="cpu")
    texts = length_mix_texts(args.texts, seed=0)
    n_layers = len(_decoder_layers(emb.model))
    with tempfile.TemporaryDirectory() as tmp:
        # the variants are EmbeddingConfig(...)s (last-token pooling), so fit the reference under the same pooling
        reference = emb.fit_reference(
            length_mix_texts(128, seed=1),
            Path(tmp) / "ref",
            prompt="prompteol",
            pooling=EmbeddingConfig().pooling,
        )
        configs = {}
        for name, fields in VARIANTS.items():
            fields = dict(fields)
            if fields.get("hs_layer") == "mid":
                fields["hs_layer"] = n_layers // 2
            if fields.get("reference") == "{reference}":
                fields["reference"] = str(reference)
            configs[name] = EmbeddingConfig(method=args.method, **fields)
        tokens = {name: model_tokens(emb, texts, c) for name, c in configs.items()}
        calls = {
            name: (
                lambda c=c: emb.encode(texts, config=c, batch_size=args.batch_size, show_progress_bar=False)
            )
            for name, c in configs.items()
        }
        times = time_interleaved(calls, repeats=args.repeats, warmup=1)
        labels = {name: c.experiment_kwargs() for name, c in configs.items()}  # while the reference exists
    variants = {}
    for name in configs:
        stats = summarize(times[name], work=len(texts), unit="texts")
        variants[name] = {
            "config": labels[name],
            **stats,
            "model_tokens": tokens[name],
            "tokens_per_s": tokens[name] / stats["median_s"],
            "token_ratio_vs_plain": tokens[name] / tokens["plain"],
            "time_ratio_vs_plain": paired_ratio(times[name], times["plain"]),
        }
    result = {
        "model": model_label(emb.name_or_path),
        "shape": {"decoder_layers": n_layers, "moe_layers": emb.n_moe_layers, "experts": emb.n_experts},
        "texts": len(texts),
        "batch_size": args.batch_size,
        "repeats": args.repeats,
        "method": args.method,
        "variants": variants,
    }
    out = write_result(args.name, result, args.out_dir)
    for name, v in variants.items():
        print(
            f"{name:22s} {v['texts_per_s']:8.1f} texts/s {v['tokens_per_s']:9.0f} tokens/s "
            f"tokens x{v['token_ratio_vs_plain']:.2f} time x{v['time_ratio_vs_plain']:.2f}"
        )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
